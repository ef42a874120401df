// Batched products of 4- and 8-bit GGUF weights (Q4_0, Q4_1, Q8_0) on AVX-512 VNNI without AMX:
// int8 activations times the weights' integer quants (included by cpu_quant.cpp).
//
// For batches above the decode sizes the bf16 tiles (dequantize a tile of weights to bf16, one bf16
// GEMM per tile) reach about 60 % of the bf16 peak at M = 64 on Zen 4, and the bf16 peak is half
// the int8 one (vpdpbusd multiplies 64 byte pairs per instruction, vdpbf16ps 32 bf16 pairs). Here:
//  - each row of x is quantized per block of 32 like llama.cpp's Q8 activations: d_x = max |x| / 127,
//    q_x = round(x / d_x), s_x = d_x * sum(q_x);
//  - each thread unpacks a panel of 32 weight rows into unsigned bytes in the VNNI order
//    ([block][4 inputs][32 rows][4 bytes]: one zmm holds 4 consecutive inputs of 16 rows) with the
//    rows' per-block scale d_w and offset term m_w, once per call, and runs every row of x over it;
//  - w = d_w * u + m_w / 128 ... in one form for the three types: with u the unsigned quant,
//      Q4_1: w = d * u + m          (u = q,        m_w = m)
//      Q4_0: w = d * (u - 8)        (u = q,        m_w = -8 d)
//      Q8_0: w = d * (u - 128)      (u = q + 128,  m_w = -128 d)
//    so a block contributes d_w * d_x * sum(u * q_x) + m_w * s_x (the offset term sees the same
//    quantized x as the integer sum, which makes the Q4_0 / Q8_0 offsets cancel exactly);
//  - the micro-kernel keeps 4 rows x 32 columns of int32 block sums and float accumulators in
//    registers: per block, 8 x 8 vpdpbusd with the activations broadcast from memory, then one
//    conversion and two FMAs per accumulator.
// The block sums are exact integers; the result differs from x @ dequantize(W).T by the activation
// rounding (each x moves by at most d_x / 2) and float32 summation over the blocks.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_rowtiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define RADIXSERVE_HAVE_QVNNI 1
#endif

namespace radixserve_qvnni {

// Weight lines are prefetched 4 KB ahead of the loads that stream them, with a hint by CPU vendor:
// non-temporal on AMD (a 2-core Zen 4's batch-1 decode was fastest so), into L1 elsewhere (a 2-core
// Xeon with AMX ran the default model's batch-1 decode at 88 tok/s with NTA, 142 with no prefetch
// and 190 with T0). RADIXSERVE_WEIGHT_PREFETCH=nta / t0 / none overrides it (A/B measurements).
enum class Prefetch { kNta, kT0, kNone };
inline Prefetch weight_prefetch() {
  static const Prefetch mode = [] {
    const char* e = std::getenv("RADIXSERVE_WEIGHT_PREFETCH");
    const std::string v = e ? e : "";
    if (v == "nta") return Prefetch::kNta;
    if (v == "t0") return Prefetch::kT0;
    if (v == "none") return Prefetch::kNone;
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? Prefetch::kNta : Prefetch::kT0;
  }();
  return mode;
}

// The row tiles' hint (tile_rows, tile_rows_q8): none on AMD, where a 2-core Zen 4's batch-1 step of the
// default model ran 1.7 % faster without the layers' NTA hint and 2.7 % faster without the Q8_0 head's
// (paired runs on one CCD and on two; T0 no better than none; the 8B-shaped Q4_0 file unchanged),
// weight_prefetch() elsewhere; RADIXSERVE_WEIGHT_PREFETCH overrides it too.
inline Prefetch tile_prefetch() {
  static const Prefetch mode = [] {
    const char* e = std::getenv("RADIXSERVE_WEIGHT_PREFETCH");
    if (e != nullptr && e[0] != '\0') return weight_prefetch();
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? Prefetch::kNone : weight_prefetch();
  }();
  return mode;
}

// Every line of [p + 4096, p + 4096 + bytes) with the hint `mode`: weight_prefetch(), which callers read
// before their loops (its initialization guard inside a block loop, a possible call, made GCC keep the
// loop's accumulators on the stack: a Q4_1 row tile in L2 ran at 48 GB/s a thread, not 57, on a Zen 4).
inline void prefetch_ahead(const void* base, int64_t bytes, Prefetch mode) {
  const char* p = static_cast<const char*>(base) + 4096;
  switch (mode) {
    case Prefetch::kNta:
      for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_NTA);
      break;
    case Prefetch::kT0:
      for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
      break;
    case Prefetch::kNone: break;
  }
}

constexpr int64_t kPanel = 32;        // weight rows per panel (two zmm of 16 int32 lanes)
constexpr int64_t kBlockBytes = 1024;  // one block of a panel: 32 inputs x 32 rows as bytes
constexpr int kRows = 4;               // x rows per micro-kernel pass

// Quantized activations: q [m][k], per block d [m][nb] and s [m][nb].
struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k, nb;
};

inline float half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

#if defined(RADIXSERVE_HAVE_QVNNI)
// 16 values at p as floats.
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16f(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One block of 32 values: the scalar loop's arithmetic (the conversion rounds to nearest even, as
// nearbyint does), in registers.
template <typename T>
inline void quantize_block(const T* xb, int8_t* qb, float* d, float* s) {
  const __m512 a = load16f(xb), b = load16f(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb16 = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(qb16));
  *d = amax / 127.f;
  *s = *d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb16)));
}
#endif

// Rows of x (float or bf16) [m, k] to per-block int8 (k a multiple of 32).
template <typename T>
void quantize(const T* x, int64_t m, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t nb = k / 32;
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    float v[32];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const T* xb = x + r * k + b * 32;
#if defined(RADIXSERVE_HAVE_QVNNI)
        if constexpr (!std::is_same<T, double>::value) {
          quantize_block(xb, q + r * k + b * 32, d + r * nb + b, s + r * nb + b);
          continue;
        }
#endif
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < 32; ++i) {
          v[i] = static_cast<float>(xb[i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float db = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* qb = q + r * k + b * 32;
        int sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < 32; ++i) {
          const int u = static_cast<int>(std::nearbyint(v[i] * inv));
          qb[i] = static_cast<int8_t>(u);
          sum += u;
        }
        d[r * nb + b] = db;
        s[r * nb + b] = db * static_cast<float>(sum);
      }
    }
  });
}

#if defined(RADIXSERVE_HAVE_QVNNI)
// pack_panel for 16 whole rows (panel rows j0 .. j0 + 15): per block, each 4-byte group of the 16
// rows is one gather.
inline void pack_16_rows(const uint8_t* rows0, int64_t row_bytes, int64_t qtype, int64_t nb, int64_t j0,
                         uint8_t* panel, float* dw, float* mw) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  const int64_t bs = qtype == 8 ? 34 : qtype == 3 ? 20 : 18;
  const int64_t qoff = qtype == 3 ? 4 : 2;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = rows0 + b * bs;
    uint8_t* dst = panel + b * kBlockBytes + j0 * 4;  // quad t at dst + t * 128
    const __m512i head = _mm512_i32gather_epi32(idx, blk, 1);  // fp16 d (and Q4_1's fp16 m)
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    _mm512_storeu_ps(dw + b * kPanel + j0, d);
    if (qtype == 8) {
      _mm512_storeu_ps(mw + b * kPanel + j0, _mm512_mul_ps(d, _mm512_set1_ps(-128.f)));
      const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
      for (int t = 0; t < 8; ++t) {
        const __m512i g = _mm512_i32gather_epi32(idx, blk + qoff + 4 * t, 1);
        _mm512_storeu_si512(dst + t * 128, _mm512_xor_si512(g, flip));
      }
    } else {
      const __m512 m = qtype == 3 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
      _mm512_storeu_ps(mw + b * kPanel + j0, m);
      for (int t = 0; t < 4; ++t) {
        const __m512i g = _mm512_i32gather_epi32(idx, blk + qoff + 4 * t, 1);
        _mm512_storeu_si512(dst + t * 128, _mm512_and_si512(g, nib));
        _mm512_storeu_si512(dst + (t + 4) * 128, _mm512_and_si512(_mm512_srli_epi32(g, 4), nib));
      }
    }
  }
}
#endif

#if defined(RADIXSERVE_HAVE_QVNNI)
// pack_panel for 32 rows that are two whole row tiles (cpu_rowtiles.h) at t0 and t0 + 16 rows: quad t
// of a tile block is already 16 rows' quad t; its nibbles go to the panel's quads t and t + 4.
inline void pack_tiles(const uint8_t* t0, int64_t row_bytes, bool has_min, int64_t nb, uint8_t* panel, float* dw,
                       float* mw) {
  namespace rt = radixserve_rowtiles;
  const int64_t type = has_min ? 3 : 2, tb = rt::tile_block_bytes(type), qo = rt::quant_offset(type);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* blk = t0 + h * rt::kRows * row_bytes + b * tb;
      uint8_t* dst = panel + b * kBlockBytes + h * 64;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      _mm512_storeu_ps(dw + b * kPanel + 16 * h, d);
      _mm512_storeu_ps(mw + b * kPanel + 16 * h,
                       has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
                               : _mm512_mul_ps(d, _mm512_set1_ps(-8.f)));
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(blk + qo + 64 * t);
        _mm512_storeu_si512(dst + t * 128, _mm512_and_si512(v, nib));
        _mm512_storeu_si512(dst + (t + 4) * 128, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
      }
    }
  }
}
#endif

// Unpacks weight rows [n0, n0 + rows) (rows <= 32; the panel's other rows are zero) of type
// qtype (2 = Q4_0, 3 = Q4_1, 8 = Q8_0) into panel [nb][8][32][4] bytes, dw / mw [nb][32]. The first
// n16 rows of a Q4_0 / Q4_1 weight may be row tiles (cpu_rowtiles.h; 0: none).
inline void pack_panel(const uint8_t* wp, int64_t row_bytes, int64_t qtype, int64_t n0, int64_t rows, int64_t nb,
                       uint8_t* panel, float* dw, float* mw, int64_t n16 = 0) {
#if defined(RADIXSERVE_HAVE_QVNNI)
  if (rows == kPanel && n0 + kPanel <= n16 && n0 % radixserve_rowtiles::kRows == 0) {
    pack_tiles(wp + n0 * row_bytes, row_bytes, qtype == 3, nb, panel, dw, mw);
    return;
  }
  if (rows == kPanel && n0 >= n16 && row_bytes * 16 < (int64_t{1} << 31)) {
    pack_16_rows(wp + n0 * row_bytes, row_bytes, qtype, nb, 0, panel, dw, mw);
    pack_16_rows(wp + (n0 + 16) * row_bytes, row_bytes, qtype, nb, 16, panel, dw, mw);
    return;
  }
#endif
  if (rows < kPanel) {
    std::memset(panel, 0, nb * kBlockBytes);
    std::fill(dw, dw + nb * kPanel, 0.f);
    std::fill(mw, mw + nb * kPanel, 0.f);
  }
  thread_local std::vector<uint8_t> tmp;
  if (n0 < n16) tmp.resize(row_bytes);
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = radixserve_rowtiles::file_row(wp, row_bytes, n16, qtype, n0 + j, tmp.data());
    for (int64_t b = 0; b < nb; ++b) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(panel + b * kBlockBytes) + j;  // quad t at dst[t * 32]
      if (qtype == 8) {  // Q8_0: fp16 d, 32 int8
        const uint8_t* blk = row + b * 34;
        const float d = half_bits(blk);
        uint32_t w[8];
        std::memcpy(w, blk + 2, 32);
        for (int t = 0; t < 8; ++t) dst[t * 32] = w[t] ^ 0x80808080u;
        dw[b * kPanel + j] = d;
        mw[b * kPanel + j] = -128.f * d;
      } else {
        const bool q41 = qtype == 3;
        const uint8_t* blk = row + b * (q41 ? 20 : 18);
        const float d = half_bits(blk);
        uint32_t w[4];
        std::memcpy(w, blk + (q41 ? 4 : 2), 16);
        for (int t = 0; t < 4; ++t) {
          dst[t * 32] = w[t] & 0x0F0F0F0Fu;              // inputs 4t .. 4t + 3: low nibbles
          dst[(t + 4) * 32] = (w[t] >> 4) & 0x0F0F0F0Fu;  // inputs 16 + 4t ..: high nibbles
        }
        dw[b * kPanel + j] = d;
        mw[b * kPanel + j] = q41 ? half_bits(blk + 2) : -8.f * d;
      }
    }
  }
}

#if defined(RADIXSERVE_HAVE_QVNNI)
template <typename out_t>
inline void store16(out_t* dst, __m512 v, int valid) {
  if constexpr (std::is_same<out_t, float>::value) {
    if (valid >= 16)
      _mm512_storeu_ps(dst, v);
    else
      _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << valid) - 1), v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int i = 0; i < std::min(valid, 16); ++i) dst[i] = static_cast<out_t>(tmp[i]);
  }
}

#if defined(__AVX512BF16__)
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* dst, __m512 v, int valid) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));  // round to nearest even
  if (valid >= 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  else
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << valid) - 1), h);
}
#endif

// out[r, 0:valid] for x rows r0 .. r0 + R - 1 against one packed panel.
template <int R, typename out_t>
void panel_rows(const uint8_t* panel, const float* dw, const float* mw, const Acts& a, int64_t r0, out_t* out,
                int64_t ldo, int valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int8_t* xq = a.q + r0 * a.k;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i is[R][2];
    for (int r = 0; r < R; ++r) is[r][0] = is[r][1] = _mm512_setzero_si512();
    const uint8_t* pb = panel + b * kBlockBytes;
    const int8_t* xb = xq + b * 32;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i w0 = _mm512_loadu_si512(pb + t * 128);
      const __m512i w1 = _mm512_loadu_si512(pb + t * 128 + 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xb + r * a.k + t * 4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        is[r][0] = _mm512_dpbusd_epi32(is[r][0], w0, xv);
        is[r][1] = _mm512_dpbusd_epi32(is[r][1], w1, xv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(dw + b * kPanel), d1 = _mm512_loadu_ps(dw + b * kPanel + 16);
    const __m512 m0 = _mm512_loadu_ps(mw + b * kPanel), m1 = _mm512_loadu_ps(mw + b * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(a.d[(r0 + r) * a.nb + b]);
      const __m512 sx = _mm512_set1_ps(a.s[(r0 + r) * a.nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][0]), _mm512_mul_ps(d0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][1]), _mm512_mul_ps(d1, dx), acc[r][1]);
      acc[r][0] = _mm512_fmadd_ps(m0, sx, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(m1, sx, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(out + (r0 + r) * ldo, acc[r][0], valid);
    if (valid > 16) store16(out + (r0 + r) * ldo + 16, acc[r][1], valid - 16);
  }
}

// out[:, 0:n] (row stride ldo) = x @ W.T for the quantized activations a (m rows) and the n weight
// rows at wp (the first n16 of them row tiles). Threads take whole panels; each packs its panel once and
// runs all m rows over it.
template <typename out_t>
void gemm(const Acts& a, int64_t m, const uint8_t* wp, int64_t n, int64_t row_bytes, int64_t qtype, out_t* out,
          int64_t ldo, int64_t n16 = 0) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> pbuf;
    thread_local std::vector<float> sbuf;
    if (static_cast<int64_t>(pbuf.size()) < a.nb * kBlockBytes) pbuf.resize(a.nb * kBlockBytes);
    if (static_cast<int64_t>(sbuf.size()) < 2 * a.nb * kPanel) sbuf.resize(2 * a.nb * kPanel);
    uint8_t* panel = pbuf.data();
    float* dw = sbuf.data();
    float* mw = dw + a.nb * kPanel;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, rows = std::min(kPanel, n - n0);
      pack_panel(wp, row_bytes, qtype, n0, rows, a.nb, panel, dw, mw, n16);
      const int valid = static_cast<int>(rows);
      int64_t r = 0;
      for (; r + kRows <= m; r += kRows) panel_rows<kRows>(panel, dw, mw, a, r, out + n0, ldo, valid);
      switch (m - r) {
        case 5: panel_rows<5>(panel, dw, mw, a, r, out + n0, ldo, valid); break;
        case 4: panel_rows<4>(panel, dw, mw, a, r, out + n0, ldo, valid); break;
        case 3: panel_rows<3>(panel, dw, mw, a, r, out + n0, ldo, valid); break;
        case 2: panel_rows<2>(panel, dw, mw, a, r, out + n0, ldo, valid); break;
        case 1: panel_rows<1>(panel, dw, mw, a, r, out + n0, ldo, valid); break;
        default: break;
      }
    }
  });
}

// ---- decode sizes over row tiles (cpu_rowtiles.h) ----
//
// Per tile block (16 rows x 32 inputs): four 64-byte loads of quants, a mask each for the low nibbles
// and one for the high ones (kept as 16 * u: the vpdpbusd sums of the high nibbles are then 16 times
// the true ones, exactly, and an arithmetic shift takes the factor out), eight vpdpbusd with the
// activations' 4-byte groups broadcast, and the two float terms in lane = row order: about 30
// instructions per 512 weights where the file layout's GEMV above takes about 70, and no reduction
// across lanes at the end of a row. Two-core Zen 4, 2 threads: 100 GB/s of Q4_1 from the caches
// (the file layout's: 28-37), so a decode step's products are bound by memory.
// The activations are the per-block int8 ones (Acts: q, d, s = d * sum(q)), rows of x read as they are.

// Row tile at `tile` (nb blocks) times R rows of x from r0: res[r][i] for the tile's row i.
template <bool HAS_MIN, int R>
inline void tile_rows(const uint8_t* tile, int64_t nb, const Acts& a, int64_t r0, __m512* res) {
  constexpr int64_t tb = HAS_MIN ? 320 : 288, qo = HAS_MIN ? 64 : 32;
  static_assert(tb == 16 * (HAS_MIN ? 20 : 18), "tile block bytes");
  __m512 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8(static_cast<char>(0xF0));
  const Prefetch pf = tile_prefetch();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * tb;
    // every line of the block 4 KB ahead where tile_prefetch() gives a hint (one line a block, the rest
    // left to the hardware prefetcher, was slower)
    prefetch_ahead(p, tb, pf);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 mw = HAS_MIN ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))) : d;
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(p + qo + 64 * t);
      lo[t] = _mm512_and_si512(v, lo_mask);
      hi[t] = _mm512_and_si512(v, hi_mask);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.q + (r0 + r) * a.k + b * 32;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        int32_t ql, qh;
        std::memcpy(&ql, x + 4 * t, 4);
        std::memcpy(&qh, x + 16 + 4 * t, 4);
        s0 = _mm512_dpbusd_epi32(s0, lo[t], _mm512_set1_epi32(ql));
        s1 = _mm512_dpbusd_epi32(s1, hi[t], _mm512_set1_epi32(qh));
      }
      const __m512i s = _mm512_add_epi32(s0, _mm512_srai_epi32(s1, 4));
      const float dx = a.d[(r0 + r) * a.nb + b], sx = a.s[(r0 + r) * a.nb + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
      // m_w * s_x: Q4_1's m; Q4_0's -8 d as d * (-8 s_x) (the same product: a power of two)
      accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(HAS_MIN ? sx : -8.f * sx), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = _mm512_add_ps(acc[r], accm[r]);
}

// The same products for one untiled row (the < 16 rows after a weight's last tile), lane by lane.
inline float file_row_dot(const uint8_t* row, int64_t nb, bool has_min, const Acts& a, int64_t r) {
  const int64_t bs = has_min ? 20 : 18, qo = has_min ? 4 : 2;
  float acc = 0.f, accm = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bs;
    const int8_t* x = a.q + r * a.k + b * 32;
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += (blk[qo + i] & 0x0F) * x[i] + (blk[qo + i] >> 4) * x[16 + i];
    const float d = half_bits(blk), dx = a.d[r * a.nb + b], sx = a.s[r * a.nb + b];
    acc = std::fma(static_cast<float>(sum), d * dx, acc);
    accm = has_min ? std::fma(half_bits(blk + 2), sx, accm) : std::fma(d, -8.f * sx, accm);
  }
  return acc + accm;
}

// Weight rows [j0, j1) times m rows of x into out[r * ldo + j]: whole tiles where [j0, j1) covers
// them, else the tile's 16 results of which the range keeps some; rows from n16 on one by one.
template <typename out_t>
void tile_range(const uint8_t* wp, int64_t row_bytes, int64_t n16, bool has_min, int64_t j0, int64_t j1,
                const Acts& a, int64_t m, out_t* out, int64_t ldo) {
  constexpr int64_t kT = radixserve_rowtiles::kRows;
  const int64_t nb = a.nb;
  for (int64_t t0 = j0 / kT * kT; t0 < std::min(j1, n16); t0 += kT) {
    const uint8_t* tile = wp + t0 * row_bytes;
    const int64_t lo = std::max(j0, t0) - t0, hi = std::min(j1, t0 + kT) - t0;
    for (int64_t r = 0; r < m; r += 4) {
      __m512 res[4];
      const int rows = static_cast<int>(std::min<int64_t>(4, m - r));
      if (has_min) {
        switch (rows) {
          case 1: tile_rows<true, 1>(tile, nb, a, r, res); break;
          case 2: tile_rows<true, 2>(tile, nb, a, r, res); break;
          case 3: tile_rows<true, 3>(tile, nb, a, r, res); break;
          default: tile_rows<true, 4>(tile, nb, a, r, res); break;
        }
      } else {
        switch (rows) {
          case 1: tile_rows<false, 1>(tile, nb, a, r, res); break;
          case 2: tile_rows<false, 2>(tile, nb, a, r, res); break;
          case 3: tile_rows<false, 3>(tile, nb, a, r, res); break;
          default: tile_rows<false, 4>(tile, nb, a, r, res); break;
        }
      }
      for (int i = 0; i < rows; ++i) {
        out_t* dst = out + (r + i) * ldo + t0;
        if (lo == 0 && hi == kT) {
          store16(dst, res[i], 16);
        } else {
          alignas(64) float v[16];
          _mm512_store_ps(v, res[i]);
          for (int64_t l = lo; l < hi; ++l) dst[l] = static_cast<out_t>(v[l]);
        }
      }
    }
  }
  for (int64_t j = std::max(j0, n16); j < j1; ++j)
    for (int64_t r = 0; r < m; ++r)
      out[r * ldo + j] = static_cast<out_t>(file_row_dot(wp + j * row_bytes, nb, has_min, a, r));
}

// out[:, 0:n] (row stride ldo) = x @ W.T for m <= 24 rows of int8 activations and a Q4_0 / Q4_1 weight
// whose first n16 rows are tiles: threads take contiguous ranges of tiles (one memory stream each).
template <typename out_t>
void gemv_tiles(const Acts& a, int64_t m, const uint8_t* wp, int64_t n, int64_t row_bytes, int64_t n16, bool has_min,
                out_t* out, int64_t ldo) {
  constexpr int64_t kT = radixserve_rowtiles::kRows;
  const int64_t tiles = (n + kT - 1) / kT;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 2048 / a.k), [&](int64_t begin, int64_t end) {
    tile_range(wp, row_bytes, n16, has_min, begin * kT, std::min(n, end * kT), a, m, out, ldo);
  });
}

// ---- a Q8_0 LM head over row tiles: float activations kept to float32 precision ----
//
// The LM head's logits see activation rounding undamped, so float32 x stays float: each block of 32 is
// split into two int16 parts, x = d_x * (h + l / 32768) with d_x = max |x| / 32767, h = round(x / d_x)
// and l the rounded rest (|l| <= 16384), which leaves at most max |x| * 2^-31 of a block, below float32's
// own rounding of the sum. Per tile block, 16 vpmovsxbw (a pair of inputs of 16 rows as int16) and 32
// vpdpwssd (the pairs of h and of l broadcast), the exact int32 sums taken to float as
// (S_h + S_l * 2^-15) * d_w * d_x.

// Rows of float x [m][k] split per block: h, l [m][k] int16, d [m][k / 32].
// `low` false: l is not read (x = d_x * h, within max |x| * 2^-16 of a block: bf16 / fp16 activations,
// whose own rounding at the block's largest value is coarser, 2^-9 / 2^-12 of it), which halves the
// products (a batch-1 step of the default model on a 2-core Xeon with AMX: LM head ~30 % faster).
struct SplitActs {
  const int16_t* h;
  const int16_t* l;
  const float* d;
  int64_t k, nb;
  bool low = true;
};

inline void split_rows(const float* x, int64_t m, int64_t k, int16_t* h, int16_t* l, float* d) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + b * 32;
      const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float dx = amax / 32767.f;
      d[r * nb + b] = dx;
      const bool some = amax >= 1e-30f;  // (a block below that adds nothing a float32 sum would keep)
      const __m512 inv = _mm512_set1_ps(some ? 32767.f / amax : 0.f);
      const __m512 inv_l = _mm512_set1_ps(some ? 32768.f / dx : 0.f);
      const __m512 ndx = _mm512_set1_ps(-dx);
      for (int half = 0; half < 2; ++half) {
        const __m512 v = half == 0 ? a : c;
        const __m512 hf = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 rest = _mm512_fmadd_ps(hf, ndx, v);  // x - h d_x, rounded once
        const __m512i hi = _mm512_cvtps_epi32(hf), lo = _mm512_cvtps_epi32(_mm512_mul_ps(rest, inv_l));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + r * k + b * 32 + 16 * half), _mm512_cvtsepi32_epi16(hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + r * k + b * 32 + 16 * half), _mm512_cvtsepi32_epi16(lo));
      }
    }
}

// A Q8_0 row tile at `tile` (nb blocks) times R rows of x from r0: res[r] lane i for the tile's row i.
template <int R, bool LOW, bool PF>
inline void tile_rows_q8(const uint8_t* tile, int64_t nb, const SplitActs& a, int64_t r0, __m512* res) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 lo_scale = _mm512_set1_ps(1.f / 32768.f);
  const Prefetch pf = tile_prefetch();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = tile + b * 544;
    if constexpr (PF) prefetch_ahead(p, 544, pf);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512i sh[R][2], sl[R][2];
    for (int r = 0; r < R; ++r) sh[r][0] = sh[r][1] = sl[r][0] = sl[r][1] = _mm512_setzero_si512();
    for (int t = 0; t < 16; ++t) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + 32 * t)));
      for (int r = 0; r < R; ++r) {
        int32_t ph, pl;
        std::memcpy(&ph, a.h + (r0 + r) * a.k + b * 32 + 2 * t, 4);
        sh[r][t & 1] = _mm512_dpwssd_epi32(sh[r][t & 1], w, _mm512_set1_epi32(ph));
        if constexpr (LOW) {
          std::memcpy(&pl, a.l + (r0 + r) * a.k + b * 32 + 2 * t, 4);
          sl[r][t & 1] = _mm512_dpwssd_epi32(sl[r][t & 1], w, _mm512_set1_epi32(pl));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 h = _mm512_cvtepi32_ps(_mm512_add_epi32(sh[r][0], sh[r][1]));
      __m512 v = h;
      if constexpr (LOW) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sl[r][0], sl[r][1])), lo_scale, h);
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[(r0 + r) * a.nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
}

// The same for one untiled Q8_0 row.
inline float file_row_dot_q8(const uint8_t* row, int64_t nb, const SplitActs& a, int64_t r) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    int32_t sh = 0, sl = 0;
    for (int i = 0; i < 32; ++i) {
      sh += q[i] * a.h[r * a.k + b * 32 + i];
      if (a.low) sl += q[i] * a.l[r * a.k + b * 32 + i];
    }
    const float v = std::fma(static_cast<float>(sl), 1.f / 32768.f, static_cast<float>(sh));
    acc = std::fma(v, half_bits(blk) * a.d[r * a.nb + b], acc);
  }
  return acc;
}

// Whether a Q8_0 head of `bytes` in row tiles takes tile_prefetch()'s hint: never where it is none, always
// where it is NTA (an override), and T0 only up to half the L3: a larger head comes from memory every
// step, and the hardware prefetcher alone reads it faster (a Qwen3-sized 330 MB head on the 2-core
// Xeon: 15.2 -> 12.0 ms, 22 -> 27.5 GB/s of ~30; the default model's 30 MB head, which its caches
// hold, was 10-20 % slower without).
inline bool head_prefetch(int64_t bytes) {
  if (tile_prefetch() == Prefetch::kNone) return false;
  if (tile_prefetch() == Prefetch::kNta) return true;
  static const int64_t l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 <= 0 || bytes <= l3 / 2;
}

template <bool LOW, bool PF, typename out_t>
inline void tiles_q8_rows(const SplitActs& a, int64_t m, const uint8_t* wp, int64_t row_bytes, int64_t t0, int64_t t1,
                          out_t* out, int64_t ldo) {
  constexpr int64_t kT = radixserve_rowtiles::kRows;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = wp + t * kT * row_bytes;
    for (int64_t r = 0; r < m; r += 4) {
      __m512 res[4];
      const int rows = static_cast<int>(std::min<int64_t>(4, m - r));
      switch (rows) {
        case 1: tile_rows_q8<1, LOW, PF>(tile, a.nb, a, r, res); break;
        case 2: tile_rows_q8<2, LOW, PF>(tile, a.nb, a, r, res); break;
        case 3: tile_rows_q8<3, LOW, PF>(tile, a.nb, a, r, res); break;
        default: tile_rows_q8<4, LOW, PF>(tile, a.nb, a, r, res); break;
      }
      for (int i = 0; i < rows; ++i) store16(out + (r + i) * ldo + t * kT, res[i], 16);
    }
  }
}

// Tiles [t0, t1) of a Q8_0 weight in row tiles times m rows of split activations: out[r * ldo + 16 t + i]
// for the tile's row i (gemv_tiles_q8's threads' ranges; the decode stack's LM head units), with
// prefetch_ahead's hint or without it (head_prefetch).
template <typename out_t>
inline void tiles_q8(const SplitActs& a, int64_t m, const uint8_t* wp, int64_t row_bytes, int64_t t0, int64_t t1,
                     out_t* out, int64_t ldo, bool prefetch) {
  if (a.low)
    (prefetch ? tiles_q8_rows<true, true, out_t> : tiles_q8_rows<true, false, out_t>)(a, m, wp, row_bytes, t0, t1, out,
                                                                                      ldo);
  else
    (prefetch ? tiles_q8_rows<false, true, out_t> : tiles_q8_rows<false, false, out_t>)(a, m, wp, row_bytes, t0, t1,
                                                                                        out, ldo);
}

// out[:, 0:n] (row stride ldo) = x @ W.T for m <= 24 rows of split activations and a Q8_0 weight whose
// first n16 rows are tiles.
template <typename out_t>
void gemv_tiles_q8(const SplitActs& a, int64_t m, const uint8_t* wp, int64_t n, int64_t row_bytes, int64_t n16,
                   out_t* out, int64_t ldo) {
  const int64_t tiles = n16 / radixserve_rowtiles::kRows;
  const bool prefetch = head_prefetch(n * row_bytes);
  at::parallel_for(0, tiles, std::max<int64_t>(1, 2048 / a.k), [&](int64_t begin, int64_t end) {
    tiles_q8(a, m, wp, row_bytes, begin, end, out, ldo, prefetch);
  });
  for (int64_t j = n16; j < n; ++j)
    for (int64_t r = 0; r < m; ++r)
      out[r * ldo + j] = static_cast<out_t>(file_row_dot_q8(wp + j * row_bytes, a.nb, a, r));
}

// ---- decode sizes (a few rows of x): one pass over each weight row, no packing ----
//
// At M <= 24 a panel would be packed for a handful of rows; instead each weight row is read once
// and multiplied with every row of x as it streams by. Four blocks (128 weights) at a time: two
// 64-byte loads cover the group (Q4_0: 72 bytes, Q4_1: 80), one vpermt2b gathers its 64 quant bytes
// as [A | B | C | D] (16 each), a shift and two masks split them into the low nibbles (each block's
// weights 0..15) and the high ones (16..31), and two vpdpbusd multiply them with x's bytes laid out
// to match; lane l of the int32 sums then belongs to block l / 4. The blocks' fp16 scales are in the
// first load: one vpermw spreads them over those lanes. About 20 instructions per 128 weights,
// against about 45 for the bf16 products (cpu_bf16x2.h), so the 4-bit GEMV of a 2-core Zen 4 is
// bounded by memory rather than by instructions.
//
// Per block the same terms as the tiles': the exact int32 sum(u * q_x) times d_w * d_x, plus the
// offset term m_w * s_x (Q4_0: m_w = -8 d_w; Q4_1: m), in float; the blocks are summed per lane and
// the 16 lanes at the end, so a row's result differs from the tiles' by float32 rounding only, and
// does not depend on the number of threads or on the other rows of x.
//
// Two-core Zen 4, weights streamed from memory, 2 threads (`torch.sum` reads 28-31 GB/s, a plain
// AVX-512 read loop 38): Q4_0 at K = 4096 and 14336 and Q4_1 at K = 576 and 1536 run at 37-44 GB/s,
// against 26-32 for the bf16 products; an 8B model's down projection (K = 14336) 41 against 27.
#if defined(__AVX512VBMI__)
#define RADIXSERVE_HAVE_QVNNI_GEMV 1

constexpr int kGemvRows = 4;  // rows of x per pass over a weight row

// Activations in the group layout, per row of x and group of 4 blocks: 128 bytes of q_x ([A 0..15 |
// B 0..15 | C 0..15 | D 0..15] then the same for inputs 16..31) and 8 floats: the 4 blocks' d_x,
// then their s_x / 4 (each block's weights' offset term m_w * s_x is added over its 4 lanes).
// 1.25 bytes an input: a long row's activations (K = 14336, 8B models' down projection) mostly stay
// in L1 beside the weights streaming through it (with the offsets as 16 int32 and d_x per lane, 2
// bytes an input, that row ran at half the bandwidth).
// `spread` (optional, for rows short enough that it stays in L1 too): the same scales as they meet
// the weights' lanes, per row and group 16 floats d_x (lane l: block l / 4) then 16 of s_x / 4, which
// saves the kernel two permutes a group (K = 1536 rows from L3 on a 2-core Zen 4: 35.6 -> 37.8 GB/s).
struct GroupActs {
  const int8_t* q;   // [m][groups][128]
  const float* ds;   // [m][groups][8]
  int64_t groups;
  const float* spread = nullptr;  // [m][groups][32] or null
};

// Longest rows whose activations get `spread` (with it a K = 4096 row's activations take 9 KB).
constexpr int64_t kSpreadMaxK = 4096;

inline void spread_row(const float* ds, int64_t groups, float* spread) {
  for (int64_t g = 0; g < groups; ++g)
    for (int l = 0; l < 16; ++l) {
      spread[g * 32 + l] = ds[g * 8 + l / 4];
      spread[g * 32 + 16 + l] = ds[g * 8 + 4 + l / 4];
    }
}

inline int64_t groups_for(int64_t k) { return (k / 32 + 3) / 4; }

// Row r of the quantized activations a (q, d, s) into the group layout (missing blocks of the last
// group are zeros).
inline void group_row(const Acts& a, int64_t r, int8_t* q, float* ds) {
  const int64_t nb = a.nb, groups = groups_for(a.k);
  const int8_t* xq = a.q + r * a.k;
  for (int64_t g = 0; g < groups; ++g) {
    int8_t* qg = q + g * 128;
    for (int j = 0; j < 4; ++j) {
      const int64_t b = 4 * g + j;
      if (b < nb) {
        std::memcpy(qg + 16 * j, xq + 32 * b, 16);
        std::memcpy(qg + 64 + 16 * j, xq + 32 * b + 16, 16);
      } else {
        std::memset(qg + 16 * j, 0, 16);
        std::memset(qg + 64 + 16 * j, 0, 16);
      }
      ds[g * 8 + j] = b < nb ? a.d[r * nb + b] : 0.f;
      ds[g * 8 + 4 + j] = b < nb ? a.s[r * nb + b] * 0.25f : 0.f;  // four lanes per block: exact
    }
  }
}

// The byte and word indices of one group: the 64 quant bytes from the two loads (at 0 and at
// kSecond), the blocks' d (and Q4_1's m) words from the first.
template <bool HAS_MIN>
struct GroupIndex {
  static constexpr int64_t kBytes = HAS_MIN ? 20 : 18, kQoff = HAS_MIN ? 4 : 2, kSecond = 4 * kBytes - 64;
  __m512i qidx, didx, midx;
  GroupIndex() {
    alignas(64) uint8_t qi[64];
    alignas(64) uint16_t di[32], mi[32];
    for (int t = 0; t < 64; ++t) {
      const int64_t off = (t / 16) * kBytes + kQoff + t % 16;
      qi[t] = static_cast<uint8_t>(off < 64 ? off : 64 + off - kSecond);
    }
    for (int l = 0; l < 32; ++l) {
      di[l] = static_cast<uint16_t>(((l % 16) / 4) * kBytes / 2);
      mi[l] = static_cast<uint16_t>(di[l] + 1);
    }
    qidx = _mm512_load_si512(qi);
    didx = _mm512_load_si512(di);
    midx = _mm512_load_si512(mi);
  }
};

// Weight rows [j0, j1) of Q4_0 / Q4_1 blocks (nb of them, row_bytes apart from wp) times the R rows of
// x at r0 (group layout): out[(r0 + r) * ldo + j]. Each row is one pass over its groups with R float
// accumulators (lane l: block l / 4 of each group, summed in group order), reduced at its end.
template <bool HAS_MIN, int R, bool SPREAD, typename out_t>
void gemv_range(const uint8_t* wp, int64_t row_bytes, int64_t j0, int64_t j1, int64_t nb, const GroupActs& x,
                int64_t r0, out_t* out, int64_t ldo) {
  using Ix = GroupIndex<HAS_MIN>;
  static const Ix ix;
  const __m512i qidx = ix.qidx, didx = ix.didx, midx = ix.midx;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i spread_s = _mm512_add_epi32(spread, _mm512_set1_epi32(4));
  const int64_t full = nb / 4, groups = x.groups;
  // the last group's bytes when it is partial: masked loads (never read past the row; missing blocks are zeros)
  const auto mask = [](int64_t n) { return n >= 64 ? ~__mmask64{0} : n <= 0 ? __mmask64{0} : (__mmask64{1} << n) - 1; };
  const int64_t tail = (nb - 4 * full) * Ix::kBytes;
  const Prefetch pf = weight_prefetch();
  const __mmask64 m0 = mask(tail), m1 = mask(tail - Ix::kSecond);
  const int8_t* xq = x.q + r0 * groups * 128;
  const float* xs = x.ds + r0 * groups * 8;
  const float* xp = SPREAD ? x.spread + r0 * groups * 32 : nullptr;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = wp + j * row_bytes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = row + g * 4 * Ix::kBytes;
      __m512i z0, z1;
      if (g < full) {
        // far ahead (non-temporal on AMD, where long rows' activations, up to 17.5 KB, then stay in
        // L1: K = 14336 at 35 GB/s on a 2-core Zen 4 against 25 without)
        prefetch_ahead(p, 64, pf);
        z0 = _mm512_loadu_si512(p);
        z1 = _mm512_loadu_si512(p + Ix::kSecond);
      } else {
        z0 = _mm512_maskz_loadu_epi8(m0, p);
        z1 = _mm512_maskz_loadu_epi8(m1, p + Ix::kSecond);
      }
      const __m512i q = _mm512_permutex2var_epi8(z0, qidx, z1);
      const __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
      const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(didx, z0)));
      // the offset term's m_w: Q4_1's m, Q4_0's -8 d
      const __m512 mw = HAS_MIN ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(midx, z0)))
                                : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
      for (int r = 0; r < R; ++r) {
        const int8_t* qg = xq + (r * groups + g) * 128;
        __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(qg));
        is = _mm512_dpbusd_epi32(is, hi, _mm512_loadu_si512(qg + 64));
        if constexpr (SPREAD) {
          const float* sp = xp + (r * groups + g) * 32;
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_loadu_ps(sp)), acc[r]);
          acc[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(sp + 16), acc[r]);
        } else {
          const __m512 ds = _mm512_castps256_ps512(_mm256_loadu_ps(xs + (r * groups + g) * 8));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_permutexvar_ps(spread, ds)), acc[r]);
          acc[r] = _mm512_fmadd_ps(mw, _mm512_permutexvar_ps(spread_s, ds), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[(r0 + r) * ldo + j] = static_cast<out_t>(_mm512_reduce_add_ps(acc[r]));
  }
}

template <bool HAS_MIN, typename out_t>
void gemv_range_rows(int rows, const uint8_t* wp, int64_t row_bytes, int64_t j0, int64_t j1, int64_t nb,
                     const GroupActs& x, int64_t r0, out_t* out, int64_t ldo) {
  if (x.spread != nullptr) {
    switch (rows) {
      case 1: return gemv_range<HAS_MIN, 1, true>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
      case 2: return gemv_range<HAS_MIN, 2, true>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
      case 3: return gemv_range<HAS_MIN, 3, true>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
      default: return gemv_range<HAS_MIN, 4, true>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
    }
  }
  switch (rows) {
    case 1: return gemv_range<HAS_MIN, 1, false>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
    case 2: return gemv_range<HAS_MIN, 2, false>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
    case 3: return gemv_range<HAS_MIN, 3, false>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
    default: return gemv_range<HAS_MIN, 4, false>(wp, row_bytes, j0, j1, nb, x, r0, out, ldo);
  }
}

// out[:, 0:n] (row stride ldo) = x @ W.T for m <= 24 rows of x in the group layout and the n
// Q4_0 / Q4_1 (qtype 2 / 3) weight rows at wp. Each thread streams one contiguous range of rows (chunks
// taken from a shared counter, which interleave the threads' ranges, ran a small model's decode step
// 20 % slower on a 2-core Zen 4: its memory streams restarted at every chunk). A row's sum is one
// thread's, whichever, so the result does not depend on the number of threads.
template <typename out_t>
void gemv(const GroupActs& x, int64_t m, int64_t k, const uint8_t* wp, int64_t n, int64_t row_bytes, int64_t qtype,
          out_t* out, int64_t ldo) {
  const int64_t nb = k / 32;
  const bool has_min = qtype == 3;
  const int64_t grain = std::max<int64_t>(4, 16384 / k / 4 * 4);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j0 = begin; j0 < end; j0 += 64) {  // 64 weight rows over each group of 4 rows of x
      const int64_t j1 = std::min(end, j0 + 64);
      for (int64_t r = 0; r < m; r += kGemvRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kGemvRows, m - r));
        if (has_min)
          gemv_range_rows<true>(rows, wp, row_bytes, j0, j1, nb, x, r, out, ldo);
        else
          gemv_range_rows<false>(rows, wp, row_bytes, j0, j1, nb, x, r, out, ldo);
      }
    }
  });
}
#endif  // __AVX512VBMI__
#endif  // RADIXSERVE_HAVE_QVNNI

}  // namespace radixserve_qvnni
