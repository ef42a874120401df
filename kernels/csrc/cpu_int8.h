// Int8 x int8 matrix products for `--quantization w8a8_int8` (included by cpu_quant.cpp).
//
// A weight row is [float32 scale][int32 sum of the quants][K int8 quants], quantized symmetrically
// per output channel at load (w ~= scale * q, |q| <= 127). Activations are quantized per token on
// the fly the same way. out[m, n] = sa[m] * sw[n] * sum_k qa[m, k] * qw[n, k], the int32 sum exact.
//
// Variants:
//  - AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so activations are stored as
//    qa + 128 (unsigned) and 128 * sum(qw) (kept in the row) is subtracted afterwards.
//  - AVX2: vpmaddubsw on |qa| and sign(qa) * qw (pairs stay within int16: 2 * 127 * 127), then
//    vpmaddwd to int32.
//  - scalar: the same sums in C++.
// Register blocking: 4 weight rows x up to 4 (VNNI) or 2 (AVX2) activation rows per pass over K.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_int8 {

constexpr int64_t kRowHeader = 8;  // float scale + int32 quant sum before each row's quants

inline int64_t row_bytes(int64_t k) { return k + kRowHeader; }

inline bool have_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// Activations of one call: q (signed), aux (qa + 128 for VNNI, |qa| for AVX2), per-row scale.
struct Acts {
  const int8_t* q;
  const uint8_t* aux;
  const float* scale;
  int64_t m, k;
};

// Quantize rows of x [m, k] symmetrically per row into q / aux / scale (buffers of m * k, m).
inline void quantize_rows(const float* x, int64_t m, int64_t k, bool vnni, int8_t* q, uint8_t* aux, float* scale) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(xr[i]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / s;
      scale[r] = s;
      int8_t* qr = q + r * k;
      uint8_t* ar = aux + r * k;
      for (int64_t i = 0; i < k; ++i) {
        const int v = static_cast<int>(std::nearbyint(xr[i] * inv));
        qr[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
      }
      if (vnni) {
        for (int64_t i = 0; i < k; ++i) ar[i] = static_cast<uint8_t>(qr[i] + 128);
      } else {
        for (int64_t i = 0; i < k; ++i) ar[i] = static_cast<uint8_t>(qr[i] < 0 ? -qr[i] : qr[i]);
      }
    }
  });
}

// sums[w * RA + r] = sum_k qa[r, k] * qw[w, k] for RW weight rows and RA activation rows.
template <int RW, int RA>
inline void dots_scalar(const int8_t* const* w, const Acts& a, int64_t r0, int64_t k, int32_t* sums) {
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < RA; ++r) {
      const int8_t* x = a.q + (r0 + r) * a.k;
      int32_t s = 0;
      for (int64_t j = 0; j < k; ++j) s += static_cast<int32_t>(x[j]) * static_cast<int32_t>(w[i][j]);
      sums[i * RA + r] = s;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int RW, int RA>
inline void dots_vnni(const int8_t* const* w, const Acts& a, int64_t r0, int64_t k, int32_t* sums) {
  __m512i acc[RW][RA];
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < RA; ++r) acc[i][r] = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 64 <= k; j += 64) {
    __m512i x[RA];
    for (int r = 0; r < RA; ++r) x[r] = _mm512_loadu_si512(a.aux + (r0 + r) * a.k + j);
    for (int i = 0; i < RW; ++i) {
      const __m512i wv = _mm512_loadu_si512(w[i] + j);
      for (int r = 0; r < RA; ++r) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], x[r], wv);
    }
  }
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < RA; ++r) {
      int32_t s = _mm512_reduce_add_epi32(acc[i][r]);
      const uint8_t* x = a.aux + (r0 + r) * a.k;
      for (int64_t t = j; t < k; ++t) s += static_cast<int32_t>(x[t]) * static_cast<int32_t>(w[i][t]);
      sums[i * RA + r] = s;  // still offset by 128 * sum(qw): the caller subtracts it
    }
}
#endif

#if defined(__AVX2__)
template <int RW, int RA>
inline void dots_avx2(const int8_t* const* w, const Acts& a, int64_t r0, int64_t k, int32_t* sums) {
  __m256i acc[RW][RA];
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < RA; ++r) acc[i][r] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    __m256i xs[RA], xa[RA];
    for (int r = 0; r < RA; ++r) {
      xs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (r0 + r) * a.k + j));
      xa[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.aux + (r0 + r) * a.k + j));
    }
    for (int i = 0; i < RW; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + j));
      for (int r = 0; r < RA; ++r) {
        const __m256i p = _mm256_maddubs_epi16(xa[r], _mm256_sign_epi8(wv, xs[r]));
        acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(p, ones));
      }
    }
  }
  for (int i = 0; i < RW; ++i)
    for (int r = 0; r < RA; ++r) {
      const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[i][r]), _mm256_extracti128_si256(acc[i][r], 1));
      const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
      int32_t s = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
      const int8_t* x = a.q + (r0 + r) * a.k;
      for (int64_t t = j; t < k; ++t) s += static_cast<int32_t>(x[t]) * static_cast<int32_t>(w[i][t]);
      sums[i * RA + r] = s;
    }
}
#endif

enum Variant : int { kScalar = 0, kAvx2 = 1, kVnni = 2 };

using DotsFn = void (*)(const int8_t* const*, const Acts&, int64_t, int64_t, int32_t*);

template <int RW>
DotsFn pick(int variant, int ra) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (variant == kVnni) {
    switch (ra) {
      case 1: return dots_vnni<RW, 1>;
      case 2: return dots_vnni<RW, 2>;
      case 3: return dots_vnni<RW, 3>;
      default: return dots_vnni<RW, 4>;
    }
  }
#endif
#if defined(__AVX2__)
  if (variant >= kAvx2) return ra == 1 ? dots_avx2<RW, 1> : dots_avx2<RW, 2>;
#endif
  (void)variant;
  return ra == 1 ? dots_scalar<RW, 1> : dots_scalar<RW, 2>;
}

inline int max_ra(int variant) { return variant == kVnni ? 4 : 2; }

// out[r * ldo + n] = dequantized int8 product for the activations `a` and the n rows at wp.
template <typename out_t>
void gemm(const Acts& a, int variant, const uint8_t* wp, int64_t n, out_t* out, int64_t ldo) {
  const int64_t k = a.k, rb = row_bytes(k), m = a.m;
  const int ra_max = max_ra(variant);
  DotsFn full[4], tail[4];
  for (int ra = 1; ra <= ra_max; ++ra) {
    full[ra - 1] = pick<4>(variant, ra);
    tail[ra - 1] = pick<1>(variant, ra);
  }
  const int64_t groups = (n + 3) / 4;
  constexpr int64_t kMTile = 128;  // activation rows kept hot in L2 while a thread's weights pass
  const int64_t grain = std::max<int64_t>(1, 4096 / k);
  at::parallel_for(0, groups, grain, [&](int64_t g_begin, int64_t g_end) {
    int32_t sums[16];
    for (int64_t m0 = 0; m0 < m; m0 += kMTile) {
      const int64_t m1 = std::min(m, m0 + kMTile);
      for (int64_t g = g_begin; g < g_end; ++g) {
        const int64_t n0 = g * 4, rw = std::min<int64_t>(4, n - n0);
        const int8_t* w[4];
        float sw[4];
        int32_t wsum[4];
        for (int64_t i = 0; i < rw; ++i) {
          const uint8_t* row = wp + (n0 + i) * rb;
          std::memcpy(&sw[i], row, 4);
          std::memcpy(&wsum[i], row + 4, 4);
          w[i] = reinterpret_cast<const int8_t*>(row + kRowHeader);
        }
        for (int64_t r = m0; r < m1; r += ra_max) {
          const int ra = static_cast<int>(std::min<int64_t>(ra_max, m1 - r));
          if (rw == 4) {
            full[ra - 1](w, a, r, k, sums);
          } else {
            for (int64_t i = 0; i < rw; ++i) tail[ra - 1](w + i, a, r, k, sums + i * ra);
          }
          for (int64_t i = 0; i < rw; ++i)
            for (int rr = 0; rr < ra; ++rr) {
              int32_t s = sums[i * ra + rr];
              if (variant == kVnni) s -= 128 * wsum[i];
              out[(r + rr) * ldo + n0 + i] = static_cast<out_t>(static_cast<float>(s) * a.scale[r + rr] * sw[i]);
            }
        }
      }
    }
  });
}

// Row dequantization (embedding lookups, tests): w = scale * q.
inline void dequantize_row(const uint8_t* row, int64_t k, float* y) {
  float s;
  std::memcpy(&s, row, 4);
  const int8_t* q = reinterpret_cast<const int8_t*>(row + kRowHeader);
  for (int64_t i = 0; i < k; ++i) y[i] = s * static_cast<float>(q[i]);
}

}  // namespace radixserve_int8
