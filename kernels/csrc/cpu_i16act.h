// Decode-sized products of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K GGUF blocks with activations quantized to
// int16 (Q4_0 / Q4_1 only on CPUs without AVX512-BF16, which take cpu_bf16x2.h; the others on every
// CPU from AVX2 up); included by cpu_quant.cpp.
//
// Widening every weight to a float costs about four vector operations per 8 weights on AVX2, which
// held a batch-1 4-bit GEMV to ~40% of the memory bandwidth on two cores. Here each 32-value block of
// an activation row is quantized once per call to int16 with its own scale (d_x = max |x| / 32767),
// and a block's dot product is two `vpmaddwd` (or `vpdpwssd` with AVX512-VNNI) over the weights
// widened to int16: exact integer sums (|sum| < 2^24, so exact in float too), scaled by d_w * d_x.
// Q4_1's offset m multiplies the block's float sum of x, kept exactly.
//
// Why int16 and not llama.cpp's int8 activations (one `vpmaddubsw` per block; measured no faster at
// K = 4096 on Zen 4 with the AVX2 code, 26 vs 26 GB/s on two cores, and faster only for K >= 8192):
// int8 moves each activation by up to 1/254 of its block's largest, enough to flip greedy tokens
// against the float path on small models; int16 moves it by at most 1/65534 of it (d_x / 2), the
// same order as the bf16-split kernels (cpu_bf16x2.h), and greedy output stays identical.
// An output moves by at most sum_blocks (d_x / 2) * sum |w| of the block beyond float32
// summation; tests bound exactly that.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_HAVE_I16ACT 1
#include <immintrin.h>

#include <cstdint>

#include "cpu_common.h"

namespace radixserve_i16act {

using radixserve_cpu::half_to_float;
using radixserve_cpu::hsum256;
using radixserve_cpu::load16;

struct Acts {
  const int16_t* q;  // [m, nb * 32]
  const float* d;    // [m, nb]: the block's scale
  const float* s;    // [m, nb]: the block's float sum of x (for Q4_1's offset)
  int64_t nb;
};

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One activation row of k floats (k % 32 == 0) into int16 blocks with their scales and sums.
inline void prepare_row(const float* x, int64_t k, int16_t* q, float* d, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
      sm = _mm256_add_ps(sm, v[i]);
    }
    const float amax = hmax8(mx);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    for (int h = 0; h < 2; ++h) {  // packs work within 128-bit lanes: x0-3 x8-11 | x4-7 x12-15, then reorder
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], inv));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b + 16 * h), p);
    }
    d[b] = amax / 32767.f;
    s[b] = hsum256(sm);
  }
}

// Eight int32 lanes summing w0 * x0 + w1 * x1 (16 int16 pairs each).
inline __m256i dot_i16(__m256i w0, __m256i x0, __m256i w1, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w0, x0), w1, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}

enum Format { Q4_0, Q4_1, Q8_0 };

// A block's 32 quants as int16: weights 0..15 and 16..31.
template <Format F>
struct Block;

template <>
struct Block<Q4_0> {
  static constexpr int64_t BYTES = 18;
  static constexpr bool HAS_MIN = false;
  static void quants(const uint8_t* b, __m256i& w0, __m256i& w1) {  // -8..7: low nibbles, then high
    const __m128i q = load16(b + 2), m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    w0 = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(q, m), eight));
    w1 = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), eight));
  }
};

template <>
struct Block<Q4_1> {
  static constexpr int64_t BYTES = 20;
  static constexpr bool HAS_MIN = true;
  static void quants(const uint8_t* b, __m256i& w0, __m256i& w1) {  // 0..15
    const __m128i q = load16(b + 4), m = _mm_set1_epi8(0x0F);
    w0 = _mm256_cvtepu8_epi16(_mm_and_si128(q, m));
    w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m));
  }
};

template <>
struct Block<Q8_0> {
  static constexpr int64_t BYTES = 34;
  static constexpr bool HAS_MIN = false;
  static void quants(const uint8_t* b, __m256i& w0, __m256i& w1) {
    w0 = _mm256_cvtepi8_epi16(load16(b + 2));
    w1 = _mm256_cvtepi8_epi16(load16(b + 18));
  }
};

// acc[r] += (block b of row) . (block b of x[r0 + r]) * d_w * d_x for r < R (Q4_1: macc += m_w * sum x).
template <Format F, int R>
inline void block_dot(const uint8_t* row, const Acts& x, int64_t r0, int64_t b, __m256* acc, float* macc) {
  using B = Block<F>;
  const uint8_t* blk = row + b * B::BYTES;
  __m256i w0, w1;
  B::quants(blk, w0, w1);
  const float dw = half_to_float(blk);
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * x.nb + b;
    const __m256i* xq = reinterpret_cast<const __m256i*>(x.q + i * 32);
    const __m256 p = _mm256_cvtepi32_ps(dot_i16(w0, _mm256_loadu_si256(xq), w1, _mm256_loadu_si256(xq + 1)));
    acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x.d[i]), acc[r]);
    if (B::HAS_MIN) macc[r] += half_to_float(blk + 2) * x.s[i];
  }
}

// out[r] = dot(row, x[r0 + r]) for r < R over nb blocks of format F; blocks go in pairs, one
// accumulator chain each, to hide the FMA latency.
template <Format F, int R>
void dot_rows(const uint8_t* row, const Acts& x, int64_t r0, float* out) {
  const int64_t nb = x.nb;
  __m256 acc0[R], acc1[R];
  float macc[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps(), macc[r] = 0.f;
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    block_dot<F, R>(row, x, r0, b, acc0, macc);
    block_dot<F, R>(row, x, r0, b + 1, acc1, macc);
  }
  if (b < nb) block_dot<F, R>(row, x, r0, b, acc0, macc);
  for (int r = 0; r < R; ++r) out[r] = hsum256(_mm256_add_ps(acc0[r], acc1[r])) + macc[r];
}

inline __m256i madd_i16(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(w, x);
#endif
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_K super-blocks (256 weights, 144 bytes): d, dmin (fp16), 12 bytes of 6-bit scales and mins for
// 8 sub-blocks of 32, then 128 bytes of nibbles; bytes 32c..32c+31 hold sub-block 2c in their low
// nibbles and 2c + 1 in their high ones. w = d * sc_j * q - dmin * m_j.
// Q5_K (FIVE, 176 bytes): 32 bytes qh after the scales, then the nibbles; bit 2c of qh[l] is the
// fifth bit of low-nibble weight l of bytes 32c.., bit 2c + 1 that of the high one (q in 0..31).
template <int R, bool FIVE = false>
void dot_q4k(const uint8_t* row, const Acts& x, int64_t r0, float* out) {
  __m256 acc0[R], acc1[R];
  float macc[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps(), macc[r] = 0.f;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i one = _mm256_set1_epi8(1);
  constexpr int64_t kBytes = FIVE ? 176 : 144, kQs = FIVE ? 48 : 16;
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = row + sb * kBytes;
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const __m256i qh = FIVE ? load32(blk + 16) : _mm256_setzero_si256();
    float sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      int a, m;
      radixserve_cpu::scale_min_k4(j, blk + 4, a, m);
      sc[j] = d * static_cast<float>(a), mn[j] = dmin * static_cast<float>(m);
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(blk + kQs + 32 * c);
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (FIVE) {  // per byte: bit 2c / 2c + 1 of qh moved to bit 4 (16-bit shifts; the masks keep bytes apart)
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      const __m256i a0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
      const __m256i a1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
      const __m256i b0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
      const __m256i b1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * x.nb + sb * 8 + 2 * c;  // x blocks of sub-blocks 2c and 2c + 1
        const __m256i* xq = reinterpret_cast<const __m256i*>(x.q + i * 32);
        const __m256 pa = _mm256_cvtepi32_ps(dot_i16(a0, _mm256_loadu_si256(xq), a1, _mm256_loadu_si256(xq + 1)));
        const __m256 pb = _mm256_cvtepi32_ps(dot_i16(b0, _mm256_loadu_si256(xq + 2), b1, _mm256_loadu_si256(xq + 3)));
        acc0[r] = _mm256_fmadd_ps(pa, _mm256_set1_ps(sc[2 * c] * x.d[i]), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(pb, _mm256_set1_ps(sc[2 * c + 1] * x.d[i + 1]), acc1[r]);
        macc[r] += mn[2 * c] * x.s[i] + mn[2 * c + 1] * x.s[i + 1];
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(_mm256_add_ps(acc0[r], acc1[r])) - macc[r];
}

// Q6_K super-blocks (256 weights, 210 bytes): 128 bytes of low nibbles (ql), 64 of high 2-bit pairs
// (qh), 16 int8 scales for sub-blocks of 16, d (fp16). Per half of 128 weights, with L0 = ql[0..31],
// L1 = ql[32..63], H = qh[0..31]: weights 0..31 are L0 & 15 | (H & 3) << 4, 32..63 L1 & 15 | (H >> 2
// & 3) << 4, 64..95 L0 >> 4 | (H >> 4 & 3) << 4, 96..127 L1 >> 4 | (H >> 6) << 4; w = d * sc * (q - 32).
template <int R>
void dot_q6k(const uint8_t* row, const Acts& x, int64_t r0, float* out) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = row + sb * 210;
    const float d = half_to_float(blk + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = blk + 64 * h;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * h;
      const __m256i l0 = load32(ql), l1 = load32(ql + 32), hb = load32(blk + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
      for (int n = 0; n < 4; ++n) {
        const __m256i qs = _mm256_sub_epi8(q[n], off);  // -32..31
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(qs));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(qs, 1));
        const float s0 = d * static_cast<float>(sc[2 * n]), s1 = d * static_cast<float>(sc[2 * n + 1]);
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * x.nb + sb * 8 + 4 * h + n;
          const __m256i* xq = reinterpret_cast<const __m256i*>(x.q + i * 32);
          const __m256 p0 = _mm256_cvtepi32_ps(madd_i16(w0, _mm256_loadu_si256(xq)));
          const __m256 p1 = _mm256_cvtepi32_ps(madd_i16(w1, _mm256_loadu_si256(xq + 1)));
          acc0[r] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s0 * x.d[i]), acc0[r]);
          acc1[r] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s1 * x.d[i]), acc1[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(_mm256_add_ps(acc0[r], acc1[r]));
}

using DotFn = void (*)(const uint8_t*, const Acts&, int64_t, float*);

template <int R>
DotFn kernel(int64_t qtype) {
  switch (qtype) {  // GGML type ids
    case 2: return dot_rows<Q4_0, R>;
    case 3: return dot_rows<Q4_1, R>;
    case 8: return dot_rows<Q8_0, R>;
    case 12: return dot_q4k<R>;
    case 13: return dot_q4k<R, true>;
    case 14: return dot_q6k<R>;
    default: return nullptr;
  }
}

// The kernel for GGML type `qtype` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) and up to 4 activation rows, or nullptr.
inline DotFn dot_for(int64_t qtype, int rows) {
  switch (rows) {
    case 1: return kernel<1>(qtype);
    case 2: return kernel<2>(qtype);
    case 3: return kernel<3>(qtype);
    default: return kernel<4>(qtype);
  }
}

}  // namespace radixserve_i16act
#endif
