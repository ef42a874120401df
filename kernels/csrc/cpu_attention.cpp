// Paged attention for CPUs, reading K and V in place from the per-layer pool through req_to_token.
//
// Layout (shared with kernels/reference.py): k_buffer, v_buffer [num_slots, kv_heads, head_dim];
// req_to_token[req_slot, position] is the KV slot of a token. Queries of one KV head's group are
// processed together, so each K and V row is read once per group (GQA without repeating K/V).
// Softmax is computed online in float32 over tiles of positions; decode splits long contexts into
// ranges processed in parallel and merged by log-sum-exp.
//
// The pool may hold an 8-bit cache (--kv-cache-dtype; formats defined in kernels/reference.py):
// int8 values with a float32 scale per (slot, KV head), or fp8 e4m3 / e5m2 bits (uint8) with one
// scale per tensor. Rows are decoded to float in registers as they are read: int8 scales multiply
// each position's score and probability, fp8 scales are folded into the query and the output.
// kv_store quantizes new tokens' K and V into the pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_rowops.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// The ISA variant the kernels use (cpu_quant.cpp; narrowed by quant_isa / RADIXSERVE_CPU_ISA).
int radixserve_kernel_isa();

namespace {

using radixserve_cpu::to_float;
using radixserve_cpu::vexp;

constexpr int64_t kTile = 32;        // positions per softmax tile
constexpr int64_t kQueryBlock = 16;  // extend: query tokens per task
constexpr int64_t kPrefetch = 8;     // positions ahead whose K/V rows are prefetched
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Stored KV formats (MHATokenToKVPool.format_code).
enum KvFormat : int { kFloat = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3 };

// One layer's KV cache as the kernels read it. Scales not used by a format are 1 / null.
struct KvView {
  const void* k;
  const void* v;
  const float* ks;  // int8: [slots, kv_heads]
  const float* vs;
  float k_scale, v_scale;  // fp8: per tensor
  int64_t kv_heads;
};

// A stored value as float. fp8 bits are placed into a float's exponent and mantissa fields and
// rebased by a power of two (exact for normal and subnormal values; writes saturate, so the NaN
// code never occurs); the compiler vectorizes these as integer shifts.
template <int F, typename T>
inline float kv_value(T x) {
  if constexpr (F == kFp8E4M3 || F == kFp8E5M2) {
    const uint32_t u = static_cast<uint8_t>(x);
    const uint32_t bits = ((u & 0x80u) << 24) | ((u & 0x7Fu) << (F == kFp8E4M3 ? 20 : 21));
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f * (F == kFp8E4M3 ? 0x1p120f : 0x1p112f);
  } else {
    return to_float(x);
  }
}

// Prefetches the K and V rows (and int8 scales) of `row` (slot * kv_heads + head), d values each.
template <typename T, int F>
inline void prefetch_kv(const KvView& kv, int64_t row, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  const char* k = static_cast<const char*>(kv.k) + row * bytes;
  const char* v = static_cast<const char*>(kv.v) + row * bytes;
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(k + b, 0, 2);  // into L2: more misses in flight than L1 takes
    __builtin_prefetch(v + b, 0, 2);
  }
  if constexpr (F == kInt8) {
    __builtin_prefetch(kv.ks + row);
    __builtin_prefetch(kv.vs + row);
  }
}

// The online-softmax step of one tile: scores sc [rows][kTile] (n of them valid, -inf = masked)
// become probabilities relative to each row's new running max; m, l and the unnormalized outputs
// acc [rows][d] are rescaled to it.
inline void softmax_tile(float* sc, int64_t rows, int64_t n, int64_t d, float* m, float* l, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = sc + r * kTile;
    float tile_max = kNegInf;
    for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sr[j]);
    if (tile_max == kNegInf) {
      std::fill(sr, sr + n, 0.f);
      continue;
    }
    const float m_new = std::max(m[r], tile_max);
    const float corr = m[r] == kNegInf ? 0.f : vexp(m[r] - m_new);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float e = sr[j] == kNegInf ? 0.f : vexp(sr[j] - m_new);
      sr[j] = e;
      sum += e;
    }
    if (corr != 1.f) {
      float* a = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
    }
    l[r] = l[r] * corr + sum;
    m[r] = m_new;
  }
}

// Online-softmax attention of `rows` query rows (float, pre-scaled, [rows][d]) of one KV head over
// positions [start, end) of one request. Row r may see positions < limit[r]. Updates the running
// max m, sum l and unnormalized output acc ([rows][d]) of each row. kD > 0 fixes the head dim at
// compile time (fully unrolled inner loops); 0 takes it from `dim`.
template <typename T, int F, int kD>
void attend_impl(const float* q, int64_t rows, const int64_t* limit, const KvView& kv, int64_t head, int64_t dim,
                 const int32_t* slots, int64_t start, int64_t end, float* m, float* l, float* acc,
                 std::vector<float>& scores) {
  const int64_t d = kD > 0 ? kD : dim;
  const int64_t kv_heads = kv.kv_heads;
  const T* kbuf = static_cast<const T*>(kv.k);
  const T* vbuf = static_cast<const T*>(kv.v);
  scores.resize(rows * kTile);
  float row[kD > 0 ? kD : 512];  // one K or V row converted to float, reused by every query row
  for (int64_t t0 = start; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = t0 + j;
      if (pos + kPrefetch < end)  // slots are scattered: fetch every line of rows a few positions ahead
        prefetch_kv<T, F>(kv, static_cast<int64_t>(slots[pos + kPrefetch]) * kv_heads + head, d);
      const int64_t kv_row = static_cast<int64_t>(slots[pos]) * kv_heads + head;
      const T* krow = kbuf + kv_row * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = kv_value<F>(krow[i]);
      const float kmul = F == kInt8 ? kv.ks[kv_row] : 1.f;
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qr[i] * row[i];
        scores[r * kTile + j] = pos < limit[r] ? s * kmul : kNegInf;
      }
    }
    softmax_tile(scores.data(), rows, n, d, m, l, acc);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t kv_row = static_cast<int64_t>(slots[t0 + j]) * kv_heads + head;
      const T* vrow = vbuf + kv_row * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = kv_value<F>(vrow[i]);
      const float vmul = F == kInt8 ? kv.vs[kv_row] : 1.f;
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * kTile + j] * vmul;
        if (p == 0.f) continue;
        float* a = acc + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
      }
    }
  }
}


// ---- explicit SIMD variants for head_dim 64 and 128 ----
//
// The same online softmax as attend_impl, with K and V rows decoded straight into registers
// (16 floats per vector: one zmm, or two ymm on AVX2) and the output rows of each block of query
// rows kept in registers across a tile of positions.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_SIMD_ATTENTION 1
// 16 floats as two ymm.
struct A256 {
  struct V {
    __m256 a, b;
  };
  static constexpr int kAccBudget = 6;  // 16-float vectors of output kept in registers (16 ymm in all)
  static V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void storef(float* p, V v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  static V mul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  static V fma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  // The four sums of w, x, y, z, sharing one reduction tree.
  static __m128 sum4(V w, V x, V y, V z) {
    return hadd4(_mm256_add_ps(w.a, w.b), _mm256_add_ps(x.a, x.b), _mm256_add_ps(y.a, y.b),
                 _mm256_add_ps(z.a, z.b));
  }
  static __m128 hadd4(__m256 w, __m256 x, __m256 y, __m256 z) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(w, x), _mm256_hadd_ps(y, z));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  // 16 fp8 bytes as 16 fp16 bit patterns: e5m2 is the top byte of an fp16; e4m3 shifted left by 7
  // (sign-extended, the sign lands in bit 15; bit 14 cleared) is an fp16 of value / 2^8, exactly.
  template <int F>
  static __m256i fp8_as_half(__m128i b) {
    if constexpr (F == kFp8E5M2) return _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  }
  // 16 stored values of format F at p, as floats.
  template <int F, typename T>
  static V load(const T* p) {
    if constexpr (F == kFloat && std::is_same_v<T, float>) {
      return loadf(p);
    } else if constexpr (F == kFloat && std::is_same_v<T, c10::BFloat16>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
              _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16))};
    } else if constexpr (F == kFloat && std::is_same_v<T, c10::Half>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (F == kInt8) {
        return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
      } else {
        const __m256i h = fp8_as_half<F>(b);
        return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
      }
    }
  }
};
#endif

#if defined(RADIXSERVE_SIMD_ATTENTION) && defined(__AVX512F__)
// 16 floats as one zmm.
struct A512 {
  using V = __m512;
  static constexpr int kAccBudget = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V x, V y) { return _mm512_mul_ps(x, y); }
  static V fma(V x, V y, V z) { return _mm512_fmadd_ps(x, y, z); }
  static V zero() { return _mm512_setzero_ps(); }
  static __m256 halves(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static __m128 sum4(V w, V x, V y, V z) { return A256::hadd4(halves(w), halves(x), halves(y), halves(z)); }
  template <int F, typename T>
  static V load(const T* p) {
    if constexpr (F == kFloat && std::is_same_v<T, float>) {
      return loadf(p);
    } else if constexpr (F == kFloat && std::is_same_v<T, c10::BFloat16>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else if constexpr (F == kFloat && std::is_same_v<T, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      if constexpr (F == kInt8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      } else {
        return _mm512_cvtph_ps(A256::fp8_as_half<F>(b));
      }
    }
  }
};
#endif

#if defined(RADIXSERVE_SIMD_ATTENTION)
// RADIXSERVE_DISABLE_BF16_BLOCKS=1: bf16 rows through attend_simd instead (A/B measurements).
inline bool bf16_blocks_disabled() {
  static const bool off = [] {
    const char* v = std::getenv("RADIXSERVE_DISABLE_BF16_BLOCKS");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return off;
}

// The SIMD loads return e4m3 values / 2^8 (exact fp16 conversion); this factor undoes it.
template <int F>
constexpr float simd_rebase() {
  return F == kFp8E4M3 ? 256.f : 1.f;
}

// Scores of positions [t0, t0 + n) for every query row into sc[r * kTile + j]: each K row decoded
// into registers once, four query rows' dot products sharing one reduction tree. (Decoding a block
// of K rows into an L1 buffer and reducing 16 positions per tree was slower on Zen 4: its 512-bit
// stores and loads are double-pumped, and the buffer costs more than the reductions it saves.)
template <class A, typename T, int F, int NC, int64_t kAhead>
void tile_scores(const float* q, int64_t rows, const int64_t* limit, const KvView& kv, int64_t head,
                 const int32_t* slots, int64_t t0, int64_t n, int64_t end, float* sc) {
  using V = typename A::V;
  constexpr int64_t d = 16 * NC;
  const T* kbuf = static_cast<const T*>(kv.k);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = t0 + j;
    if (pos + kAhead < end) prefetch_kv<T, F>(kv, static_cast<int64_t>(slots[pos + kAhead]) * kv.kv_heads + head, d);
    const int64_t kv_row = static_cast<int64_t>(slots[pos]) * kv.kv_heads + head;
    const T* krow = kbuf + kv_row * d;
    V k[NC];
    for (int c = 0; c < NC; ++c) k[c] = A::template load<F>(krow + 16 * c);
    const float kmul = F == kInt8 ? kv.ks[kv_row] : simd_rebase<F>();
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      V dot[4];
      for (int u = 0; u < 4; ++u) {
        if (r0 + u >= rows) {
          dot[u] = A::zero();
          continue;
        }
        const float* qr = q + (r0 + u) * d;
        dot[u] = A::mul(A::loadf(qr), k[0]);
        for (int c = 1; c < NC; ++c) dot[u] = A::fma(A::loadf(qr + 16 * c), k[c], dot[u]);
      }
      alignas(16) float dots[4];
      _mm_store_ps(dots, A::sum4(dot[0], dot[1], dot[2], dot[3]));
      for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + 4); ++r)
        sc[r * kTile + j] = pos < limit[r] ? dots[r - r0] * kmul : kNegInf;
    }
  }
}

// attend_impl for head_dim = 16 * NC on vector type A.
template <class A, typename T, int F, int NC>
void attend_simd(const float* q, int64_t rows, const int64_t* limit, const KvView& kv, int64_t head,
                 const int32_t* slots, int64_t start, int64_t end, float* m, float* l, float* acc,
                 std::vector<float>& scores) {
  using V = typename A::V;
  constexpr int64_t d = 16 * NC;
  constexpr int RB = A::kAccBudget / NC > 0 ? A::kAccBudget / NC : 1;  // query rows per output block
  // positions ahead to prefetch: about the same bytes in flight for every format
  constexpr int64_t kAhead = 32 / static_cast<int64_t>(sizeof(T));
  const int64_t kv_heads = kv.kv_heads;
  const T* vbuf = static_cast<const T*>(kv.v);
  scores.resize(rows * kTile);
  float* sc = scores.data();
  for (int64_t t0 = start; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    tile_scores<A, T, F, NC, kAhead>(q, rows, limit, kv, head, slots, t0, n, end, sc);
    softmax_tile(sc, rows, n, d, m, l, acc);
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int64_t rb = std::min<int64_t>(RB, rows - r0);
      V o[RB][NC];
      for (int r = 0; r < RB; ++r)
        if (r < rb)
          for (int c = 0; c < NC; ++c) o[r][c] = A::loadf(acc + (r0 + r) * d + 16 * c);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t kv_row = static_cast<int64_t>(slots[t0 + j]) * kv_heads + head;
        const T* vrow = vbuf + kv_row * d;
        const float vmul = F == kInt8 ? kv.vs[kv_row] : simd_rebase<F>();
        V v[NC];
        for (int c = 0; c < NC; ++c) v[c] = A::template load<F>(vrow + 16 * c);
        for (int r = 0; r < RB; ++r) {
          if (r >= rb) break;
          const float p = sc[(r0 + r) * kTile + j] * vmul;
          if (p == 0.f) continue;
          const V pv = A::set1(p);
          for (int c = 0; c < NC; ++c) o[r][c] = A::fma(pv, v[c], o[r][c]);
        }
      }
      for (int r = 0; r < RB; ++r)
        if (r < rb)
          for (int c = 0; c < NC; ++c) A::storef(acc + (r0 + r) * d + 16 * c, o[r][c]);
    }
  }
}

#endif  // RADIXSERVE_SIMD_ATTENTION

#if defined(RADIXSERVE_SIMD_ATTENTION)
// ---- bf16 K / V rows, head_dim 64 or 128: a vector of positions' scores at a time ----
//
// attend_simd reduces each position's dot products across a vector on its own (two extracts and a
// horizontal add tree per position) and writes the scores one float at a time: on the default model
// (head_dim 64, three query rows a KV head) it spent ~80 cycles a position and head, twice its loads'
// and FMAs' worth, and a batch-1 step's attention ran at 10-20 GB/s against ~50 for its weights. Here
// a bf16 pair in a 32-bit lane is two floats with one op each (the odd element is the lane with its
// low half cleared, the even one the lane shifted left by 16), so K and V rows become float vectors of
// their even and odd elements, the query rows and the outputs are kept in that order, and a vector's
// worth of positions' dot products (sixteen on AVX-512, eight on AVX2) are reduced together into one
// vector of scores (an add tree across them, ~3 ops a position and row) that the softmax takes whole,
// two such vectors a block. One thread over a context of 1024 in L2 (2-core Xeon): 15.7 -> 9.5 ns a
// position and head on AVX-512, 25.7 -> 17.2 on AVX2. Same float32 arithmetic as attend_simd (exact
// products, float32 sums in another order, the same exp).
namespace bf16blocks {

// The vector ops the shared parts take: V holds kLanes floats, a K / V chunk is kChunk bf16 values
// (one load) that pair() splits into even and odd floats; fold4 takes four vectors to one holding, per
// 128-bit group, a partial sum of each of the four in order, and fold() kLanes / 4 of those to one
// vector whose lane j is the whole sum of the j-th.
struct B256 {
  using V = __m256;
  static constexpr int64_t kLanes = 8, kChunk = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V clamp(V x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, set1(lo)), set1(hi)); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for integral n in float range
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static void pair(const c10::BFloat16* p, V& e, V& o) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    e = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    o = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
  }
  static V fold4(const V* v) {
    const __m256d a = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1])));
    const __m256d b = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3])));
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  static V fold(const V* y) {  // two fold4 results: each one's two halves added
    return _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
  }
};

#if defined(__AVX512F__)
struct B512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16, kChunk = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V clamp(V x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, set1(lo)), set1(hi)); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static void pair(const c10::BFloat16* p, V& e, V& o) {
    const __m512i w = _mm512_loadu_si512(p);
    e = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    o = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
  }
  static V fold4(const V* v) {
    const __m512d a = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1])));
    const __m512d b = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3])));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  static V fold(const V* y) {  // four fold4 results: groups 0, 1 of each pair's first, 2, 3 of its second
    const V z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
    const V z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
  }
};
#endif

// vexp on a vector (the same clamp, rounding, reduction and polynomial).
template <class X>
inline typename X::V exp_v(typename X::V x) {
  using V = typename X::V;
  x = X::clamp(x, -87.0f, 88.0f);
  const V n = X::round(X::mul(x, X::set1(1.44269504088896341f)));
  const V r = X::fnma(n, X::set1(1.428606765330187045e-06f), X::fnma(n, X::set1(0.693145751953125f), x));
  V p = X::set1(1.f / 720.f);
  p = X::fma(p, r, X::set1(1.f / 120.f));
  p = X::fma(p, r, X::set1(1.f / 24.f));
  p = X::fma(p, r, X::set1(1.f / 6.f));
  p = X::fma(p, r, X::set1(0.5f));
  p = X::fma(p, r, X::set1(1.f));
  p = X::fma(p, r, X::set1(1.f));
  return X::mul(p, X::pow2(n));
}

// Scores of R query rows for positions t0 + first + [0, kLanes) (those from n on: 0) into s[r], lane j
// for position t0 + first + j. q(r, c, odd) is row r's even or odd floats of chunk c. Four positions at
// a time, their dot products folded at once (the first two levels of the add tree), so that only R *
// kLanes / 4 vectors wait for the rest.
template <class X, int NC, int R, class Q>
inline void scores(const KvView& kv, int64_t head, const int32_t* slots, int64_t t0, int64_t first, int64_t n,
                   int64_t end, Q&& q, typename X::V* s) {
  using V = typename X::V;
  constexpr int64_t d = X::kChunk * NC, kAhead = 16;
  const c10::BFloat16* kbuf = static_cast<const c10::BFloat16*>(kv.k);
  V y[R][X::kLanes / 4];
  for (int64_t j4 = 0; j4 < X::kLanes; j4 += 4) {
    V dots[R][4];
    for (int64_t u = 0; u < 4; ++u) {
      const int64_t j = first + j4 + u, pos = t0 + j;
      if (j >= n) {
        for (int r = 0; r < R; ++r) dots[r][u] = X::zero();
        continue;
      }
      if (pos + kAhead < end)
        prefetch_kv<c10::BFloat16, kFloat>(kv, static_cast<int64_t>(slots[pos + kAhead]) * kv.kv_heads + head, d);
      const c10::BFloat16* krow = kbuf + (static_cast<int64_t>(slots[pos]) * kv.kv_heads + head) * d;
      V x[R];
      for (int r = 0; r < R; ++r) x[r] = X::zero();
      for (int c = 0; c < NC; ++c) {
        V e, o;
        X::pair(krow + X::kChunk * c, e, o);
        for (int r = 0; r < R; ++r) x[r] = X::fma(q(r, c, 1), o, X::fma(q(r, c, 0), e, x[r]));
      }
      for (int r = 0; r < R; ++r) dots[r][u] = x[r];
    }
    for (int r = 0; r < R; ++r) y[r][j4 / 4] = X::fold4(dots[r]);
  }
  for (int r = 0; r < R; ++r) s[r] = X::fold(y[r]);
}

#if defined(__AVX512F__)
// attend() for R query rows of head_dim 32 * NC on AVX-512, in blocks of 32 positions (two vectors of
// scores a row: the online softmax's chain of reductions and exps, which the next block waits on, once
// per 32); the rows' outputs stay in registers.
template <int NC, int R>
void rows512(const float* q, const int64_t* limit, const KvView& kv, int64_t head, const int32_t* slots,
             int64_t start, int64_t end, float* m_io, float* l_io, float* acc) {
  using X = B512;
  constexpr int64_t d = 32 * NC, kHalf = 16, kBlock = 2 * kHalf;
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  auto split = [&](const float* row, __m512& e, __m512& o) {  // floats [0, 32) as (even, odd)
    const __m512 lo = _mm512_loadu_ps(row), hi = _mm512_loadu_ps(row + 16);
    e = _mm512_permutex2var_ps(lo, ie, hi), o = _mm512_permutex2var_ps(lo, io, hi);
  };
  const c10::BFloat16* vbuf = static_cast<const c10::BFloat16*>(kv.v);
  __m512 qv[R][NC][2], oe[R][NC], oo[R][NC];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = m_io[r], l[r] = l_io[r];
    for (int c = 0; c < NC; ++c) {
      split(q + r * d + 32 * c, qv[r][c][0], qv[r][c][1]);
      split(acc + r * d + 32 * c, oe[r][c], oo[r][c]);
    }
  }
  auto qf = [&](int r, int c, int odd) { return qv[r][c][odd]; };
  auto lanes = [](int64_t k) {  // the first k of 16 lanes
    return static_cast<__mmask16>(k >= kHalf ? 0xFFFF : k <= 0 ? 0 : (1u << k) - 1);
  };
  alignas(64) float p[R][kBlock];
  for (int64_t t0 = start; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    __m512 s[2][R];
    for (int h = 0; h < 2; ++h) scores<X, NC, R>(kv, head, slots, t0, h * kHalf, n, end, qf, s[h]);
    for (int r = 0; r < R; ++r) {
      const int64_t seen_n = std::min(n, limit[r] - t0);  // positions of the block row r sees
      const __mmask16 s0 = lanes(seen_n), s1 = lanes(seen_n - kHalf);
      if (s0 == 0) {
        for (int64_t j = 0; j < kBlock; ++j) p[r][j] = 0.f;
        continue;
      }
      const __m512 top = _mm512_mask_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), s0, s[0][r]), s1, s[0][r],
                                            s[1][r]);
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
      const float corr = m[r] == kNegInf ? 0.f : vexp(m[r] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 e0 = _mm512_maskz_mov_ps(s0, exp_v<X>(_mm512_sub_ps(s[0][r], mv)));
      const __m512 e1 = _mm512_maskz_mov_ps(s1, exp_v<X>(_mm512_sub_ps(s[1][r], mv)));
      _mm512_store_ps(p[r], e0);
      _mm512_store_ps(p[r] + kHalf, e1);
      l[r] = l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      m[r] = m_new;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < NC; ++c) oe[r][c] = _mm512_mul_ps(oe[r][c], cv), oo[r][c] = _mm512_mul_ps(oo[r][c], cv);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const c10::BFloat16* vrow = vbuf + (static_cast<int64_t>(slots[t0 + j]) * kv.kv_heads + head) * d;
      __m512 ve[NC], vo[NC];
      for (int c = 0; c < NC; ++c) X::pair(vrow + 32 * c, ve[c], vo[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 pj = _mm512_set1_ps(p[r][j]);
        for (int c = 0; c < NC; ++c) {
          oe[r][c] = _mm512_fmadd_ps(pj, ve[c], oe[r][c]);
          oo[r][c] = _mm512_fmadd_ps(pj, vo[c], oo[r][c]);
        }
      }
    }
  }
  const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int r = 0; r < R; ++r) {
    m_io[r] = m[r], l_io[r] = l[r];
    for (int c = 0; c < NC; ++c) {
      float* row = acc + r * d + 32 * c;
      _mm512_storeu_ps(row, _mm512_permutex2var_ps(oe[r][c], il, oo[r][c]));
      _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(oe[r][c], ih, oo[r][c]));
    }
  }
}
#endif

inline float hmax256(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// attend() for R query rows of head_dim 16 * NC on AVX2, in blocks of 16 positions. With sixteen ymm
// registers a row's outputs stay in an L1 buffer between blocks and each row takes the block's V rows
// on its own.
template <int NC, int R>
void rows256(const float* q, const int64_t* limit, const KvView& kv, int64_t head, const int32_t* slots,
             int64_t start, int64_t end, float* m_io, float* l_io, float* acc) {
  using X = B256;
  constexpr int64_t d = 16 * NC, kHalf = 8, kBlock = 2 * kHalf;
  const c10::BFloat16* vbuf = static_cast<const c10::BFloat16*>(kv.v);
  // query rows and outputs as (even, odd) eights of each chunk of 16: [row][chunk][even 8, odd 8]
  alignas(32) float qs[R][NC][16], os[R][NC][16];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = m_io[r], l[r] = l_io[r];
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < 8; ++i) {
        qs[r][c][i] = q[r * d + 16 * c + 2 * i], qs[r][c][8 + i] = q[r * d + 16 * c + 2 * i + 1];
        os[r][c][i] = acc[r * d + 16 * c + 2 * i], os[r][c][8 + i] = acc[r * d + 16 * c + 2 * i + 1];
      }
  }
  auto qf = [&](int r, int c, int odd) { return _mm256_load_ps(qs[r][c] + 8 * odd); };
  auto lanes = [](int64_t k) {  // the first k of eight lanes, as an all-ones / zero lane mask
    const int32_t kk = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(8, k)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(kk), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  };
  alignas(32) float p[R][kBlock];
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int64_t t0 = start; t0 < end; t0 += kBlock) {
    const int64_t n = std::min(kBlock, end - t0);
    __m256 s[2][R];
    for (int h = 0; h < 2; ++h) scores<X, NC, R>(kv, head, slots, t0, h * kHalf, n, end, qf, s[h]);
    for (int r = 0; r < R; ++r) {
      const int64_t seen_n = std::min(n, limit[r] - t0);  // positions of the block row r sees
      if (seen_n <= 0) continue;
      const __m256 k0 = lanes(seen_n), k1 = lanes(seen_n - kHalf);
      const __m256 top = _mm256_max_ps(_mm256_blendv_ps(neg_inf, s[0][r], k0), _mm256_blendv_ps(neg_inf, s[1][r], k1));
      const float m_new = std::max(m[r], hmax256(top));
      const float corr = m[r] == kNegInf ? 0.f : vexp(m[r] - m_new);
      const __m256 mv = _mm256_set1_ps(m_new);
      const __m256 e0 = _mm256_and_ps(k0, exp_v<X>(_mm256_sub_ps(s[0][r], mv)));
      const __m256 e1 = _mm256_and_ps(k1, exp_v<X>(_mm256_sub_ps(s[1][r], mv)));
      _mm256_store_ps(p[r], e0);
      _mm256_store_ps(p[r] + kHalf, e1);
      l[r] = l[r] * corr + hsum256(_mm256_add_ps(e0, e1));
      m[r] = m_new;
      // the row's outputs through this block's V rows, scaled by corr first
      const __m256 cv = _mm256_set1_ps(corr);
      __m256 oe[NC], oo[NC];
      for (int c = 0; c < NC; ++c) {
        oe[c] = _mm256_load_ps(os[r][c]), oo[c] = _mm256_load_ps(os[r][c] + 8);
        if (corr != 1.f) oe[c] = _mm256_mul_ps(oe[c], cv), oo[c] = _mm256_mul_ps(oo[c], cv);
      }
      for (int64_t j = 0; j < seen_n; ++j) {
        const c10::BFloat16* vrow = vbuf + (static_cast<int64_t>(slots[t0 + j]) * kv.kv_heads + head) * d;
        const __m256 pj = _mm256_set1_ps(p[r][j]);
        for (int c = 0; c < NC; ++c) {
          __m256 ve, vo;
          X::pair(vrow + 16 * c, ve, vo);
          oe[c] = _mm256_fmadd_ps(pj, ve, oe[c]);
          oo[c] = _mm256_fmadd_ps(pj, vo, oo[c]);
        }
      }
      for (int c = 0; c < NC; ++c) _mm256_store_ps(os[r][c], oe[c]), _mm256_store_ps(os[r][c] + 8, oo[c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    m_io[r] = m[r], l_io[r] = l[r];
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < 8; ++i)
        acc[r * d + 16 * c + 2 * i] = os[r][c][i], acc[r * d + 16 * c + 2 * i + 1] = os[r][c][8 + i];
  }
}

// rows512 / rows256 for k query rows, k up to four (two at head_dim 128 on AVX-512, whose outputs take
// twice the registers).
#if defined(__AVX512F__)
template <int NC>
void rows512_k(int k, const float* q, const int64_t* limit, const KvView& kv, int64_t head, const int32_t* slots,
               int64_t start, int64_t end, float* m, float* l, float* acc) {
  if (k == 1) rows512<NC, 1>(q, limit, kv, head, slots, start, end, m, l, acc);
  else if (k == 2) rows512<NC, 2>(q, limit, kv, head, slots, start, end, m, l, acc);
  else if constexpr (NC == 2) {
    if (k == 3) rows512<NC, 3>(q, limit, kv, head, slots, start, end, m, l, acc);
    else rows512<NC, 4>(q, limit, kv, head, slots, start, end, m, l, acc);
  }
}
#endif
template <int NC>
void rows256_k(int k, const float* q, const int64_t* limit, const KvView& kv, int64_t head, const int32_t* slots,
               int64_t start, int64_t end, float* m, float* l, float* acc) {
  if (k == 1) rows256<NC, 1>(q, limit, kv, head, slots, start, end, m, l, acc);
  else if (k == 2) rows256<NC, 2>(q, limit, kv, head, slots, start, end, m, l, acc);
  else if (k == 3) rows256<NC, 3>(q, limit, kv, head, slots, start, end, m, l, acc);
  else rows256<NC, 4>(q, limit, kv, head, slots, start, end, m, l, acc);
}

// attend() for head_dim 64 / 128 on the widest vectors this build and the capped ISA allow; false where
// neither applies (the caller takes attend_simd).
inline bool attend(int isa, const float* q, int64_t rows_n, const int64_t* limit, const KvView& kv, int64_t head,
                   int64_t d, const int32_t* slots, int64_t start, int64_t end, float* m, float* l, float* acc) {
  using RowsK = void (*)(int, const float*, const int64_t*, const KvView&, int64_t, const int32_t*, int64_t, int64_t,
                         float*, float*, float*);
  auto blocks = [&](int64_t most, RowsK rows_k) {
    for (int64_t r0 = 0; r0 < rows_n; r0 += most)
      rows_k(static_cast<int>(std::min(most, rows_n - r0)), q + r0 * d, limit + r0, kv, head, slots, start, end,
             m + r0, l + r0, acc + r0 * d);
    return true;
  };
  if (d != 64 && d != 128) return false;
#if defined(__AVX512F__)
  if (isa >= 2) return d == 64 ? blocks(4, rows512_k<2>) : blocks(2, rows512_k<4>);
#endif
  if (isa >= 1) return d == 64 ? blocks(4, rows256_k<4>) : blocks(4, rows256_k<8>);
  return false;
}

}  // namespace bf16blocks
#endif

template <typename T, int F>
void attend(const float* q, int64_t rows, const int64_t* limit, const KvView& kv, int64_t head, int64_t d,
            const int32_t* slots, int64_t start, int64_t end, float* m, float* l, float* acc,
            std::vector<float>& scores) {
  const int isa = radixserve_kernel_isa();
#if defined(RADIXSERVE_SIMD_ATTENTION)
  if constexpr (std::is_same_v<T, c10::BFloat16> && F == kFloat) {
    if (!bf16_blocks_disabled() &&
        bf16blocks::attend(isa, q, rows, limit, kv, head, d, slots, start, end, m, l, acc))
      return;
  }
#endif
#if defined(RADIXSERVE_SIMD_ATTENTION) && defined(__AVX512F__)
  if (isa >= 2 && (d == 64 || d == 128)) {
    if (d == 64) return attend_simd<A512, T, F, 4>(q, rows, limit, kv, head, slots, start, end, m, l, acc, scores);
    return attend_simd<A512, T, F, 8>(q, rows, limit, kv, head, slots, start, end, m, l, acc, scores);
  }
#endif
#if defined(RADIXSERVE_SIMD_ATTENTION)
  if (isa >= 1 && (d == 64 || d == 128)) {
    if (d == 64) return attend_simd<A256, T, F, 4>(q, rows, limit, kv, head, slots, start, end, m, l, acc, scores);
    return attend_simd<A256, T, F, 8>(q, rows, limit, kv, head, slots, start, end, m, l, acc, scores);
  }
#endif
  (void)isa;
  if (d == 64) {
    attend_impl<T, F, 64>(q, rows, limit, kv, head, d, slots, start, end, m, l, acc, scores);
  } else if (d == 128) {
    attend_impl<T, F, 128>(q, rows, limit, kv, head, d, slots, start, end, m, l, acc, scores);
  } else {
    TORCH_CHECK(d <= 512, "head_dim above 512 is not supported by the CPU attention kernels");
    attend_impl<T, F, 0>(q, rows, limit, kv, head, d, slots, start, end, m, l, acc, scores);
  }
}

// Calls fn(T{}, std::integral_constant<int, F>{}) with the stored element type and format.
template <typename Fn>
void dispatch_kv(const at::Tensor& k_buffer, int64_t format, Fn&& fn) {
  const auto st = k_buffer.scalar_type();
  switch (format) {
    case kFloat:
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "kv_float",
                                      [&] { fn(scalar_t{}, std::integral_constant<int, kFloat>{}); });
      return;
    case kInt8:
      TORCH_CHECK(st == at::kChar, "an int8 KV cache needs int8 buffers");
      fn(int8_t{}, std::integral_constant<int, kInt8>{});
      return;
    case kFp8E4M3:
    case kFp8E5M2:
      TORCH_CHECK(st == at::kByte, "an fp8 KV cache stores its bits in uint8 buffers");
      if (format == kFp8E4M3)
        fn(uint8_t{}, std::integral_constant<int, kFp8E4M3>{});
      else
        fn(uint8_t{}, std::integral_constant<int, kFp8E5M2>{});
      return;
    default:
      TORCH_CHECK(false, "unknown KV cache format code ", format);
  }
}

KvView make_view(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const c10::optional<at::Tensor>& k_scales,
                 const c10::optional<at::Tensor>& v_scales, int64_t format, double k_scale, double v_scale) {
  KvView kv{k_buffer.data_ptr(), v_buffer.data_ptr(), nullptr, nullptr, 1.f, 1.f, k_buffer.size(1)};
  if (format == kInt8) {
    TORCH_CHECK(k_scales.has_value() && v_scales.has_value(), "an int8 KV cache needs its scale tensors");
    for (const at::Tensor* t : {&*k_scales, &*v_scales})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == k_buffer.size(0) && t->size(1) == k_buffer.size(1),
                  "int8 KV scales must be float32 [slots, kv_heads]");
    kv.ks = k_scales->data_ptr<float>();
    kv.vs = v_scales->data_ptr<float>();
  } else if (format == kFp8E4M3 || format == kFp8E5M2) {
    kv.k_scale = static_cast<float>(k_scale);
    kv.v_scale = static_cast<float>(v_scale);
  }
  return kv;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                  const at::Tensor& req_to_token, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu(), "radixserve CPU attention needs CPU tensors");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.sizes() == v_buffer.sizes(), "k/v buffers: [slots, kv_heads, dim]");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type(), "k and v buffers must share a dtype");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.is_contiguous(), "req_to_token: int32");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.dim() == 3 && k_buffer.size(2) == q.size(2) && q.size(1) % k_buffer.size(1) == 0,
              "head shapes do not match the KV pool");
}

// The batch's rows of req_to_token: request b's KV slots are slots(b)[0, seq_len(b)).
struct PageTable {
  at::Tensor req_idx, lens;  // int64 copies kept alive for the raw pointers below
  const int64_t* ridx;
  const int64_t* slen;
  const int32_t* table;
  int64_t stride;

  PageTable(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens)
      : req_idx(req_pool_indices.to(at::kLong).contiguous()),
        lens(seq_lens.to(at::kLong).contiguous()),
        ridx(req_idx.data_ptr<int64_t>()),
        slen(lens.data_ptr<int64_t>()),
        table(req_to_token.data_ptr<int32_t>()),
        stride(req_to_token.stride(0)) {}

  int64_t batch() const { return lens.size(0); }
  int64_t seq_len(int64_t b) const { return slen[b]; }
  const int32_t* slots(int64_t b) const { return table + ridx[b] * stride; }
};

template <typename Q>
void load_query(const Q* q, int64_t rows, int64_t d, float scale, float* dst) {
  for (int64_t i = 0; i < rows * d; ++i) dst[i] = to_float(q[i]) * scale;
}

// One decode task: `rows` query rows of one request (consecutive heads of KV head h's group, at q)
// over positions [lo, hi) of its len: per row the running max and sum into ml[2r], ml[2r + 1] and
// the unnormalized output into acc[r * d].
template <typename kv_t, int F, typename Q>
void decode_rows(const Q* q, int64_t rows, float q_scale, const KvView& kv, int64_t h, int64_t d, const int32_t* slots,
                 int64_t len, int64_t lo, int64_t hi, float* ml, float* acc) {
  thread_local std::vector<float> qf, scores, mm, ll;
  thread_local std::vector<int64_t> limit;
  qf.resize(rows * d);
  mm.assign(rows, kNegInf);
  ll.assign(rows, 0.f);
  limit.assign(rows, len);
  std::fill(acc, acc + rows * d, 0.f);
  load_query(q, rows, d, q_scale, qf.data());
  attend<kv_t, F>(qf.data(), rows, limit.data(), kv, h, d, slots, lo, hi, mm.data(), ll.data(), acc, scores);
  for (int64_t r = 0; r < rows; ++r) {
    ml[2 * r] = mm[r];
    ml[2 * r + 1] = ll[r];
  }
}

// Query rows [g0, g1) of one (request, KV head) merged over its splits by log-sum-exp: ml and po hold
// [splits][group] of (max, sum) and outputs; row g is written at dst + g * d.
template <typename Q>
void merge_rows(const float* ml, const float* po, int64_t splits, int64_t group, int64_t g0, int64_t g1, int64_t d,
                float v_scale, Q* dst) {
  thread_local std::vector<float> o;
  o.resize(d);
  for (int64_t g = g0; g < g1; ++g) {
    float gmax = kNegInf;
    for (int64_t s = 0; s < splits; ++s) gmax = std::max(gmax, ml[(s * group + g) * 2]);
    std::fill(o.begin(), o.end(), 0.f);
    float total = 0.f;
    for (int64_t s = 0; s < splits; ++s) {
      const float* mls = ml + (s * group + g) * 2;
      if (mls[0] == kNegInf) continue;
      const float w = std::exp(mls[0] - gmax);
      total += w * mls[1];
      const float* a = po + (s * group + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
    }
    const float inv = total > 0.f ? v_scale / total : 0.f;
    for (int64_t i = 0; i < d; ++i) dst[g * d + i] = static_cast<Q>(o[i] * inv);
  }
}

// Task p of n in the zigzag order (first, last, second, second to last, ...): requests later in a
// batch are usually the younger, shorter ones, so each thread's contiguous range of p gets a share of
// long and short contexts.
inline int64_t zigzag(int64_t p, int64_t n) { return p % 2 == 0 ? p / 2 : n - 1 - p / 2; }

}  // namespace

// q, out: [batch, heads, dim]; seq_lens count the new token, whose KV is already in the pool.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                      int64_t kv_format, double k_scale, double v_scale, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                      int64_t num_splits) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, out);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  const int64_t splits = std::max<int64_t>(1, num_splits);
  const PageTable pages(req_to_token, req_pool_indices, seq_lens);
  const KvView kv = make_view(k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale);
  const float q_scale = static_cast<float>(scale) * kv.k_scale;
  // partial results per (request, kv head, split): running max, sum, and output
  auto part_ml = at::empty({batch, kv_heads, splits, group, 2}, q.options().dtype(at::kFloat));
  auto part_o = at::empty({batch, kv_heads, splits, group, d}, q.options().dtype(at::kFloat));
  float* ml = part_ml.data_ptr<float>();
  float* po = part_o.data_ptr<float>();

  dispatch_kv(k_buffer, kv_format, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_q", [&] {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      const int64_t tasks = batch * kv_heads * splits;
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          // (request, split, KV head) order, as DecodeAttention::attend; results in (request, KV head, split)
          const int64_t order = zigzag(p / kv_heads, tasks / kv_heads) * kv_heads + p % kv_heads;
          const int64_t b = order / (kv_heads * splits), s = (order / kv_heads) % splits, h = order % kv_heads;
          const int64_t task = (b * kv_heads + h) * splits + s;
          const int64_t len = pages.seq_len(b), chunk = (len + splits - 1) / splits;
          const int64_t lo = std::min(len, s * chunk), hi = std::min(len, lo + chunk);
          decode_rows<kv_t, F>(qp + (b * heads + h * group) * d, group, q_scale, kv, h, d, pages.slots(b), len, lo, hi,
                               ml + task * group * 2, po + task * group * d);
        }
      });
      // merge the splits of each (request, head) by log-sum-exp
      at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh)
          merge_rows(ml + bh * splits * group * 2, po + bh * splits * group * d, splits, group, 0, group, d, kv.v_scale,
                     op + bh * group * d);
      });
    });
  });
}

// q, out: [tokens, heads, dim], the new tokens of each request packed in batch order (their KV
// already in the pool). Token i of request b sits at position prefix_b + i and attends causally.
void extend_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                      int64_t kv_format, double k_scale, double v_scale, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      const at::Tensor& extend_start_loc, const at::Tensor& extend_seq_lens, at::Tensor& out,
                      double scale) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, out);
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  const PageTable pages(req_to_token, req_pool_indices, seq_lens);
  const KvView kv = make_view(k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale);
  const float q_scale = static_cast<float>(scale) * kv.k_scale;
  auto starts = extend_start_loc.to(at::kLong).contiguous();
  auto ext = extend_seq_lens.to(at::kLong).contiguous();
  const int64_t batch = pages.batch();
  const int64_t* sloc = starts.data_ptr<int64_t>();
  const int64_t* elen = ext.data_ptr<int64_t>();
  struct Task {
    int64_t b, q0, q1, h;
  };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t q0 = 0; q0 < elen[b]; q0 += kQueryBlock)
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({b, q0, std::min(elen[b], q0 + kQueryBlock), h});

  dispatch_kv(k_buffer, kv_format, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "extend_attention_q", [&] {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf, acc, m, l, scores;
        std::vector<int64_t> limit;
        for (int64_t ti = begin; ti < end; ++ti) {
          const Task t = tasks[ti];
          const int64_t prefix = pages.seq_len(t.b) - elen[t.b];
          const int64_t rows = (t.q1 - t.q0) * group;
          qf.resize(rows * d);
          acc.assign(rows * d, 0.f);
          m.assign(rows, kNegInf);
          l.assign(rows, 0.f);
          limit.resize(rows);
          for (int64_t i = t.q0; i < t.q1; ++i) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = (i - t.q0) * group + g;
              load_query(qp + ((sloc[t.b] + i) * heads + t.h * group + g) * d, 1, d, q_scale, qf.data() + r * d);
              limit[r] = prefix + i + 1;
            }
          }
          attend<kv_t, F>(qf.data(), rows, limit.data(), kv, t.h, d, pages.slots(t.b), 0, prefix + t.q1, m.data(),
                          l.data(), acc.data(), scores);
          for (int64_t i = t.q0; i < t.q1; ++i) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = (i - t.q0) * group + g;
              scalar_t* dst = op + ((sloc[t.b] + i) * heads + t.h * group + g) * d;
              const float inv = l[r] > 0.f ? kv.v_scale / l[r] : 0.f;
              for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[r * d + x] * inv);
            }
          }
        }
      });
    });
  });
}

// Speculative verification of draft trees: request b's n_b = extend_seq_lens[b] new tokens are
// the nodes of its draft tree (BFS order, at positions prefix_b + i, KV already in the pool) and
// `tree_mask` holds each request's [n_b, n_b] mask (row i may see node j), concatenated in batch
// order. Every node sees the whole prefix, read in place once for all of a request's nodes, then
// its own ancestors (and itself) among the nodes.
void tree_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                    const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                    int64_t kv_format, double k_scale, double v_scale, const at::Tensor& req_to_token,
                    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                    const at::Tensor& extend_start_loc, const at::Tensor& extend_seq_lens,
                    const at::Tensor& tree_mask, at::Tensor& out, double scale) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, out);
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  const PageTable pages(req_to_token, req_pool_indices, seq_lens);
  const KvView kv = make_view(k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale);
  const float q_scale = static_cast<float>(scale) * kv.k_scale;
  auto starts = extend_start_loc.to(at::kLong).contiguous();
  auto ext = extend_seq_lens.to(at::kLong).contiguous();
  auto mask = tree_mask.to(at::kBool).contiguous();
  const int64_t batch = pages.batch();
  const int64_t* sloc = starts.data_ptr<int64_t>();
  const int64_t* elen = ext.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  std::vector<int64_t> mask_off(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) mask_off[b + 1] = mask_off[b] + elen[b] * elen[b];
  TORCH_CHECK(mask.numel() == mask_off[batch], "tree_attention: tree_mask must hold sum(n_b^2) entries, has ",
              mask.numel());
  dispatch_kv(k_buffer, kv_format, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tree_attention_q", [&] {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf, acc, m, l, scores;
        std::vector<int64_t> limit;
        std::vector<int32_t> own;  // one node's ancestors' slots, in position order
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / kv_heads, h = task % kv_heads, n = elen[b];
          const int64_t prefix = pages.seq_len(b) - n, rows = n * group;
          const int32_t* slots = pages.slots(b);
          qf.resize(rows * d);
          acc.assign(rows * d, 0.f);
          m.assign(rows, kNegInf);
          l.assign(rows, 0.f);
          limit.assign(rows, prefix);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t g = 0; g < group; ++g)
              load_query(qp + ((sloc[b] + i) * heads + h * group + g) * d, 1, d, q_scale,
                         qf.data() + (i * group + g) * d);
          if (prefix > 0)
            attend<kv_t, F>(qf.data(), rows, limit.data(), kv, h, d, slots, 0, prefix, m.data(), l.data(),
                            acc.data(), scores);
          const bool* mb = mp + mask_off[b];
          for (int64_t i = 0; i < n; ++i) {
            own.clear();
            for (int64_t j = 0; j < n; ++j)
              if (mb[i * n + j]) own.push_back(slots[prefix + j]);
            const int64_t r = i * group, cnt = static_cast<int64_t>(own.size());
            std::fill(limit.begin() + r, limit.begin() + r + group, cnt);
            attend<kv_t, F>(qf.data() + r * d, group, limit.data() + r, kv, h, d, own.data(), 0, cnt, m.data() + r,
                            l.data() + r, acc.data() + r * d, scores);
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = i * group + g;
              scalar_t* dst = op + ((sloc[b] + i) * heads + h * group + g) * d;
              const float inv = l[r] > 0.f ? kv.v_scale / l[r] : 0.f;
              for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[r * d + x] * inv);
            }
          }
        }
      });
    });
  });
}

namespace {

// One row of head_dim values into the stored format (bit-identical to kernels/reference.py's
// quantize_kv: the same float32 divisions, round-half-even, saturation).
template <typename T, int F, typename S>
void store_row(const S* x, int64_t d, T* dst, float* row_scale, float scale) {
  if constexpr (F == kInt8) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
    const float s = amax / 127.f;
    *row_scale = s;
    for (int64_t i = 0; i < d; ++i) {
      const float v = s > 0.f ? std::nearbyint(static_cast<float>(x[i]) / s) : 0.f;
      dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
  } else if constexpr (F == kFp8E4M3) {
    for (int64_t i = 0; i < d; ++i) {
      const float v = std::min(448.f, std::max(-448.f, static_cast<float>(x[i]) / scale));
      dst[i] = c10::Float8_e4m3fn(v).x;
    }
  } else if constexpr (F == kFp8E5M2) {
    for (int64_t i = 0; i < d; ++i) {
      const float v = std::min(57344.f, std::max(-57344.f, static_cast<float>(x[i]) / scale));
      dst[i] = c10::Float8_e5m2(v).x;
    }
  } else {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(static_cast<float>(x[i]));
  }
}

}  // namespace

// Writes the new tokens' k and v ([tokens, kv_heads, head_dim], any float dtype) at pool slots
// `loc`, in the pool's format (int8: also their per-(slot, head) scales).
void kv_store(at::Tensor& k_buffer, at::Tensor& v_buffer, const c10::optional<at::Tensor>& k_scales,
              const c10::optional<at::Tensor>& v_scales, int64_t kv_format, double k_scale, double v_scale,
              const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && k_buffer.sizes() == v_buffer.sizes(),
              "kv_store: k/v buffers must be contiguous [slots, kv_heads, dim]");
  const int64_t kv_heads = k_buffer.size(1), d = k_buffer.size(2);
  const at::Tensor kc = k.contiguous().view({-1, kv_heads, d}), vc = v.contiguous().view({-1, kv_heads, d});
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && kc.size(0) == vc.size(0), "kv_store: k and v must match");
  const at::Tensor slots = loc.to(at::kLong).contiguous();
  const int64_t tokens = kc.size(0);
  TORCH_CHECK(slots.numel() == tokens, "kv_store: one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_buffer.size(0), "kv_store: slot ", sp[t], " out of range");
  const KvView kv = make_view(k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale);
  float* ks = const_cast<float*>(kv.ks);
  float* vs = const_cast<float*>(kv.vs);
  float dummy = 0.f;
  dispatch_kv(k_buffer, kv_format, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kc.scalar_type(), "kv_store", [&] {
      const scalar_t* kp = kc.data_ptr<scalar_t>();
      const scalar_t* vp = vc.data_ptr<scalar_t>();
      kv_t* kdst = static_cast<kv_t*>(k_buffer.data_ptr());
      kv_t* vdst = static_cast<kv_t*>(v_buffer.data_ptr());
      at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t row = sp[i / kv_heads] * kv_heads + i % kv_heads;
          store_row<kv_t, F>(kp + i * d, d, kdst + row * d, F == kInt8 ? ks + row : &dummy, kv.k_scale);
          store_row<kv_t, F>(vp + i * d, d, vdst + row * d, F == kInt8 ? vs + row : &dummy, kv.v_scale);
        }
      });
    });
  });
}

namespace radixserve_rows {

DecodeAttention::DecodeAttention(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                 const at::Tensor& seq_lens, const at::Tensor& out_cache_loc, int64_t heads,
                                 int64_t head_dim, int64_t kv_format, int64_t num_splits, int64_t threads)
    : req_idx_(req_pool_indices.to(at::kLong).contiguous()),
      lens_(seq_lens.to(at::kLong).contiguous()),
      req_to_token_(req_to_token),
      slots_(out_cache_loc.to(at::kLong).contiguous()),
      batch_(seq_lens.size(0)),
      heads_(heads),
      d_(head_dim),
      format_(kv_format),
      splits_(std::max<int64_t>(1, num_splits)),
      threads_(std::max<int64_t>(1, threads)) {
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.is_contiguous(), "req_to_token: int32");
  const int64_t* lens = lens_.data_ptr<int64_t>();
  const int64_t* ridx = req_idx_.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_; ++b)
    TORCH_CHECK(ridx[b] >= 0 && ridx[b] < req_to_token.size(0) && lens[b] >= 0 && lens[b] <= req_to_token.size(1),
                "DecodeAttention: request ", b, " is outside req_to_token");
  TORCH_CHECK(req_idx_.numel() == batch_ && slots_.numel() == batch_, "DecodeAttention: one new token per request");
  TORCH_CHECK(heads > 0 && head_dim > 0, "DecodeAttention: heads and head_dim");
}

void DecodeAttention::add_layer(const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                                const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                                double k_scale, double v_scale) {
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() && k_buffer.dim() == 3 &&
                  k_buffer.sizes() == v_buffer.sizes() && k_buffer.scalar_type() == v_buffer.scalar_type() &&
                  k_buffer.size(2) == d_ && heads_ % k_buffer.size(1) == 0,
              "DecodeAttention: k/v buffers must be contiguous [slots, kv_heads, head_dim] of the queries' heads");
  make_view(k_buffer, v_buffer, k_scales, v_scales, format_, k_scale, v_scale);  // checks the int8 scales
  dispatch_kv(k_buffer, format_, [](auto, auto) {});                             // and the format
  const int64_t* sp = slots_.data_ptr<int64_t>();
  for (int64_t t = 0; t < batch_; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_buffer.size(0), "kv_store: slot ", sp[t], " out of range");
  TORCH_CHECK(layers_.empty() || k_buffer.size(1) == kv_heads_, "DecodeAttention: every layer's KV heads alike");
  kv_heads_ = k_buffer.size(1);
  group_ = heads_ / kv_heads_;
  layers_.push_back({k_buffer, v_buffer, k_scales, v_scales, k_scale, v_scale});
  shape();
}

void DecodeAttention::shape() {
  // a group's query rows share each K / V row's loads and score reductions (one row per task made a
  // batch-1 step's attention slower, balance or not); split only where threads would otherwise idle
  const int64_t tasks = batch_ * kv_heads_ * splits_;
  parts_ = tasks >= threads_ ? 1 : std::min<int64_t>(group_, (threads_ + tasks - 1) / std::max<int64_t>(1, tasks));
  if (splits_ > 1) {
    ml_.resize(tasks * group_ * 2);
    po_.resize(tasks * group_ * d_);
  }
}

void DecodeAttention::next_step(const at::Tensor& out_cache_loc, int64_t num_splits) {
  TORCH_CHECK(!layers_.empty() && out_cache_loc.numel() == batch_, "DecodeAttention.next_step: one new token per request");
  at::Tensor slots = out_cache_loc.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (const Layer& L : layers_)
    for (int64_t t = 0; t < batch_; ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < L.k_buffer.size(0), "kv_store: slot ", sp[t], " out of range");
  int64_t* lens = lens_.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_; ++b)
    TORCH_CHECK(lens[b] < req_to_token_.size(1), "DecodeAttention.next_step: request ", b, " is outside req_to_token");
  if (!own_lens_) lens_ = lens_.clone(), lens = lens_.data_ptr<int64_t>(), own_lens_ = true;  // not the caller's
  for (int64_t b = 0; b < batch_; ++b) ++lens[b];
  slots_ = std::move(slots);
  splits_ = std::max<int64_t>(1, num_splits);
  shape();
}

void DecodeAttention::store(int64_t layer, int64_t t, int64_t kv_head, bool value, const c10::BFloat16* x) const {
  const Layer& L = layers_[layer];
  const int64_t slot = slots_.data_ptr<int64_t>()[t];
  const KvView kv = make_view(L.k_buffer, L.v_buffer, L.k_scales, L.v_scales, format_, L.k_scale, L.v_scale);
  const int64_t row = slot * kv_heads_ + kv_head;
  float dummy = 0.f;
  dispatch_kv(L.k_buffer, format_, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    kv_t* dst = static_cast<kv_t*>(value ? L.v_buffer.data_ptr() : L.k_buffer.data_ptr());
    float* scales = const_cast<float*>(value ? kv.vs : kv.ks);
    store_row<kv_t, F>(x, d_, dst + row * d_, F == kInt8 ? scales + row : &dummy, value ? kv.v_scale : kv.k_scale);
  });
}

void DecodeAttention::attend(int64_t layer, const c10::BFloat16* q, int64_t q_stride, c10::BFloat16* out, double scale,
                             int64_t thread, int64_t threads) {
  const Layer& L = layers_[layer];
  const KvView kv = make_view(L.k_buffer, L.v_buffer, L.k_scales, L.v_scales, format_, L.k_scale, L.v_scale);
  const float q_scale = static_cast<float>(scale) * kv.k_scale;
  const int64_t* lens = lens_.data_ptr<int64_t>();
  const int64_t* ridx = req_idx_.data_ptr<int64_t>();
  const int32_t* table = req_to_token_.data_ptr<int32_t>();
  const int64_t stride = req_to_token_.stride(0);
  const int64_t tasks = batch_ * kv_heads_ * splits_ * parts_, rows = (group_ + parts_ - 1) / parts_;
  const int64_t begin = tasks * thread / threads, end = tasks * (thread + 1) / threads;
  thread_local std::vector<float> ml1, po1;
  dispatch_kv(L.k_buffer, format_, [&](auto kv_tag, auto format) {
    using kv_t = decltype(kv_tag);
    constexpr int F = decltype(format)::value;
    for (int64_t p = begin; p < end; ++p) {
      // tasks in (request, split, KV head) order, zigzagged by (request, split): a thread takes a piece
      // of context for each head in turn, and the heads after the first find its rows in L2 (the
      // hardware prefetcher brings in whole rows, every head's); ml_ / po_ keep (request, KV head,
      // split) order for merge
      const int64_t per = kv_heads_ * parts_, task = zigzag(p / per, tasks / per) * per + p % per;
      const int64_t part = task % parts_, rest = task / parts_;
      const int64_t b = rest / (kv_heads_ * splits_), s = (rest / kv_heads_) % splits_, h = rest % kv_heads_;
      const int64_t whole = (b * kv_heads_ + h) * splits_ + s;
      const int64_t g0 = std::min(group_, part * rows), g1 = std::min(group_, g0 + rows);
      if (g0 >= g1) continue;
      const int64_t len = lens[b], chunk = (len + splits_ - 1) / splits_;
      const int64_t lo = std::min(len, s * chunk), hi = std::min(len, lo + chunk);
      const c10::BFloat16* qr = q + b * q_stride + (h * group_ + g0) * d_;
      if (splits_ == 1) {  // the whole context in this task: normalized straight into out
        ml1.resize(group_ * 2);
        po1.resize(group_ * d_);
        decode_rows<kv_t, F>(qr, g1 - g0, q_scale, kv, h, d_, table + ridx[b] * stride, len, lo, hi,
                             ml1.data() + g0 * 2, po1.data() + g0 * d_);
        merge_rows(ml1.data(), po1.data(), 1, group_, g0, g1, d_, kv.v_scale, out + (b * heads_ + h * group_) * d_);
      } else {
        decode_rows<kv_t, F>(qr, g1 - g0, q_scale, kv, h, d_, table + ridx[b] * stride, len, lo, hi,
                             ml_.data() + (whole * group_ + g0) * 2, po_.data() + (whole * group_ + g0) * d_);
      }
    }
  });
}

void DecodeAttention::prefetch(int64_t layer, int64_t thread, int64_t threads) const {
  const Layer& L = layers_[layer];
  const int64_t* lens = lens_.data_ptr<int64_t>();
  const int64_t* ridx = req_idx_.data_ptr<int64_t>();
  const int32_t* table = req_to_token_.data_ptr<int32_t>();
  const int64_t stride = req_to_token_.stride(0);
  const int64_t tasks = batch_ * kv_heads_ * splits_ * parts_;
  const int64_t begin = tasks * thread / threads, end = tasks * (thread + 1) / threads;
  const int64_t row = kv_heads_ * d_ * L.k_buffer.element_size();
  const char* kb = static_cast<const char*>(L.k_buffer.data_ptr());
  const char* vb = static_cast<const char*>(L.v_buffer.data_ptr());
  int64_t last = -1, budget = kPrefetchBytes / 2;  // (K and V)
  for (int64_t p = begin; p < end && budget > 0; ++p) {
    const int64_t per = kv_heads_ * parts_, task = zigzag(p / per, tasks / per) * per + p % per;
    const int64_t rest = task / parts_;
    const int64_t bs = rest / kv_heads_;  // (request, split)
    if (bs == last) continue;
    last = bs;
    const int64_t b = bs / splits_, s = bs % splits_;
    const int64_t len = lens[b], chunk = (len + splits_ - 1) / splits_;
    const int64_t lo = std::min(len, s * chunk), hi = std::min(len, lo + chunk);
    const int32_t* slots = table + ridx[b] * stride;
    for (int64_t t = lo; t < hi && budget > 0; ++t, budget -= row) {
      const int64_t off = static_cast<int64_t>(slots[t]) * row;
      for (int64_t c = 0; c < row; c += 64) {
        __builtin_prefetch(kb + off + c, 0, 2);
        __builtin_prefetch(vb + off + c, 0, 2);
      }
    }
  }
}

void DecodeAttention::merge(int64_t layer, c10::BFloat16* out, int64_t thread, int64_t threads) {
  const Layer& L = layers_[layer];
  const float v_scale = format_ == kFp8E4M3 || format_ == kFp8E5M2 ? static_cast<float>(L.v_scale) : 1.f;
  const int64_t heads = batch_ * kv_heads_;
  for (int64_t bh = heads * thread / threads; bh < heads * (thread + 1) / threads; ++bh)
    merge_rows(ml_.data() + bh * splits_ * group_ * 2, po_.data() + bh * splits_ * group_ * d_, splits_, group_, 0,
               group_, d_, v_scale, out + bh * group_ * d_);
}

}  // namespace radixserve_rows

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor? k_scales, Tensor? v_scales, "
      "int kv_format, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor(a!) out, float scale, int num_splits) -> ()");
  m.def(
      "extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor? k_scales, Tensor? v_scales, "
      "int kv_format, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor extend_start_loc, Tensor extend_seq_lens, Tensor(a!) out, float scale) -> ()");
  m.def(
      "tree_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor? k_scales, Tensor? v_scales, "
      "int kv_format, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor extend_start_loc, Tensor extend_seq_lens, Tensor tree_mask, Tensor(a!) out, "
      "float scale) -> ()");
  m.def(
      "kv_store(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor(c!)? k_scales, Tensor(d!)? v_scales, "
      "int kv_format, float k_scale, float v_scale, Tensor loc, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("tree_attention", &tree_attention);
  m.impl("kv_store", &kv_store);
}
