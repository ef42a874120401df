// Linear layers over quantized weights kept in their GGUF block layout (no repacking, no fp32 copy).
//
// A weight is a uint8 tensor [N, row_bytes]: row n holds K / block_size blocks of one GGML type
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Two paths, chosen per call by M (rows of x):
//  - small M (decode): each thread takes a range of weight rows, dequantizes one row at a time into
//    an L1/L2-resident float buffer and dots it with every row of x (ISA-specific FMA loops, one
//    accumulator per x row). At M = 1 this streams the quantized bytes once, which is what bounds a
//    decode step.
//  - large M (prefill chunks): each thread dequantizes a tile of weight rows into its own float
//    buffer and multiplies the tile with a single-threaded BLAS call, so dequantization is paid
//    once per weight per call and amortized over M.
// Activations stay float (fp32, or bf16/fp16 converted to fp32 in registers): the result equals
// x @ dequantize(W).T up to summation order, the same weights `--quantization none` multiplies.
//
// Dot products are dispatched at run time between the variants compiled in (AVX-512 with BF16 dot
// products for Q4_0 / Q4_1 at decode sizes (cpu_bf16x2.h), AVX-512, AVX2+FMA, scalar); `quant_isa`
// narrows the choice (tests run every variant on one machine). Int8 weights (w8a8_int8) multiply
// int8 activations (cpu_int8.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_bf16x2.h"
#include "cpu_int8.h"
#include "cpu_i16act.h"
#include "cpu_qvnni.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <utility>
#include <cstring>
#include <string>
#include <vector>

namespace {

// GGML type ids (ggml.h) and block geometry.
enum QType : int64_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  BF16 = 30,
  // Not a GGML type: int8 rows with a per-row scale, multiplied with int8 activations (cpu_int8.h).
  W8A8 = 256,
  // Not GGML types: Q4_0 / Q4_1 / Q8_0 rows repacked into row tiles at load (cpu_rowtiles.h;
  // quant_repack): 256 + the file's type.
  Q4_0_R16 = 258,
  Q4_1_R16 = 259,
  Q8_0_R16 = 264,
};

bool row_tiled(int64_t qtype) { return qtype == Q4_0_R16 || qtype == Q4_1_R16 || qtype == Q8_0_R16; }
bool q4_tiled(int64_t qtype) { return qtype == Q4_0_R16 || qtype == Q4_1_R16; }
int64_t untiled_type(int64_t qtype) { return row_tiled(qtype) ? qtype - 256 : qtype; }

struct Geometry {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

Geometry geometry(int64_t qtype) {
  switch (qtype) {
    case Q4_0:
    case Q4_0_R16: return {32, 18};
    case Q4_1:
    case Q4_1_R16: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0:
    case Q8_0_R16: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case BF16: return {32, 64};  // dense bfloat16 rows, multiplied by the same kernels
    case W8A8: return {1, 1};    // plus a header per row (radixserve_int8::row_bytes)
    default: TORCH_CHECK(false, "unsupported quantized weight type ", qtype);
  }
  return {0, 0};
}

// AVX512_BF16: AVX-512 plus the bf16 dot products of cpu_bf16x2.h for Q4_0 / Q4_1 at decode sizes.
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

using radixserve_cpu::half_to_float;
using radixserve_cpu::scale_min_k4;

// ---- dequantization of one block into floats (loops the compiler vectorizes) ----

inline void dq_q4_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 15) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

inline void dq_q4_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 15) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5_0: (q - 16) * d; Q5_1: q * d + m. Bit j of qh is the fifth bit of weight j.
template <bool HAS_MIN>
inline void dq_q5(const uint8_t* b, float* y) {
  constexpr int off = HAS_MIN ? 4 : 2;
  const float d = half_to_float(b), m = HAS_MIN ? half_to_float(b + 2) : 0.f;
  uint32_t qh;
  std::memcpy(&qh, b + off, 4);
  const uint8_t* qs = b + off + 4;
  const int bias = HAS_MIN ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 15) | h0) - bias) * d + m;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - bias) * d + m;
  }
}

inline void dq_q8_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

inline void dq_q4_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {
    int sc, m;
    scale_min_k4(2 * j, scales, sc, m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    scale_min_k4(2 * j + 1, scales, sc, m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 15) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

inline void dq_q5_k(const uint8_t* b, float* y) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j) {
    int sc, m;
    scale_min_k4(2 * j, scales, sc, m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    scale_min_k4(2 * j + 1, scales, sc, m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    const int u1 = 1 << (2 * j), u2 = 2 << (2 * j);
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>((ql[l] & 15) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    y += 64;
  }
}

inline void dq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int n = 0; n < 2; ++n) {
    float s[8];
    for (int i = 0; i < 8; ++i) s[i] = d * static_cast<float>(sc[i]);
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = s[is] * static_cast<float>(q1);
      y[l + 32] = s[is + 2] * static_cast<float>(q2);
      y[l + 64] = s[is + 4] * static_cast<float>(q3);
      y[l + 96] = s[is + 6] * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

inline void dq_bf16(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) {
    uint32_t bits = static_cast<uint32_t>(b[2 * j]) | (static_cast<uint32_t>(b[2 * j + 1]) << 8);
    bits <<= 16;
    std::memcpy(y + j, &bits, 4);
  }
}

template <void (*DQ)(const uint8_t*, float*), int64_t QK, int64_t BYTES>
void dq_row_impl(const uint8_t* row, int64_t k, float* y) {
  for (int64_t i = 0; i < k / QK; ++i) DQ(row + i * BYTES, y + i * QK);
}

using RowDequant = void (*)(const uint8_t*, int64_t, float*);

RowDequant row_dequantizer(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return dq_row_impl<dq_q4_0, 32, 18>;
    case Q4_1: return dq_row_impl<dq_q4_1, 32, 20>;
    case Q5_0: return dq_row_impl<dq_q5<false>, 32, 22>;
    case Q5_1: return dq_row_impl<dq_q5<true>, 32, 24>;
    case Q8_0: return dq_row_impl<dq_q8_0, 32, 34>;
    case Q4_K: return dq_row_impl<dq_q4_k, 256, 144>;
    case Q5_K: return dq_row_impl<dq_q5_k, 256, 176>;
    case Q6_K: return dq_row_impl<dq_q6_k, 256, 210>;
    case BF16: return dq_row_impl<dq_bf16, 32, 64>;
    case W8A8: return radixserve_int8::dequantize_row;
    default: TORCH_CHECK(false, "unsupported quantized weight type ", qtype);
  }
  return nullptr;
}

int best_isa() {
#if defined(RADIXSERVE_HAVE_BF16X2)
  return AVX512_BF16;
#elif defined(__AVX512F__)
  return AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
  return AVX2;
#else
  return SCALAR;
#endif
}

std::atomic<int> g_isa{best_isa()};
// Whether bf16 GEMMs are fast on this CPU (set from Python, which reads the CPU flags).
std::atomic<bool> g_fast_bf16{false};
// When batches above the decode sizes multiply Q4_0 / Q4_1 / Q8_0 weights with int8 activations
// (cpu_qvnni.h): 0 never, 1 for bf16 / fp16 activations, 2 for float32 ones too. Set from Python
// (1 on AVX-512 VNNI CPUs without AMX).
std::atomic<int> g_int8_tiles{0};

const char* isa_name(int isa) {
  switch (isa) {
    case AVX512_BF16: return "avx512_bf16";
    case AVX512: return "avx512";
    case AVX2: return "avx2";
    default: return "scalar";
  }
}

// Per-thread scratch that only grows: the hot path allocates nothing once warm.
std::vector<float>& scratch(int which) {
  thread_local std::vector<float> buffers[2];  // 0: a row / results, 1: a prefill tile
  return buffers[which];
}

float* scratch_floats(int which, int64_t n) {
  auto& v = scratch(which);
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// ---- fused kernels: decode blocks in registers and multiply, for the common formats ----
//
// `V16` holds 16 floats (one zmm, or two ymm); the decoders work on 16-byte SSE vectors of quants
// (shared by both ISAs) and call emit(w, offset) for each 16 weights, in order, with the weights
// already scaled. The row loop multiplies each `w` into up to 4 rows of x.

#if defined(__AVX2__) && defined(__FMA__)
using radixserve_cpu::hsum256;
using radixserve_cpu::load16;
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }

#if defined(__AVX512F__)
struct V512 {
  __m512 v;
  static V512 from_u8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
  static V512 from_i8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
  static V512 zero() { return {_mm512_setzero_ps()}; }
  V512 scale(float d, float m) const { return {_mm512_fmadd_ps(v, _mm512_set1_ps(d), _mm512_set1_ps(m))}; }
  V512 fma_x(const float* x, V512 acc) const { return {_mm512_fmadd_ps(v, _mm512_loadu_ps(x), acc.v)}; }
  // 4-bit quants by table lookup: the 16 possible weights q * d + m of a block are computed once
  // (one FMA, the same arithmetic as converting each quant), then each 16 weights are one permute
  // instead of a convert and an FMA.
  struct Table {
    __m512 t;
  };
  static Table nibble_table(float d, float m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m))};
  }
  static V512 from_nibbles(__m128i q, const Table& table) {
    return {_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), table.t)};
  }
  // Both nibbles of 16 bytes: vpermps reads only the low 4 bits of each index, so the low nibbles
  // need no mask and the high ones one shift of the widened bytes.
  template <class E>
  static void emit_nibbles(__m128i bytes, const Table& lo, const Table& hi, int64_t off_lo, int64_t off_hi, E&& emit) {
    const __m512i z = _mm512_cvtepu8_epi32(bytes);
    emit(V512{_mm512_permutexvar_ps(z, lo.t)}, off_lo);
    emit(V512{_mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), hi.t)}, off_hi);
  }
  static V512 from_bf16(const uint8_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void store(float* y) const { _mm512_storeu_ps(y, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#endif

struct V256 {
  __m256 a, b;
  static V256 from_u8(__m128i q) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
  }
  static V256 from_i8(__m128i q) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
  }
  static V256 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  V256 scale(float d, float m) const {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    return {_mm256_fmadd_ps(a, vd, vm), _mm256_fmadd_ps(b, vd, vm)};
  }
  struct Table {
    float d, m;
  };
  static Table nibble_table(float d, float m) { return {d, m}; }
  static V256 from_nibbles(__m128i q, const Table& table) { return from_u8(q).scale(table.d, table.m); }
  template <class E>
  static void emit_nibbles(__m128i bytes, const Table& lo, const Table& hi, int64_t off_lo, int64_t off_hi, E&& emit) {
    emit(from_nibbles(low_nibbles(bytes), lo), off_lo);
    emit(from_nibbles(high_nibbles(bytes), hi), off_hi);
  }
  static V256 from_bf16(const uint8_t* p) {
    const __m128i lo = load16(p), hi = load16(p + 16);
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
  }
  void store(float* y) const {
    _mm256_storeu_ps(y, a);
    _mm256_storeu_ps(y + 8, b);
  }
  V256 fma_x(const float* x, V256 acc) const {
    return {_mm256_fmadd_ps(a, _mm256_loadu_ps(x), acc.a), _mm256_fmadd_ps(b, _mm256_loadu_ps(x + 8), acc.b)};
  }
  float sum() const { return hsum256(_mm256_add_ps(a, b)); }
};


struct FQ4_0 {
  static constexpr int64_t QK = 32, BYTES = 18;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    const float d = half_to_float(b);
    const auto table = V::nibble_table(d, -8.f * d);
    V::emit_nibbles(load16(b + 2), table, table, 0, 16, emit);
  }
};

struct FQ4_1 {
  static constexpr int64_t QK = 32, BYTES = 20;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const auto table = V::nibble_table(d, m);
    V::emit_nibbles(load16(b + 4), table, table, 0, 16, emit);
  }
};

// Byte j of the result is 0x10 where bit (j + 16 * upper) of qh is set: the fifth bit of Q5_0/Q5_1.
inline __m128i fifth_bits(uint32_t qh, int upper) {
  const __m128i v = _mm_set1_epi32(static_cast<int>(qh));
  const __m128i pick = upper ? _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                             : _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(v, pick), bit), bit);
  return _mm_and_si128(set, _mm_set1_epi8(0x10));
}

template <bool HAS_MIN>
struct FQ5 {
  static constexpr int64_t QK = 32, BYTES = HAS_MIN ? 24 : 22;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    constexpr int off = HAS_MIN ? 4 : 2;
    const float d = half_to_float(b), m = HAS_MIN ? half_to_float(b + 2) : -16.f * d;
    uint32_t qh;
    std::memcpy(&qh, b + off, 4);
    const __m128i v = load16(b + off + 4);
    emit(V::from_u8(_mm_or_si128(low_nibbles(v), fifth_bits(qh, 0))).scale(d, m), 0);
    emit(V::from_u8(_mm_or_si128(high_nibbles(v), fifth_bits(qh, 1))).scale(d, m), 16);
  }
};

struct FBF16 {
  static constexpr int64_t QK = 32, BYTES = 64;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    emit(V::from_bf16(b), 0);
    emit(V::from_bf16(b + 32), 16);
  }
};

struct FQ8_0 {
  static constexpr int64_t QK = 32, BYTES = 34;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    const float d = half_to_float(b);
    emit(V::from_i8(load16(b + 2)).scale(d, 0.f), 0);
    emit(V::from_i8(load16(b + 18)).scale(d, 0.f), 16);
  }
};

template <bool FIVE>
struct FQK {
  static constexpr int64_t QK = 256, BYTES = FIVE ? 176 : 144;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + (FIVE ? 48 : 16);
    const __m128i h0 = FIVE ? load16(qh) : _mm_setzero_si128(), h1 = FIVE ? load16(qh + 16) : _mm_setzero_si128();
    const __m128i one = _mm_set1_epi8(1);
    for (int j = 0; j < 4; ++j, ql += 32) {
      int sc, mn;
      scale_min_k4(2 * j, scales, sc, mn);
      const float d1 = d * static_cast<float>(sc), m1 = -dmin * static_cast<float>(mn);
      scale_min_k4(2 * j + 1, scales, sc, mn);
      const float d2 = d * static_cast<float>(sc), m2 = -dmin * static_cast<float>(mn);
      const __m128i a = load16(ql), c = load16(ql + 16);
      __m128i lo0 = low_nibbles(a), lo1 = low_nibbles(c), hi0 = high_nibbles(a), hi1 = high_nibbles(c);
      if (FIVE) {  // bit 2j of qh[l] is the fifth bit of low-nibble weight l, bit 2j+1 of the high one
        const auto bit = [&](__m128i h, int shift) {
          return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, shift), one), 4);
        };
        lo0 = _mm_or_si128(lo0, bit(h0, 2 * j));
        lo1 = _mm_or_si128(lo1, bit(h1, 2 * j));
        hi0 = _mm_or_si128(hi0, bit(h0, 2 * j + 1));
        hi1 = _mm_or_si128(hi1, bit(h1, 2 * j + 1));
      }
      if (FIVE) {
        emit(V::from_u8(lo0).scale(d1, m1), 64 * j);
        emit(V::from_u8(lo1).scale(d1, m1), 64 * j + 16);
        emit(V::from_u8(hi0).scale(d2, m2), 64 * j + 32);
        emit(V::from_u8(hi1).scale(d2, m2), 64 * j + 48);
      } else {
        const auto t1 = V::nibble_table(d1, m1), t2 = V::nibble_table(d2, m2);
        emit(V::from_nibbles(lo0, t1), 64 * j);
        emit(V::from_nibbles(lo1, t1), 64 * j + 16);
        emit(V::from_nibbles(hi0, t2), 64 * j + 32);
        emit(V::from_nibbles(hi1, t2), 64 * j + 48);
      }
    }
  }
};

struct FQ6_K {
  static constexpr int64_t QK = 256, BYTES = 210;
  template <class V, class E>
  static void decode(const uint8_t* b, E&& emit) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8) {
      for (int half = 0; half < 2; ++half) {  // l in [16 * half, 16 * half + 16)
        const int l = 16 * half;
        const __m128i a = load16(ql + l), c = load16(ql + l + 32), h = load16(qh + l);
        const auto up = [&](int shift) { return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, shift), m2), 4); };
        const __m128i q1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(a, m4), up(0)), off);
        const __m128i q2 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(c, m4), up(2)), off);
        const __m128i q3 = _mm_sub_epi8(_mm_or_si128(high_nibbles(a), up(4)), off);
        const __m128i q4 = _mm_sub_epi8(_mm_or_si128(high_nibbles(c), up(6)), off);
        emit(V::from_i8(q1).scale(d * static_cast<float>(sc[half]), 0.f), 128 * n + l);
        emit(V::from_i8(q2).scale(d * static_cast<float>(sc[half + 2]), 0.f), 128 * n + l + 32);
        emit(V::from_i8(q3).scale(d * static_cast<float>(sc[half + 4]), 0.f), 128 * n + l + 64);
        emit(V::from_i8(q4).scale(d * static_cast<float>(sc[half + 6]), 0.f), 128 * n + l + 96);
      }
    }
  }
};

// out[r] = dot(dequantize(row), x[r]) for r < R.
// Two accumulators per row, alternated by swapping after each 16 weights, so consecutive FMAs
// into a row do not wait on each other's latency (one chain caps a core at 4 weights per cycle).
// Rows of 2048+ inputs prefetch the weights 4 KB ahead, non-temporally: their float activations
// (8+ KB) then stay in L1 beside the streaming weights (an 8B model's LM head, K = 4096: 28.6 -> 31.6
// GB/s on a 2-core Zen 4).
template <class F, class V, int R>
void fused_dot(const uint8_t* row, int64_t k, const float* x, int64_t ldx, float* out) {
  V acc[R], alt[R];
  for (int r = 0; r < R; ++r) acc[r] = alt[r] = V::zero();
  const bool far = k >= 2048;
  for (int64_t bk = 0; bk < k / F::QK; ++bk) {
    const float* xb = x + bk * F::QK;
    if (far) __builtin_prefetch(row + bk * F::BYTES + 4096, 0, 0);  // non-temporal
    F::template decode<V>(row + bk * F::BYTES, [&](V w, int64_t off) {
      for (int r = 0; r < R; ++r) {
        acc[r] = w.fma_x(xb + r * ldx + off, acc[r]);
        std::swap(acc[r], alt[r]);
      }
    });
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r].sum() + alt[r].sum();
}

using FusedDot = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*);

// fused_dot over the values [v0, v1) of a row only (x: those values of R rows, row stride ldx),
// continuing R rows' accumulators kept in `state`
// (acc, alt of each row, zeroed by the caller before the first part); the last part (`out` given)
// writes the sums. A row run part by part in order is fused_dot's arithmetic exactly, so its result
// is fused_dot's bit for bit: the caller takes a tile of weight rows part by part, each part of the
// activations (up to 8 rows x 512 values: 16 KB) staying in L1 across the tile's rows, where fused_dot
// reloads all K of every activation row from L2 for each weight row (8 rows of 2048: 64 KB). A
// 151936 x 2048 Q8_0 LM head on a 2-core Zen 4: 8 rows 63 -> 44 ms (1 row: 10 ms), 2 rows 23 -> 15.
template <class F, class V, int R>
void fused_dot_part(const uint8_t* row, int64_t v0, int64_t v1, const float* x, int64_t ldx, void* state,
                    float* out) {
  // fused_dot's two alternating accumulators as fixed slots: even-numbered vectors of a row into a,
  // odd ones into b (every block decodes to an even number of vectors, so each part starts at a; the
  // final a.sum() + b.sum() is fused_dot's sum in one order or the other, the same float). Swapping
  // arrays of 8 rows' accumulators made the compiler keep them on the stack.
  V* st = static_cast<V*>(state);
  V a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = st[2 * r], b[r] = st[2 * r + 1];
  bool odd = false;
  for (int64_t bk = v0 / F::QK; bk < v1 / F::QK; ++bk) {
    const float* xb = x + (bk * F::QK - v0);
    F::template decode<V>(row + bk * F::BYTES, [&](V w, int64_t off) {
      if (odd) {
        for (int r = 0; r < R; ++r) b[r] = w.fma_x(xb + r * ldx + off, b[r]);
      } else {
        for (int r = 0; r < R; ++r) a[r] = w.fma_x(xb + r * ldx + off, a[r]);
      }
      odd = !odd;
    });
  }
  if (out != nullptr) {
    for (int r = 0; r < R; ++r) out[r] = a[r].sum() + b[r].sum();
    return;
  }
  for (int r = 0; r < R; ++r) st[2 * r] = a[r], st[2 * r + 1] = b[r];
}

using FusedPart = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, void*, float*);

template <class F, class V>
FusedPart fused_part_for_rows(int rows) {
  switch (rows) {
    case 1: return fused_dot_part<F, V, 1>;
    case 2: return fused_dot_part<F, V, 2>;
    case 3: return fused_dot_part<F, V, 3>;
    case 4: return fused_dot_part<F, V, 4>;
    case 5: return fused_dot_part<F, V, 5>;
    case 6: return fused_dot_part<F, V, 6>;
    case 7: return fused_dot_part<F, V, 7>;
    default: return fused_dot_part<F, V, 8>;
  }
}

template <class V>
FusedPart fused_part_for_type(int64_t qtype, int rows) {
  switch (qtype) {
    case Q4_0: return fused_part_for_rows<FQ4_0, V>(rows);
    case Q4_1: return fused_part_for_rows<FQ4_1, V>(rows);
    case Q5_0: return fused_part_for_rows<FQ5<false>, V>(rows);
    case Q5_1: return fused_part_for_rows<FQ5<true>, V>(rows);
    case BF16: return fused_part_for_rows<FBF16, V>(rows);
    case Q8_0: return fused_part_for_rows<FQ8_0, V>(rows);
    case Q4_K: return fused_part_for_rows<FQK<false>, V>(rows);
    case Q5_K: return fused_part_for_rows<FQK<true>, V>(rows);
    case Q6_K: return fused_part_for_rows<FQ6_K, V>(rows);
    default: return nullptr;
  }
}

// A row dequantized to floats (the large-M path's tile fill).
template <class F, class V>
void fused_fill(const uint8_t* row, int64_t k, float* y) {
  for (int64_t bk = 0; bk < k / F::QK; ++bk) {
    float* yb = y + bk * F::QK;
    F::template decode<V>(row + bk * F::BYTES, [&](V w, int64_t off) { w.store(yb + off); });
  }
}

#if defined(__AVX512BF16__)
// A row dequantized straight to bf16 (the bf16 tiles of the large-M path): each 16 decoded floats are
// rounded to nearest even in one instruction (vcvtneps2bf16, c10::BFloat16's rounding for finite values).
using RowDequantBf16 = void (*)(const uint8_t*, int64_t, uint16_t*);
template <class F>
void fused_fill_bf16(const uint8_t* row, int64_t k, uint16_t* y) {
  for (int64_t bk = 0; bk < k / F::QK; ++bk) {
    uint16_t* yb = y + bk * F::QK;
    F::template decode<V512>(row + bk * F::BYTES, [&](V512 w, int64_t off) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + off), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w.v)));
    });
  }
}

RowDequantBf16 bf16_filler(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return fused_fill_bf16<FQ4_0>;
    case Q4_1: return fused_fill_bf16<FQ4_1>;
    case Q5_0: return fused_fill_bf16<FQ5<false>>;
    case Q5_1: return fused_fill_bf16<FQ5<true>>;
    case Q8_0: return fused_fill_bf16<FQ8_0>;
    case Q4_K: return fused_fill_bf16<FQK<false>>;
    case Q5_K: return fused_fill_bf16<FQK<true>>;
    case Q6_K: return fused_fill_bf16<FQ6_K>;
    default: return nullptr;
  }
}
#endif

template <class V>
RowDequant fill_for_type(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return fused_fill<FQ4_0, V>;
    case Q4_1: return fused_fill<FQ4_1, V>;
    case Q5_0: return fused_fill<FQ5<false>, V>;
    case Q5_1: return fused_fill<FQ5<true>, V>;
    case Q8_0: return fused_fill<FQ8_0, V>;
    case Q4_K: return fused_fill<FQK<false>, V>;
    case Q5_K: return fused_fill<FQK<true>, V>;
    case Q6_K: return fused_fill<FQ6_K, V>;
    case BF16: return fused_fill<FBF16, V>;
    default: return nullptr;
  }
}

template <class F, class V>
FusedDot fused_for_rows(int rows) {
  switch (rows) {
    case 1: return fused_dot<F, V, 1>;
    case 2: return fused_dot<F, V, 2>;
    case 3: return fused_dot<F, V, 3>;
    case 4: return fused_dot<F, V, 4>;
    case 5: return fused_dot<F, V, 5>;
    case 6: return fused_dot<F, V, 6>;
    case 7: return fused_dot<F, V, 7>;
    default: return fused_dot<F, V, 8>;
  }
}

template <class V>
FusedDot fused_for_type(int64_t qtype, int rows) {
  switch (qtype) {
    case Q4_0: return fused_for_rows<FQ4_0, V>(rows);
    case Q4_1: return fused_for_rows<FQ4_1, V>(rows);
    case Q5_0: return fused_for_rows<FQ5<false>, V>(rows);
    case Q5_1: return fused_for_rows<FQ5<true>, V>(rows);
    case BF16: return fused_for_rows<FBF16, V>(rows);
    case Q8_0: return fused_for_rows<FQ8_0, V>(rows);
    case Q4_K: return fused_for_rows<FQK<false>, V>(rows);
    case Q5_K: return fused_for_rows<FQK<true>, V>(rows);
    case Q6_K: return fused_for_rows<FQ6_K, V>(rows);
    default: return nullptr;
  }
}
#endif

// The fused kernel for `qtype` in ISA variant `isa` (up to 8 rows), or nullptr (scalar variant).
using FusedDotPtr = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*);
using FusedPartPtr = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, void*, float*);
FusedDotPtr fused_kernel(int isa, int64_t qtype, int rows) {
#if defined(__AVX512F__)
  if (isa >= AVX512) return fused_for_type<V512>(qtype, rows);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= AVX2) return fused_for_type<V256>(qtype, rows);
#endif
  (void)isa, (void)qtype, (void)rows;
  return nullptr;
}

// The part-by-part fused kernel for `isa` (up to 8 rows) and the bytes of its per-row state, or nullptr.
FusedPartPtr fused_part_kernel(int isa, int64_t qtype, int rows, int64_t& state_bytes) {
#if defined(__AVX512F__)
  if (isa >= AVX512) {
    state_bytes = 2 * static_cast<int64_t>(sizeof(V512));
    return fused_part_for_type<V512>(qtype, rows);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= AVX2) {
    state_bytes = 2 * static_cast<int64_t>(sizeof(V256));
    return fused_part_for_type<V256>(qtype, rows);
  }
#endif
  (void)isa, (void)qtype, (void)rows, (void)state_bytes;
  return nullptr;
}

// Row dequantization for `isa`: the fused decoders storing floats, or the portable loops.
RowDequant row_filler(int isa, int64_t qtype) {
#if defined(__AVX512F__)
  if (isa >= AVX512) return fill_for_type<V512>(qtype);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= AVX2) return fill_for_type<V256>(qtype);
#endif
  (void)isa;
  return row_dequantizer(qtype);
}

// out[r] = dot(w, x[r]) for r < rows (the scalar variant; the compiler may still vectorize it).
void dots_scalar(const float* w, const float* x, int64_t ldx, int64_t rows, int64_t k, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float acc[16] = {0.f};
    for (int64_t i = 0; i < k; i += 16)
      for (int l = 0; l < 16; ++l) acc[l] += w[i + l] * xr[i + l];
    float s = 0.f;
    for (int l = 0; l < 16; ++l) s += acc[l];
    out[r] = s;
  }
}

// Rows of x at or below this use the decode-and-dot path (weights decoded once per 8 rows of x);
// above, dequantized tiles and BLAS. Measured crossover on an AVX-512 EPYC: about 24 rows.
constexpr int64_t kSmallM = 24;
// In int8 mode 3 (AMX CPUs) batches up to this many rows take the int8 paths, larger ones the bf16
// tiles: on a 2-core Xeon with AMX, 2 threads, the default model's Q4_1 projections ran 1.1-2.4x
// faster on the int8 paths at 32-128 rows and 1.03-1.7x slower from 192 rows on.
constexpr int64_t kAmxRows = 160;
// Floats in a large-M weight tile (fits a core's L2 with room for the x panel).
constexpr int64_t kTileFloats = 1 << 17;

// Weight values in a bf16 tile (the fast-bf16 path below): half of a core's L2 as bf16. Larger tiles
// mean fewer, larger GEMM calls (each call costs a oneDNN dispatch and scratchpad); a 2-core Xeon with
// AMX (2 MB L2) prefilled 512 tokens of the default model at ~2,830 tok/s with kTileFloats, ~3,250 with
// 2^19 and ~3,100 with 2^18 or 2^20 (runs alternated), and its LM head at 64 rows took 8.0 ms, not 9.7.
int64_t bf16_tile_values() {
  static const int64_t values = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
    const long l2 = 0;
#endif
    return std::clamp<int64_t>(l2 > 0 ? l2 / 4 : kTileFloats, kTileFloats, int64_t(1) << 20);
  }();
  return values;
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "quantized weight must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(qtype != F32 && qtype != F16, "type ", qtype, " is a dense weight, not blocks");
  if (qtype == W8A8) {
    TORCH_CHECK(w.size(1) == radixserve_int8::row_bytes(k), "int8 weight rows hold ", w.size(1),
                " bytes, expected ", radixserve_int8::row_bytes(k), " for K=", k);
    return;
  }
  const Geometry g = geometry(qtype);
  TORCH_CHECK(k % g.block == 0, "K=", k, " is not a multiple of the block size ", g.block, " of type ", qtype);
  TORCH_CHECK(w.size(1) == k / g.block * g.bytes, "weight rows hold ", w.size(1), " bytes, expected ",
              k / g.block * g.bytes, " for K=", k, " of type ", qtype);
}

// A row-tiled weight (cpu_rowtiles.h) back in the file's layout: for the kernels that read the file's
// rows (a caller that changed the ISA or the int8 mode after the weights were repacked).
at::Tensor untile(const at::Tensor& w, int64_t qtype) {
  at::Tensor out = at::empty_like(w);
  const int64_t n = w.size(0), row_bytes = w.size(1), n16 = n / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows;
  const int64_t type = untiled_type(qtype);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* row = radixserve_rowtiles::file_row(wp, row_bytes, n16, type, j, op + j * row_bytes);
      if (row != op + j * row_bytes) std::memcpy(op + j * row_bytes, row, row_bytes);
    }
  });
  return out;
}

// The loop every decode-sized kernel shares: weight rows [begin, end) times the m rows of x, where
// `dot(row, r, rows, res)` fills res[0, rows) for x rows r.. r + rows - 1 (rows <= step).
template <typename out_t, class Dot>
void small_m_rows(const uint8_t* wp, int64_t row_bytes, int64_t begin, int64_t end, int64_t m, int64_t step,
                  out_t* out, int64_t ldo, Dot&& dot) {
  float res[kSmallM];
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* row = wp + j * row_bytes;
    for (int64_t r = 0; r < m; r += step) dot(row, r, static_cast<int>(std::min(step, m - r)), res + r);
    for (int64_t r = 0; r < m; ++r) out[r * ldo + j] = static_cast<out_t>(res[r]);
  }
}

// out[:, :N] = xf @ dequantize(w).T for w's N rows of row_bytes bytes, xf fp32 [M, K] contiguous;
// out is fp32 or the activation dtype, with row stride ldo.
// `x16`: the bf16 activations when prefill tiles should be multiplied in bf16 (else undefined).
template <typename out_t>
void quant_matmul(const float* xf, int64_t m, int64_t k, const uint8_t* wp, int64_t n, int64_t row_bytes,
                  int64_t qtype, out_t* out, int64_t ldo, const at::Tensor& x16, bool exact, int64_t n16 = 0) {
  const int isa = g_isa.load(std::memory_order_relaxed);
  // rows [0, n16) in row tiles (cpu_rowtiles.h): the prefill-sized paths below read them back one by one
  TORCH_CHECK(n16 == 0 || m > kSmallM, "quant_matmul: row tiles at decode sizes take their own kernels");
  auto row_at = [&](int64_t j, std::vector<uint8_t>& tmp) -> const uint8_t* {
    if (j >= n16) return wp + j * row_bytes;
    tmp.resize(row_bytes);
    return radixserve_rowtiles::file_row(wp, row_bytes, n16, qtype, j, tmp.data());
  };
#if defined(RADIXSERVE_HAVE_BF16X2)
  if (m <= kSmallM && isa >= AVX512_BF16 && (qtype == Q4_0 || qtype == Q4_1)) {
    namespace b2 = radixserve_bf16x2;
    const int64_t pairs = b2::pairs_for(k);
    thread_local std::vector<uint16_t> hi, lo;
    thread_local std::vector<float> sums;
    if (static_cast<int64_t>(hi.size()) < m * pairs * 64) hi.resize(m * pairs * 64), lo.resize(m * pairs * 64);
    if (static_cast<int64_t>(sums.size()) < m * pairs * 4) sums.resize(m * pairs * 4);
    for (int64_t r = 0; r < m; ++r)
      b2::prepare_row(xf + r * k, k, hi.data() + r * pairs * 64, lo.data() + r * pairs * 64,
                      sums.data() + r * pairs * 4);
    const b2::Acts acts{hi.data(), lo.data(), sums.data(), pairs};
    // bf16 activations are their own hi part: lo is zero and skipped
    const bool split = !std::is_same<out_t, at::BFloat16>::value;
    b2::DotFn dots[4];
    for (int rows = 1; rows <= 4; ++rows) dots[rows - 1] = b2::dot_for(qtype == Q4_1, split, 1, rows);
    const int c = b2::weight_rows_for(m, k);
    const b2::DotFn wide = c > 1 ? b2::dot_for(qtype == Q4_1, split, c, static_cast<int>(m)) : nullptr;
    const int64_t grain = std::max<int64_t>(4, 16384 / k / 4 * 4);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      int64_t j = begin;
      if (wide != nullptr) {
        float res[kSmallM];
        for (; j + c <= end; j += c) {
          wide(wp + j * row_bytes, row_bytes, k, acts, 0, res);  // res[i * m + r]: row j + i, x row r
          for (int i = 0; i < c; ++i)
            for (int64_t r = 0; r < m; ++r) out[r * ldo + j + i] = static_cast<out_t>(res[i * m + r]);
        }
      }
      small_m_rows(wp, row_bytes, j, end, m, 4, out, ldo, [&](const uint8_t* row, int64_t r, int rows, float* res) {
        dots[rows - 1](row, row_bytes, k, acts, r, res);
      });
    });
    return;
  }
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
  // Q4_0 / Q4_1 on AVX512-BF16 take the bf16 kernels above; Q8_0, Q4_K, Q5_K and Q6_K come here on every ISA
  // from AVX2 up (Zen 4, 2 threads: Q8_0 40 GB/s against 31 for the float-widening AVX-512 kernel).
  if (m <= kSmallM && isa >= AVX2 && !exact &&
      (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K)) {
    namespace q16 = radixserve_i16act;
    const int64_t nb = k / 32;
    thread_local std::vector<int16_t> q;
    thread_local std::vector<float> ds;
    if (static_cast<int64_t>(q.size()) < m * k) q.resize(m * k);
    if (static_cast<int64_t>(ds.size()) < 2 * m * nb) ds.resize(2 * m * nb);
    for (int64_t r = 0; r < m; ++r)
      q16::prepare_row(xf + r * k, k, q.data() + r * k, ds.data() + r * nb, ds.data() + (m + r) * nb);
    const q16::Acts acts{q.data(), ds.data(), ds.data() + m * nb, nb};
    q16::DotFn dots[4];
    for (int rows = 1; rows <= 4; ++rows) dots[rows - 1] = q16::dot_for(qtype, rows);
    const int64_t grain = std::max<int64_t>(1, 16384 / k);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      small_m_rows(wp, row_bytes, begin, end, m, 4, out, ldo, [&](const uint8_t* row, int64_t r, int rows, float* res) {
        dots[rows - 1](row, acts, r, res);
      });
    });
    return;
  }
#endif
  if (m <= kSmallM) {
    FusedDotPtr fused[8];
    for (int rows = 1; rows <= 8; ++rows) fused[rows - 1] = fused_kernel(isa, qtype, rows);
    const RowDequant dq = fused[0] == nullptr ? row_dequantizer(qtype) : nullptr;
    const int64_t grain = std::max<int64_t>(1, 16384 / k);
    int64_t state_bytes = 0;
    FusedPartPtr parts[8] = {};
    for (int rows = 1; rows <= 8 && m > 1 && fused[0] != nullptr; ++rows)
      parts[rows - 1] = fused_part_kernel(isa, qtype, rows, state_bytes);
    if (parts[0] != nullptr) {
      // 2+ rows of x: tiles of 16 weight rows, each taken 512 values at a time (fused_dot_part), the
      // next tile's bytes of the same part prefetched meanwhile. x is laid out part by part first (the
      // rows of a part 1 KB apart: rows k floats apart, 8 KB for k = 2048, fell into the same L1 sets)
      constexpr int64_t kTileRows = 16, kPart = 512;
      const int64_t nparts = (k + kPart - 1) / kPart;
      std::vector<float> xparts(nparts * m * kPart);
      for (int64_t p = 0; p < nparts; ++p)
        for (int64_t r = 0; r < m; ++r) {
          const int64_t v0 = p * kPart, len = std::min(kPart, k - v0);
          std::memcpy(xparts.data() + (p * m + r) * kPart, xf + r * k + v0, len * sizeof(float));
        }
      at::parallel_for(0, n, std::max<int64_t>(grain, kTileRows), [&](int64_t begin, int64_t end) {
        thread_local std::vector<uint8_t> buf;
        buf.resize(kTileRows * 8 * state_bytes + 64);
        uint8_t* state = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) & 63);
        float res[8];
        for (int64_t j0 = begin; j0 < end; j0 += kTileRows) {
          const int64_t j1 = std::min(end, j0 + kTileRows);
          for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const int rows = static_cast<int>(std::min<int64_t>(8, m - r0));
            const int64_t per_row = rows * state_bytes;
            std::memset(state, 0, (j1 - j0) * per_row);
            for (int64_t v0 = 0; v0 < k; v0 += kPart) {
              const int64_t v1 = std::min(k, v0 + kPart);
              const bool last = v1 == k;
              const int64_t b0 = row_bytes * v0 / k, b1 = row_bytes * v1 / k;
              for (int64_t j = j0; j < j1; ++j) {
                if (r0 == 0 && j + kTileRows < end)
                  for (int64_t b = b0; b < b1; b += 64) __builtin_prefetch(wp + (j + kTileRows) * row_bytes + b, 0, 1);
                parts[rows - 1](wp + j * row_bytes, v0, v1, xparts.data() + (v0 / kPart * m + r0) * kPart, kPart,
                                state + (j - j0) * per_row, last ? res : nullptr);
                if (last)
                  for (int r = 0; r < rows; ++r) out[(r0 + r) * ldo + j] = static_cast<out_t>(res[r]);
              }
            }
          }
        }
      });
      return;
    }
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      float* wrow = dq != nullptr ? scratch_floats(0, k) : nullptr;
      // the scalar variant dequantizes the row once and takes all m rows of x in one step
      small_m_rows(wp, row_bytes, begin, end, m, dq != nullptr ? m : 8, out, ldo,
                   [&](const uint8_t* row, int64_t r, int rows, float* res) {
                     if (dq == nullptr) return fused[rows - 1](row, k, xf + r * k, k, res);
                     dq(row, k, wrow);
                     dots_scalar(wrow, xf, k, m, k, res);
                   });
    });
    return;
  }
  const RowDequant fill = row_filler(isa, qtype);
  const int64_t tile = std::max<int64_t>(16, kTileFloats / k / 16 * 16);
  if constexpr (std::is_same<out_t, at::BFloat16>::value) {
    if (x16.defined()) {
      // bf16 activations on a CPU with fast bf16 GEMMs: each thread decodes a tile of weight rows straight
      // into a bf16 buffer (no float tile, no conversion pass, no allocation) and multiplies it with a
      // single-threaded GEMM inside the parallel region (a multi-threaded GEMM outside it, between our
      // OpenMP regions, ran a decode step 1.5x slower); tiles of equal size, a multiple of the threads
      const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
      const int64_t tile16 = std::max<int64_t>(16, bf16_tile_values() / k / 16 * 16);
      int64_t tiles = (n + tile16 - 1) / tile16;
      tiles = (tiles + threads - 1) / threads * threads;
      const int64_t rows = std::max<int64_t>(16, ((n + tiles - 1) / tiles + 15) / 16 * 16);
      at::parallel_for(0, (n + rows - 1) / rows, 1, [&](int64_t begin, int64_t end) {
        uint16_t* buf = reinterpret_cast<uint16_t*>(scratch_floats(1, (rows * k + 1) / 2));
        thread_local std::vector<uint8_t> tmp;
#if defined(__AVX512BF16__)
        const RowDequantBf16 fill16 = isa >= AVX512_BF16 ? bf16_filler(qtype) : nullptr;
#endif
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * rows, nb = std::min(rows, n - n0);
          for (int64_t j = 0; j < nb; ++j) {
#if defined(__AVX512BF16__)
            if (fill16 != nullptr) {
              fill16(row_at(n0 + j, tmp), k, buf + j * k);
              continue;
            }
#endif
            float* rowf = scratch_floats(0, k);
            fill(row_at(n0 + j, tmp), k, rowf);
            radixserve_cpu::floats_to_bf16(rowf, buf + j * k, k);
          }
          at::Tensor dst = at::from_blob(out + n0, {m, nb}, {ldo, 1}, at::kBFloat16);
          at::mm_out(dst, x16, at::from_blob(buf, {nb, k}, at::kBFloat16).t());
        }
      });
      return;
    }
  }
  const at::Tensor x = at::from_blob(const_cast<float*>(xf), {m, k}, at::kFloat);
  at::parallel_for(0, (n + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
    float* buf = scratch_floats(1, tile * k);
    float* res = std::is_same<out_t, float>::value ? nullptr : scratch_floats(0, m * tile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, nb = std::min(tile, n - n0);
      thread_local std::vector<uint8_t> tmp;
      for (int64_t j = 0; j < nb; ++j) fill(row_at(n0 + j, tmp), k, buf + j * k);
      const at::Tensor wt = at::from_blob(buf, {nb, k}, at::kFloat);
      if constexpr (std::is_same<out_t, float>::value) {
        at::Tensor dst = at::from_blob(out + n0, {m, nb}, {ldo, 1}, at::kFloat);
        at::mm_out(dst, x, wt.t());
      } else {
        at::Tensor dst = at::from_blob(res, {m, nb}, at::kFloat);
        at::mm_out(dst, x, wt.t());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < nb; ++j) out[r * ldo + n0 + j] = static_cast<out_t>(res[r * nb + j]);
      }
    }
  });
}

}  // namespace

// x [M, K] (float, bfloat16 or half) times several weights stacked along N, each a quantized
// uint8 [N_i, row_bytes] tensor of GGML type qtypes[i], or a dense [N_i, K] tensor (qtypes[i] is
// F32, F16 or BF16). Returns [M, sum N_i] in x's dtype.
// `exact`: keep float activations (the LM head: its logits see activation rounding undamped, so the
// int16-activation kernels are not used for it; the bf16-split ones are, at 2^-17, and a Q8_0 head in
// row tiles takes bf16 / fp16 activations as int16 per block, finer than their own rounding at the
// block's largest value: radixserve_qvnni::SplitActs).
at::Tensor quant_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes, bool exact) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [M, K]");
  TORCH_CHECK(weights.size() == qtypes.size() && !weights.empty(), "quant_linear: one qtype per weight");
  const int64_t m = x.size(0), k = x.size(1);
  int64_t n_total = 0;
  for (const auto& w : weights) n_total += w.size(0);
  at::Tensor out = at::empty({m, n_total}, x.options());
  if (m == 0) return out;
  // Large bf16 batches multiply bf16 tiles where bf16 GEMMs are fast (AMX / AVX512-BF16): the
  // weights are then rounded to bf16 like the dense bf16 path's; decode rows stay exact.
  const at::Tensor x16 =
      x.scalar_type() == at::kBFloat16 && m > kSmallM && g_fast_bf16.load() ? x.contiguous() : at::Tensor();
  // Batches above the decode sizes on AVX-512 VNNI (on AMX CPUs up to kAmxRows): Q4_0 / Q4_1 / Q8_0
  // weights multiply int8 activations (cpu_qvnni.h), quantized once here for all such weights;
  // float32 activations only when asked (mode 2), and the LM head (`exact`) keeps its activations.
  // Decode sizes likewise for Q4_0 / Q4_1 (radixserve_qvnni::gemv, on CPUs with AVX-512 VBMI as well).
#if defined(RADIXSERVE_HAVE_QVNNI)
  const int int8_mode = g_int8_tiles.load();
  // mode 3 (AMX CPUs, whose bf16 tiles win from ~160 rows on): bf16 / fp16 batches up to kAmxRows
  const bool int8_acts = !exact && k % 32 == 0 && g_isa.load(std::memory_order_relaxed) >= AVX512 &&
                         (int8_mode == 2 || ((int8_mode == 1 || (int8_mode == 3 && m <= kAmxRows)) &&
                                             x.scalar_type() != at::kFloat));
#else
  const bool int8_acts = false;
#endif
  const bool int8_tiles = int8_acts && m > kSmallM;
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  const bool int8_gemv = int8_acts && m <= kSmallM;
#else
  const bool int8_gemv = false;
#endif
  // row tiles take int8 activations at every M (gemv_tiles, or gemm's panels)
  auto takes_int8 = [&](int64_t qtype) {
    return (int8_tiles && (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0)) ||
           (int8_gemv && (qtype == Q4_0 || qtype == Q4_1)) || (int8_acts && q4_tiled(qtype));
  };
  // The float copy of x, unless every weight is multiplied as bf16 or int8 tiles (a prefill chunk's
  // copy is MBs).
  bool need_float = false;
  for (size_t i = 0; i < weights.size() && !need_float; ++i) {
    const int64_t qtype = qtypes[i];
    if (takes_int8(qtype)) continue;
    need_float = !x16.defined() || qtype == W8A8 || qtype == F32 || qtype == F16 ||
                 (qtype == BF16 && !(weights[i].scalar_type() == at::kBFloat16 && k % 32 == 0));
  }
  radixserve_qvnni::Acts qacts{nullptr, nullptr, nullptr, k, k / 32};
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> qds;
  for (const int64_t qtype : qtypes) {
    if (!takes_int8(qtype) || qacts.q != nullptr) continue;
    if (static_cast<int64_t>(qx.size()) < m * k) qx.resize(m * k);
    if (static_cast<int64_t>(qds.size()) < 2 * m * (k / 32)) qds.resize(2 * m * (k / 32));
    const at::Tensor xc = x.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_blocks", [&] {
      radixserve_qvnni::quantize(xc.data_ptr<scalar_t>(), m, k, qx.data(), qds.data(), qds.data() + m * (k / 32));
    });
    qacts = {qx.data(), qds.data(), qds.data() + m * (k / 32), k, k / 32};
  }
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  radixserve_qvnni::GroupActs gacts{nullptr, nullptr, 0};
  const bool file_q4 = std::any_of(qtypes.begin(), qtypes.end(), [](int64_t t) { return t == Q4_0 || t == Q4_1; });
  if (int8_gemv && qacts.q != nullptr && file_q4) {
    const int64_t groups = radixserve_qvnni::groups_for(k);
    thread_local std::vector<int8_t> gq;
    thread_local std::vector<float> gds;
    if (static_cast<int64_t>(gq.size()) < m * groups * 128) gq.resize(m * groups * 128);
    if (static_cast<int64_t>(gds.size()) < m * groups * 8) gds.resize(m * groups * 8);
    for (int64_t r = 0; r < m; ++r)
      radixserve_qvnni::group_row(qacts, r, gq.data() + r * groups * 128, gds.data() + r * groups * 8);
    gacts = {gq.data(), gds.data(), groups};
    if (k <= radixserve_qvnni::kSpreadMaxK) {
      thread_local std::vector<float> spread;
      if (static_cast<int64_t>(spread.size()) < m * groups * 32) spread.resize(m * groups * 32);
      for (int64_t r = 0; r < m; ++r)
        radixserve_qvnni::spread_row(gds.data() + r * groups * 8, groups, spread.data() + r * groups * 32);
      gacts.spread = spread.data();
    }
  }
#endif
  const at::Tensor xf =
      !need_float ? at::Tensor() : x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = xf.defined() ? xf.data_ptr<float>() : nullptr;
  // int8 weights multiply int8 activations, quantized per row once for all such weights.
  radixserve_int8::Acts acts{nullptr, nullptr, nullptr, m, k};
  int int8_variant = radixserve_int8::kScalar;
  for (const int64_t qtype : qtypes) {
    if (qtype != W8A8 || acts.q != nullptr) continue;
    const int isa = g_isa.load(std::memory_order_relaxed);
    int8_variant = isa >= AVX512 && radixserve_int8::have_vnni() ? radixserve_int8::kVnni
                   : isa >= AVX2                                 ? radixserve_int8::kAvx2
                                                                 : radixserve_int8::kScalar;
    thread_local std::vector<int8_t> q;
    thread_local std::vector<uint8_t> aux;
    thread_local std::vector<float> scale;
    if (static_cast<int64_t>(q.size()) < m * k) q.resize(m * k), aux.resize(m * k);
    if (static_cast<int64_t>(scale.size()) < m) scale.resize(m);
    radixserve_int8::quantize_rows(xp, m, k, int8_variant == radixserve_int8::kVnni, q.data(), aux.data(),
                                   scale.data());
    acts = {q.data(), aux.data(), scale.data(), m, k};
  }
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    int64_t qtype = qtypes[i];
    at::Tensor blocks = w;
    if (qtype == Q8_0_R16) {  // a Q8_0 LM head (or embedding) in row tiles
      check_weight(w, qtype, k);
      const int64_t n = w.size(0), n16 = n / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows;
#if defined(RADIXSERVE_HAVE_QVNNI)
      if (m <= kSmallM && g_isa.load(std::memory_order_relaxed) >= AVX512) {
        thread_local std::vector<int16_t> sh, sl;
        thread_local std::vector<float> sd;
        if (static_cast<int64_t>(sh.size()) < m * k) sh.resize(m * k), sl.resize(m * k);
        if (static_cast<int64_t>(sd.size()) < m * (k / 32)) sd.resize(m * (k / 32));
        radixserve_qvnni::split_rows(xp, m, k, sh.data(), sl.data(), sd.data());
        // float activations keep the low part; bf16 / fp16 ones are within h's reach (SplitActs)
        const radixserve_qvnni::SplitActs sa{sh.data(), sl.data(), sd.data(), k, k / 32,
                                             x.scalar_type() == at::kFloat};
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "row_tiles_q8", [&] {
          radixserve_qvnni::gemv_tiles_q8<scalar_t>(sa, m, w.data_ptr<uint8_t>(), n, w.size(1), n16,
                                                    out.data_ptr<scalar_t>() + col, n_total);
        });
        col += n;
        continue;
      }
#endif
      if (m > kSmallM) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
          quant_matmul<scalar_t>(xp, m, k, w.data_ptr<uint8_t>(), n, w.size(1), Q8_0, out.data_ptr<scalar_t>() + col,
                                 n_total, x16, exact, n16);
        });
        col += n;
        continue;
      }
    }
    if (row_tiled(qtype) && !takes_int8(qtype)) {
      check_weight(w, qtype, k);
      blocks = untile(w, qtype);
      qtype = untiled_type(qtype);
    }
    if (qtype == BF16 && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == k && k % 32 == 0) {
      blocks = w.contiguous().view(at::kByte);  // bf16 rows read by the same kernels
    } else if (qtype == F32 || qtype == F16 || qtype == BF16) {
      TORCH_CHECK(w.dim() == 2 && w.size(1) == k, "quant_linear: dense weight must be [N, K]");
      out.narrow(1, col, w.size(0)).copy_(at::mm(xf, w.to(at::kFloat).t()));
      col += w.size(0);
      continue;
    }
    check_weight(blocks, qtype, k);
    if (qtype == W8A8) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
        radixserve_int8::gemm<scalar_t>(acts, int8_variant, blocks.data_ptr<uint8_t>(), blocks.size(0),
                                        out.data_ptr<scalar_t>() + col, n_total);
      });
      col += w.size(0);
      continue;
    }
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (q4_tiled(qtype)) {
      const int64_t n = blocks.size(0), n16 = n / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "row_tiles", [&] {
        if (m <= kSmallM)
          radixserve_qvnni::gemv_tiles<scalar_t>(qacts, m, blocks.data_ptr<uint8_t>(), n, blocks.size(1), n16,
                                                 qtype == Q4_1_R16, out.data_ptr<scalar_t>() + col, n_total);
        else
          radixserve_qvnni::gemm<scalar_t>(qacts, m, blocks.data_ptr<uint8_t>(), n, blocks.size(1), untiled_type(qtype),
                                           out.data_ptr<scalar_t>() + col, n_total, n16);
      });
      col += w.size(0);
      continue;
    }
#endif
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
    if (int8_gemv && takes_int8(qtype)) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_gemv", [&] {
        radixserve_qvnni::gemv<scalar_t>(gacts, m, k, blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), qtype,
                                         out.data_ptr<scalar_t>() + col, n_total);
      });
      col += w.size(0);
      continue;
    }
#endif
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (takes_int8(qtype)) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_tiles", [&] {
        radixserve_qvnni::gemm<scalar_t>(qacts, m, blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), qtype,
                                         out.data_ptr<scalar_t>() + col, n_total);
      });
      col += w.size(0);
      continue;
    }
#endif
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
      quant_matmul<scalar_t>(xp, m, k, blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), qtype,
                             out.data_ptr<scalar_t>() + col, n_total, x16, exact);
    });
    col += w.size(0);
  }
  return out;
}

// The float32 [N, K] weight (tests, and layers that cannot run quantized).
at::Tensor quant_dequantize(const at::Tensor& w_in, int64_t qtype_in, int64_t k) {
  check_weight(w_in, qtype_in, k);
  const at::Tensor w = row_tiled(qtype_in) ? untile(w_in, qtype_in) : w_in;
  const int64_t qtype = untiled_type(qtype_in);
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const RowDequant dq = row_dequantizer(qtype);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) dq(wp + j * row_bytes, k, op + j * k);
  });
  return out;
}

// Rows `ids` of a quantized [V, K] embedding table, dequantized to `dtype`.
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& w_in, int64_t qtype_in, int64_t k,
                           at::ScalarType dtype) {
  check_weight(w_in, qtype_in, k);
  const at::Tensor& w = w_in;  // row tiles: each row read back in the file's layout
  const int64_t qtype = untiled_type(qtype_in);
  const int64_t n16 = row_tiled(qtype_in) ? w.size(0) / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows : 0;
  const at::Tensor idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t t = idx.numel(), v = w.size(0), row_bytes = w.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < v, "quant_embedding: id ", ip[i], " out of range");
  at::Tensor out = at::empty({t, k}, at::kFloat);
  float* op = out.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const RowDequant dq = row_dequantizer(qtype);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> tmp(n16 > 0 ? row_bytes : 0);
    for (int64_t i = begin; i < end; ++i)
      dq(radixserve_rowtiles::file_row(wp, row_bytes, n16, qtype, ip[i], tmp.data()), k, op + i * k);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// quant_embedding's rows of ids [t] as bf16 (its output for dtype bf16, bit for bit) into out [t, k],
// without an ATen op: for the decode steps of one call (DecodeStack.run_steps), where the caches are
// cold from the step's weights and quant_embedding's ATen ops took ~25 us of a ~3.3 ms batch-1 step.
void quant_embedding_bf16(const int64_t* ids, int64_t t, const at::Tensor& w, int64_t qtype_in, int64_t k,
                          c10::BFloat16* out) {
  const int64_t qtype = untiled_type(qtype_in), v = w.size(0), row_bytes = w.size(1);
  const int64_t n16 = row_tiled(qtype_in) ? v / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows : 0;
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < v, "quant_embedding: id ", ids[i], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const RowDequant dq = row_dequantizer(qtype);
  thread_local std::vector<uint8_t> tmp;
  thread_local std::vector<float> row;
  tmp.resize(row_bytes), row.resize(k);
  for (int64_t i = 0; i < t; ++i) {
    dq(radixserve_rowtiles::file_row(wp, row_bytes, n16, qtype, ids[i], tmp.data()), k, row.data());
    for (int64_t c = 0; c < k; ++c) out[i * k + c] = static_cast<c10::BFloat16>(row[c]);
  }
}

// The dot-product variant in use: "avx512", "avx2" or "scalar". An empty `isa` only reads it;
// otherwise the variant is set to `isa` if it is compiled in for this CPU (else an error).
std::string quant_isa(const std::string& isa) {
  if (!isa.empty()) {
    int want = isa == "avx512_bf16" ? AVX512_BF16
               : isa == "avx512"    ? AVX512
               : isa == "avx2"      ? AVX2
               : isa == "scalar"    ? SCALAR
                                    : -1;
    TORCH_CHECK(want >= 0, "unknown ISA '", isa, "' (avx512_bf16, avx512, avx2 or scalar)");
    TORCH_CHECK(want <= best_isa(), "ISA ", isa, " is not available on this CPU (best: ", isa_name(best_isa()), ")");
    g_isa.store(want);
  }
  return isa_name(g_isa.load());
}

// The ISA variant in use, for the other kernels of this extension (0 scalar, 1 AVX2, 2+ AVX-512).
int radixserve_kernel_isa() { return g_isa.load(std::memory_order_relaxed); }

// The kernel quant_linear multiplies up to `m` rows of non-exact `dtype` activations with `qtype`
// weights (K inputs) by, for callers that run the same rows themselves (the fused decode stack):
// 1 radixserve_qvnni::gemv (int8 activations), 2 radixserve_i16act (int16 activations),
// 3 radixserve_qvnni::gemv_tiles (row tiles, int8 activations), 0 another one.
// The order of the tests is quant_linear's and quant_matmul's.
int64_t quant_decode_kernel(int64_t qtype, int64_t k, at::ScalarType dtype, int64_t m) {
  if (m > kSmallM || m < 1 || k % 32 != 0) return 0;
  const int isa = g_isa.load(std::memory_order_relaxed);
  if (row_tiled(qtype)) {
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (qtype == Q8_0_R16) return 0;
    const int tiles_mode = g_int8_tiles.load();
    if (isa >= AVX512 && (tiles_mode == 2 || ((tiles_mode == 1 || tiles_mode == 3) && dtype != at::kFloat))) return 3;
#endif
    return 0;
  }
  const bool q4 = qtype == Q4_0 || qtype == Q4_1;
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  const int mode = g_int8_tiles.load();
  if (q4 && isa >= AVX512 && (mode == 2 || ((mode == 1 || mode == 3) && dtype != at::kFloat))) return 1;
#else
  (void)dtype;
#endif
#if defined(RADIXSERVE_HAVE_BF16X2)
  if (q4 && isa >= AVX512_BF16) return 0;
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
  if (isa >= AVX2 && (q4 || qtype == Q8_0 || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K) &&
      k % geometry(qtype).block == 0)
    return 2;
#endif
  (void)q4;
  return 0;
}

// Whether quant_linear multiplies m rows of bf16 / fp16 activations by a Q8_0 weight in row tiles as
// split activations over the tiles (radixserve_qvnni::gemv_tiles_q8): the decode stack's LM head
// (cpu_decode_layer.cpp) takes the same kernel only then.
bool quant_q8_tiles_split(int64_t m) {
#if defined(RADIXSERVE_HAVE_QVNNI)
  return m >= 1 && m <= kSmallM && g_isa.load(std::memory_order_relaxed) >= AVX512;
#else
  (void)m;
  return false;
#endif
}

// Whether prefill-sized bf16 batches may multiply bf16 tiles (CPUs with AMX / AVX512-BF16).
bool quant_fast_bf16(bool enable) {
  g_fast_bf16.store(enable);
  return enable;
}

// When batches above the decode sizes multiply Q4_0 / Q4_1 / Q8_0 weights with int8 activations
// (g_int8_tiles' modes); returns whether this build has the kernels (AVX-512 VNNI).
bool quant_int8_tiles(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 3,
              "quant_int8_tiles: mode is 0 (never), 1 (bf16 / fp16 activations), 2 (all) or 3 (bf16 / fp16 "
              "activations in batches up to 160 rows)");
#if defined(RADIXSERVE_HAVE_QVNNI)
  g_int8_tiles.store(static_cast<int>(mode));
  return true;
#else
  return false;
#endif
}

// Repacks a Q4_0 / Q4_1 / Q8_0 weight [N, row_bytes] into row tiles in place (cpu_rowtiles.h) where the
// kernels that read them run now (AVX-512 VNNI; for Q4_0 / Q4_1 the int8 mode on for bf16 / fp16
// activations); returns the type the weight has then (256 + qtype, or `qtype` unchanged). The caller
// picks the types: the layers' 4-bit ones, a Q8_0 LM head's.
int64_t quant_repack(const at::Tensor& w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  if (w.size(0) < radixserve_rowtiles::kRows) return qtype;
  if (qtype == Q4_0 || qtype == Q4_1) {
    if (quant_decode_kernel(qtype + 256, k, at::kBFloat16, 1) != 3) return qtype;
  } else if (qtype == Q8_0) {
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (g_isa.load() < AVX512) return qtype;
#else
    return qtype;
#endif
  } else {
    return qtype;
  }
  const int64_t row_bytes = w.size(1), tiles = w.size(0) / radixserve_rowtiles::kRows;
  uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rows(radixserve_rowtiles::kRows * row_bytes);
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = wp + t * radixserve_rowtiles::kRows * row_bytes;
      std::memcpy(rows.data(), tile, rows.size());
      radixserve_rowtiles::repack_tile(rows.data(), row_bytes, k / 32, qtype, tile);
    }
  });
  return qtype + 256;
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("quant_repack(Tensor(a!) w, int qtype, int k) -> int");
  m.def("quant_fast_bf16(bool enable) -> bool", &quant_fast_bf16);
  m.def("quant_int8_tiles(int mode) -> bool", &quant_int8_tiles);
  m.def("quant_linear(Tensor x, Tensor[] weights, int[] qtypes, bool exact=False) -> Tensor");
  m.def("quant_dequantize(Tensor w, int qtype, int k) -> Tensor");
  m.def("quant_embedding(Tensor ids, Tensor w, int qtype, int k, ScalarType dtype) -> Tensor");
  m.def("quant_isa(str isa) -> str", &quant_isa);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_embedding", &quant_embedding);
  m.impl("quant_repack", &quant_repack);
}
