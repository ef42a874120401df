// Decode-sized products of 4-bit GGUF blocks (Q4_0, Q4_1) with float activations on CPUs with
// AVX512-BF16 (Zen 4, Sapphire Rapids and later); included by cpu_quant.cpp.
//
// Widening each nibble to a float and multiplying in fp32 costs about three 512-bit operations per
// 16 weights, which on a 2-core machine caps a 4-bit GEMV at half the memory bandwidth. Here the
// 16 possible quants of a format are exact bfloat16 values (0..15, or -8..7), looked up 32 at a time
// with one vpermw, and `vdpbf16ps` multiplies 32 of them with 32 activations per instruction.
// Activations are split once per call into x = hi + lo, two bfloat16 parts (hi = bf16(x), lo =
// bf16(x - hi)), so hi + lo equals x to within 2^-17 relative; the products q * hi and q * lo are
// exact in fp32. Per block, d * sum(q * x) (+ m * sum(x) for Q4_1, the sum of the float x) is
// then the float32 result up to a relative error of about 2^-17 of sum |d q x|: not bit-identical
// to the float path, but far inside the error of the 4-bit weights themselves.
//
// Activation layout (built once per call, per row): blocks are taken in pairs (A, B) so that one
// 512-bit lookup of A's and B's 16 quant bytes lines up with 64 bf16 activations stored as
// [A 0..15 | B 0..15 | A 16..31 | B 16..31] (low nibbles are weights 0..15 of a block, high ones
// 16..31), for hi and for lo; sums holds [0, sum A, 0, sum B] per pair, to meet [dA, mA, dB, mB].
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_HAVE_BF16X2 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace radixserve_bf16x2 {

struct Acts {
  const uint16_t* hi;  // [m, pairs * 64]
  const uint16_t* lo;
  const float* sums;   // [m, pairs * 4]
  int64_t pairs;
};

inline int64_t pairs_for(int64_t k) { return (k / 32 + 1) / 2; }

// 16 floats -> hi and lo bfloat16 halves.
inline void split16(const float* x, uint16_t* hi, uint16_t* lo) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  const __m256i l = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
}

inline float sum32(const float* x) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
}

// One activation row of k floats into the pair layout (hi, lo: pairs * 64; sums: pairs * 4).
inline void prepare_row(const float* x, int64_t k, uint16_t* hi, uint16_t* lo, float* sums) {
  const int64_t nb = k / 32, pairs = pairs_for(k);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t a = 2 * p, b = 2 * p + 1;
    uint16_t* h = hi + p * 64;
    uint16_t* l = lo + p * 64;
    split16(x + 32 * a, h, l);
    split16(x + 32 * a + 16, h + 32, l + 32);
    sums[4 * p] = 0.f;
    sums[4 * p + 1] = sum32(x + 32 * a);
    sums[4 * p + 2] = 0.f;
    if (b < nb) {
      split16(x + 32 * b, h + 16, l + 16);
      split16(x + 32 * b + 16, h + 48, l + 48);
      sums[4 * p + 3] = sum32(x + 32 * b);
    } else {  // an odd block count: B is zeros (and its weights are read as a zero block)
      std::memset(h + 16, 0, 32), std::memset(l + 16, 0, 32);
      std::memset(h + 48, 0, 32), std::memset(l + 48, 0, 32);
      sums[4 * p + 3] = 0.f;
    }
  }
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The 32-entry vpermw table: entry i holds bf16(i & 15) (Q4_1) or bf16((i & 15) - 8) (Q4_0).
template <bool HAS_MIN>
inline __m512i quant_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(HAS_MIN ? (i & 15) : (i & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bf16
  }
  return _mm512_load_si512(t);
}

// out[c * R + r] = dot(row c, x[r0 + r]) for c < C, r < R, where row c starts at row + c * row_bytes
// and holds k / 32 blocks of Q4_1 (HAS_MIN) or Q4_0. Several weight rows share each activation load
// (C > 1 at batch 1): with one row at a time a long row's activations (28 KB at K = 14336) are
// reloaded from L2 for every weight row, and the down projection of an 8B model ran at half the
// memory bandwidth. LO = false when the activations are bfloat16 already (the model's dtype): lo is
// then zero and skipped, and the result is exact up to float32 summation.
template <bool HAS_MIN, int C, int R, bool LO>
void dot_q4(const uint8_t* row, int64_t row_bytes, int64_t k, const Acts& x, int64_t r0, float* out) {
  constexpr int64_t BYTES = HAS_MIN ? 20 : 18, QOFF = HAS_MIN ? 4 : 2;
  const int64_t nb = k / 32, pairs = x.pairs;
  static const __m512i table = quant_table<HAS_MIN>();  // built once, not per weight row
  // lanes 0..7 of a product belong to block A, 8..15 to B: d spread accordingly
  const __m512i didx = HAS_MIN ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
                               : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[C][R];
  __m128 macc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps(), macc[c][r] = _mm_setzero_ps();
  const int64_t stride = pairs * 64;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool has_b = 2 * p + 1 < nb;
    __m512bh xh0[R], xh1[R], xl0[R], xl1[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* xh = x.hi + (r0 + r) * stride + p * 64;
      xh0[r] = as_bh(_mm512_loadu_si512(xh));
      xh1[r] = as_bh(_mm512_loadu_si512(xh + 32));
      if (LO) {
        const uint16_t* xl = x.lo + (r0 + r) * stride + p * 64;
        xl0[r] = as_bh(_mm512_loadu_si512(xl));
        xl1[r] = as_bh(_mm512_loadu_si512(xl + 32));
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* a = row + c * row_bytes + 2 * p * BYTES;
      const uint8_t* b = a + BYTES;
      const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + QOFF));
      const __m128i qb = has_b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + QOFF)) : _mm_setzero_si128();
      const __m512i z = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1));
      const __m512bh wl = as_bh(_mm512_permutexvar_epi16(z, table));  // vpermw reads the low 5 bits
      const __m512bh wh = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), table));
      __m128 hdr;  // Q4_1: [dA, mA, dB, mB]; Q4_0: [dA, dB, 0, 0]
      if (HAS_MIN) {
        uint32_t ha, hb = 0;
        std::memcpy(&ha, a, 4);
        if (has_b) std::memcpy(&hb, b, 4);
        hdr = _mm_cvtph_ps(_mm_set_epi64x(0, static_cast<int64_t>((static_cast<uint64_t>(hb) << 32) | ha)));
      } else {
        uint16_t ha, hb = 0;
        std::memcpy(&ha, a, 2);
        if (has_b) std::memcpy(&hb, b, 2);
        hdr = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(ha | (static_cast<uint32_t>(hb) << 16))));
      }
      const __m512 dv = _mm512_permutexvar_ps(didx, _mm512_castps128_ps512(hdr));
      for (int r = 0; r < R; ++r) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, xh0[r]);
        t = _mm512_dpbf16_ps(t, wh, xh1[r]);
        if (LO) {  // a second short chain (vdpbf16ps latency)
          __m512 u = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, xl0[r]);
          u = _mm512_dpbf16_ps(u, wh, xl1[r]);
          t = _mm512_add_ps(t, u);
        }
        acc[c][r] = _mm512_fmadd_ps(t, dv, acc[c][r]);
        if (HAS_MIN)
          macc[c][r] = _mm_fmadd_ps(hdr, _mm_loadu_ps(x.sums + (r0 + r) * pairs * 4 + p * 4), macc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[c][r]);
      if (HAS_MIN) {
        __m128 v = _mm_add_ps(macc[c][r], _mm_movehl_ps(macc[c][r], macc[c][r]));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        s += _mm_cvtss_f32(v);
      }
      out[c * R + r] = s;
    }
}

using DotFn = void (*)(const uint8_t*, int64_t, int64_t, const Acts&, int64_t, float*);

// Weight rows taken together for m activation rows of length k: 4 at batch 1 and 2 at batch 2 when
// the activations outgrow L1 (k >= 8192: 16 KB of bf16), else 1. Measured on Zen 4 with 2 threads,
// weights streamed from DRAM: k = 14336 ran at 28.5 GB/s one row at a time and 33 GB/s four at a
// time, but k = 4096 fell from 35 to 17 GB/s four at a time (four interleaved short row streams).
inline int weight_rows_for(int64_t m, int64_t k) {
  if (k < 8192) return 1;
  return m == 1 ? 4 : m == 2 ? 2 : 1;
}

template <bool HAS_MIN, bool LO>
DotFn dot_for_rows(int c, int rows) {
  if (c == 4) return dot_q4<HAS_MIN, 4, 1, LO>;
  if (c == 2) return dot_q4<HAS_MIN, 2, 2, LO>;
  switch (rows) {
    case 1: return dot_q4<HAS_MIN, 1, 1, LO>;
    case 2: return dot_q4<HAS_MIN, 1, 2, LO>;
    case 3: return dot_q4<HAS_MIN, 1, 3, LO>;
    default: return dot_q4<HAS_MIN, 1, 4, LO>;
  }
}

// The kernel for C weight rows (4 with rows = 1, 2 with rows = 2, or 1) by `rows` activation rows.
inline DotFn dot_for(bool has_min, bool lo, int c, int rows) {
  if (has_min) return lo ? dot_for_rows<true, true>(c, rows) : dot_for_rows<true, false>(c, rows);
  return lo ? dot_for_rows<false, true>(c, rows) : dot_for_rows<false, false>(c, rows);
}

}  // namespace radixserve_bf16x2
#endif
