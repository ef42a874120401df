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

// out[r] = dot(row, x[r0 + r]) for r < R; row holds k / 32 blocks of Q4_1 (HAS_MIN) or Q4_0.
// LO = false when the activations are bfloat16 already (the model's dtype): lo is then zero and
// skipped, and the result is exact up to float32 summation.
template <bool HAS_MIN, int R, bool LO>
void dot_q4(const uint8_t* row, int64_t k, const Acts& x, int64_t r0, float* out) {
  constexpr int64_t BYTES = HAS_MIN ? 20 : 18, QOFF = HAS_MIN ? 4 : 2;
  const int64_t nb = k / 32, pairs = x.pairs;
  static const __m512i table = quant_table<HAS_MIN>();  // built once, not per weight row
  // lanes 0..7 of a product belong to block A, 8..15 to B: d spread accordingly
  const __m512i didx = HAS_MIN ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
                               : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R];
  __m128 macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm_setzero_ps();
  const int64_t stride = pairs * 64;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* a = row + 2 * p * BYTES;
    const bool has_b = 2 * p + 1 < nb;
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
      const uint16_t* xh = x.hi + (r0 + r) * stride + p * 64;
      const uint16_t* xl = x.lo + (r0 + r) * stride + p * 64;
      __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, as_bh(_mm512_loadu_si512(xh)));
      t = _mm512_dpbf16_ps(t, wh, as_bh(_mm512_loadu_si512(xh + 32)));
      if (LO) {  // a second short chain (vdpbf16ps latency)
        __m512 u = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, as_bh(_mm512_loadu_si512(xl)));
        u = _mm512_dpbf16_ps(u, wh, as_bh(_mm512_loadu_si512(xl + 32)));
        t = _mm512_add_ps(t, u);
      }
      acc[r] = _mm512_fmadd_ps(t, dv, acc[r]);
      if (HAS_MIN) macc[r] = _mm_fmadd_ps(hdr, _mm_loadu_ps(x.sums + (r0 + r) * pairs * 4 + p * 4), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(acc[r]);
    if (HAS_MIN) {
      __m128 v = _mm_add_ps(macc[r], _mm_movehl_ps(macc[r], macc[r]));
      v = _mm_add_ss(v, _mm_movehdup_ps(v));
      s += _mm_cvtss_f32(v);
    }
    out[r] = s;
  }
}

using DotFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, float*);

template <bool HAS_MIN, bool LO>
DotFn dot_for_rows(int rows) {
  switch (rows) {
    case 1: return dot_q4<HAS_MIN, 1, LO>;
    case 2: return dot_q4<HAS_MIN, 2, LO>;
    case 3: return dot_q4<HAS_MIN, 3, LO>;
    default: return dot_q4<HAS_MIN, 4, LO>;
  }
}

inline DotFn dot_for(bool has_min, bool lo, int rows) {
  if (has_min) return lo ? dot_for_rows<true, true>(rows) : dot_for_rows<true, false>(rows);
  return lo ? dot_for_rows<false, true>(rows) : dot_for_rows<false, false>(rows);
}

}  // namespace radixserve_bf16x2
#endif
