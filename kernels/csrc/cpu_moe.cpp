// Fused mixture-of-experts MLP for CPUs (kernels/reference.py: fused_moe).
//
// Layout: x [T, K] (float32, bfloat16 or float16, rows contiguous); w13 [E, 2N, K], expert e's gate
// rows 0..N-1 then its up rows N..2N-1; w2 [E, K, N]; both weights float32, bfloat16 or float16 (one
// dtype), contiguous. topk_weights [T, topk] float32 and topk_ids [T, topk] (int32 or int64) route
// token t to experts topk_ids[t, j] with weights topk_weights[t, j]; ids outside [0, E) belong to
// other ranks (expert parallelism) and are skipped. out [T, K] in x's dtype:
//   out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t),  e = topk_ids[t, j].
//
// Method, per chunk of tokens (bounding the buffers):
//  1. The (token, slot) pairs are grouped by expert with a counting sort (stable: by pair index
//     within an expert); pair p = t * topk + j lands at sorted row pos[p].
//  2. Gate/up: act = silu(x_rows @ gate_e.T) * (x_rows @ up_e.T), per expert.
//  3. Down: y [P, K] (float32, sorted rows) = act_rows @ w2[e].T.
//  4. out[t] = sum over t's valid slots j, in slot order, of topk_weights[t, j] * y[pos[t * topk + j]].
// Steps 2 and 3 run in one parallel region each, over tasks of (expert, block of output features)
// that the threads take from a shared counter, largest experts first (a thread that is descheduled,
// e.g. on a shared machine, holds up no other). Every element is written by exactly one task and
// the sum of step 4 runs in a fixed order, so the result is deterministic and (but for torch's
// GEMMs, below) independent of the thread count.
//
// Each expert is computed one of three ways, by its number of rows n:
//  - vec (decode: a GEMV bound by the weights' memory traffic): register-blocked dot products of
//    float32 activation rows, 1-8 at a time, against several weight rows at once (each loaded
//    vector of activations and of weights feeds several products; 16-bit weights are widened in
//    registers), in tasks of 32 output features, i.e. 32 (down; 64 for rows under 2 KiB) or
//    2 x 32 (gate/up) contiguous weight rows, each block of rows prefetching the next (a row of
//    2-4 KiB is about a page, where the hardware prefetchers stop). The sums of one output element
//    run over the same lanes in the same order whatever the blocking. (AVX512-BF16's vdpbf16ps ran
//    at a quarter of the FMA rate on the Sapphire Rapids machine this was tuned on: slower than
//    widening.)
//  - amx (bfloat16 x and weights, n >= 4, CPUs with AMX, K and N multiples of 32): AMX tiles of 16
//    weight rows (loaded straight from the weights) by 16 of the expert's rows (packed once), float32
//    sums, in tasks of 64 output features; many times the FMAs' throughput (batched decode, prefill).
//  - gemm (n >= 32 with float32 weights; n >= 16 in 16-bit without AMX): torch's GEMMs in x's dtype,
//    one single-threaded GEMM per task (inside the parallel region).
//
// Precision. In float32 (x or the weights float32, or their dtypes differ) everything after the
// inputs' conversion is float32. With x and the weights in one 16-bit dtype, vec experts compute as
// in float32 (x widened exactly), amx experts round the SiLU-times-up product to bfloat16 (the down
// projection's input) and gemm experts round the gate/up outputs, that product and the down outputs
// to 16 bits (as HF transformers does in bfloat16). The weighted sum of a token's slots is float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_lean.h"
#include "cpu_rowops.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__linux__)
#define RADIXSERVE_MOE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using radixserve_cpu::to_float;

// ---- vectors of kW floats: AVX-512 (16), AVX2 (8), or plain arrays the compiler vectorizes ----

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kW = 16;
constexpr int kMaxRows = 8;  // activation rows per dot block
// weight rows per block for R activation rows: R x C accumulators, C weight vectors and one activation
// vector in the 32 zmm registers; at most 8
constexpr int cols_for(int R) { return std::min(8, 31 / (R + 1)); }
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static Vec widen_bf16(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
  static Vec load(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load(const c10::BFloat16* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static Vec load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vec load(const c10::Half* p, int n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p))}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static float sum(Vec a) { return _mm512_reduce_add_ps(a.v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kW = 8;
constexpr int kMaxRows = 4;
constexpr int cols_for(int R) { return std::max(1, 8 / R); }  // R x C <= 8 accumulators (16 ymm)
struct Vec {
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  static Vec load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  template <typename T>
  static Vec load(const T* p, int n) {  // a tail: through a zero-padded copy
    T tmp[kW];
    std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
    std::memcpy(static_cast<void*>(tmp), p, n * sizeof(T));
    return load(static_cast<const T*>(tmp));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static float sum(Vec a) { return radixserve_cpu::hsum256(a.v); }
};
#else
constexpr int kW = 8;
constexpr int kMaxRows = 4;
constexpr int cols_for(int R) { return std::max(1, 8 / R); }
struct Vec {
  float v[kW];
  static Vec zero() { return Vec{}; }
  template <typename T>
  static Vec load(const T* p) {
    Vec r;
    for (int i = 0; i < kW; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  template <typename T>
  static Vec load(const T* p, int n) {
    Vec r{};
    for (int i = 0; i < n; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  static Vec fma(Vec a, Vec b, Vec c) {
    for (int i = 0; i < kW; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static float sum(Vec a) {  // a fixed tree, like the SIMD reductions
    for (int w = kW / 2; w > 0; w /= 2)
      for (int i = 0; i < w; ++i) a.v[i] += a.v[i + w];
    return a.v[0];
  }
};
#endif

template <typename T>
constexpr bool is16 = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// One step of kW weights of dot_block (inlined: the accumulators stay in registers).
template <int R, int C, typename W>
inline void dot_step(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t i, Vec (&acc)[R][C]) {
  Vec bv[C];
  for (int c = 0; c < C; ++c) bv[c] = Vec::load(b + c * ldb + i);
  for (int r = 0; r < R; ++r) {
    const Vec av = Vec::load(a + r * lda + i);
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::fma(av, bv[c], acc[r][c]);
  }
}

// out[r * C + c] = sum_i a[r][i] * b[c][i], i < k: R float rows a (at a + r * lda) against C rows of
// b (type W, at b + c * ldb), R x C vector accumulators, each loaded vector used R or C times.
// pf (if not null): C rows at pf + c * ldb (the next block of weight rows) to prefetch, a cache
// line of each as b's lines are reached.
template <int R, int C, typename W>
inline void dot_block(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t k, float* out, const W* pf) {
  constexpr int kLine = static_cast<int>(64 / sizeof(W));  // weights per cache line
  constexpr int kSub = kLine > kW ? kLine / kW : 1;        // vector steps per line
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  int64_t i = 0;
  if (pf) {
    for (; i + kSub * kW <= k; i += kSub * kW) {
      for (int c = 0; c < C; ++c) prefetch(pf + c * ldb + i);
      for (int u = 0; u < kSub; ++u) dot_step<R, C>(a, lda, b, ldb, i + u * kW, acc);
    }
  }
  for (; i + kW <= k; i += kW) dot_step<R, C>(a, lda, b, ldb, i, acc);
  if (i < k) {
    const int n = static_cast<int>(k - i);
    Vec bv[C];
    for (int c = 0; c < C; ++c) bv[c] = Vec::load(b + c * ldb + i, n);
    for (int r = 0; r < R; ++r) {
      const Vec av = Vec::load(a + r * lda + i, n);
      for (int c = 0; c < C; ++c) acc[r][c] = Vec::fma(av, bv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * C + c] = Vec::sum(acc[r][c]);
}

// out[r * ldo + c] = a[r] . b[c] for r < R (1..kMaxRows), c < ncols: blocks of cols_for(R) weight rows, then
// the remainder one at a time; each block prefetches the next, the last one `next` (if not null).
template <int R, typename W>
void dot_rows_r(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t ncols, int64_t k, float* out,
                int64_t ldo, const W* next) {
  constexpr int C = cols_for(R);
  float tmp[R * C];
  int64_t c0 = 0;
  for (; c0 + C <= ncols; c0 += C) {
    dot_block<R, C>(a, lda, b + c0 * ldb, ldb, k, tmp, c0 + C < ncols ? b + (c0 + C) * ldb : next);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * ldo + c0 + c] = tmp[r * C + c];
  }
  for (; c0 < ncols; ++c0) {
    dot_block<R, 1>(a, lda, b + c0 * ldb, ldb, k, tmp, c0 + 1 < ncols ? b + (c0 + 1) * ldb : next);
    for (int r = 0; r < R; ++r) out[r * ldo + c0] = tmp[r];
  }
}

template <typename W>
void dot_rows(int rows, const float* a, int64_t lda, const W* b, int64_t ldb, int64_t ncols, int64_t k, float* out,
              int64_t ldo, const W* next) {
  switch (rows) {
    case 1: return dot_rows_r<1>(a, lda, b, ldb, ncols, k, out, ldo, next);
    case 2: return dot_rows_r<2>(a, lda, b, ldb, ncols, k, out, ldo, next);
    case 3: return dot_rows_r<3>(a, lda, b, ldb, ncols, k, out, ldo, next);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    case 4: return dot_rows_r<4>(a, lda, b, ldb, ncols, k, out, ldo, next);
    case 5: return dot_rows_r<5>(a, lda, b, ldb, ncols, k, out, ldo, next);
    case 6: return dot_rows_r<6>(a, lda, b, ldb, ncols, k, out, ldo, next);
    case 7: return dot_rows_r<7>(a, lda, b, ldb, ncols, k, out, ldo, next);
    default: return dot_rows_r<8>(a, lda, b, ldb, ncols, k, out, ldo, next);
#else
    default: return dot_rows_r<4>(a, lda, b, ldb, ncols, k, out, ldo, next);
#endif
  }
}

// Calls fn(T{}) with T the element type of a float32, bfloat16 or float16 tensor.
template <typename Fn>
void dispatch_float16(at::ScalarType t, const char* what, Fn&& fn) {
  switch (t) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    case at::kHalf: return fn(c10::Half{});
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16; got ", t);
  }
}

// fn(i) for i < n on all threads, each taking the next i from a shared counter (what a task writes
// must not depend on the thread that runs it). Nested in a parallel region: runs serially.
template <typename Fn>
void parallel_tasks(int64_t n, const Fn& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

constexpr int64_t kFeatBlock = 32;     // output features per task (gate/up: N; down: K)
constexpr int64_t kGemmRows = 32;      // an expert with this many rows (float32) uses torch's GEMMs
constexpr int64_t kGemmRows16 = 16;    // the same in 16-bit (without AMX)
constexpr int64_t kAmxRows = 4;        // an expert with this many rows (bfloat16) uses AMX tiles
constexpr int64_t kAmxFeat = 64;       // output features per AMX task (a multiple of 32)
constexpr int64_t kBufferFloats = 16 << 20;  // y buffer budget per chunk of tokens (64 MiB)

inline float silu(float g) { return g / (1.f + radixserve_cpu::vexp(-g)); }

// dst[c] = silu(g[c]) * u[c] for c < n, computed in float32 and stored in dst's type (rounded to
// nearest even for 16 bits).
template <typename G, typename D>
inline void silu_mul(const G* g, const G* u, D* dst, int64_t n) {
  constexpr int64_t kB = 64;
  for (int64_t c0 = 0; c0 < n; c0 += kB) {
    const int64_t m = std::min(kB, n - c0);
    float tmp[kB];
    for (int64_t c = 0; c < m; ++c) tmp[c] = silu(to_float(g[c0 + c])) * to_float(u[c0 + c]);
    if constexpr (std::is_same_v<D, float>) {
      std::memcpy(dst + c0, tmp, m * sizeof(float));
    } else {
      int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      if constexpr (std::is_same_v<D, c10::Half>) {
        for (; c + 16 <= m; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c0 + c),
                              _mm512_cvtps_ph(_mm512_loadu_ps(tmp + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<D, c10::BFloat16>) {
        for (; c + 16 <= m; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c0 + c),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(tmp + c))));
      }
#endif
#endif
      for (; c < m; ++c) dst[c0 + c] = D(tmp[c]);
    }
  }
}

// ---- AMX (bfloat16 tiles), for bfloat16 activations and weights ----
//
// Tiles multiply weights (A: 16 weight rows x 32 bfloat16, loaded straight from the [rows, k]
// weights) by packed activations (B: for 16 tokens, 16 pairs of consecutive k, "VNNI" order) into
// C: 16 weight rows x 16 tokens, float32. An expert's activations are packed once, in blocks of 16
// tokens (the last one zero-padded): block tb, k-block kb (32 values of k) is the 1 KiB tile at
// (tb * nkb + kb) * 512 elements, pair k2 of token m at 32 * k2 + 2 * m.
#if defined(RADIXSERVE_MOE_AMX)
constexpr int64_t kTile = 512;   // bfloat16 per packed tile
constexpr int64_t kAmxPf = 2;    // k-blocks (64 bytes of each weight row) to prefetch ahead, into L2

// Linux enables AMX's tile data only for processes that ask (once, for all their threads).
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. Loaded per task (other code, e.g. oneDNN's, may configure the tiles
// of the same thread in between) and released after it.
inline void amx_begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// c[r * ldc + 16 * j + m] = a[r] . token m of packed block j, for weight rows r < 32 (two tiles:
// rows at a + r * lda), token blocks j < NJ (at b + j * bstride), over nkb k-blocks. Tiles 0-3: C,
// 4-5: A, 6-7: B.
template <int NJ>
inline void amx_rows32(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t bstride, int64_t nkb,
                       float* c, int64_t ldc, bool pf) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NJ == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const c10::BFloat16* a1 = a + 16 * lda;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    if (pf && kb + kAmxPf < nkb) {
      for (int r = 0; r < 32; ++r) __builtin_prefetch(a + r * lda + (kb + kAmxPf) * 32, 0, 2);
    }
    _tile_loadd(4, a + kb * 32, lda * 2);
    _tile_loadd(5, a1 + kb * 32, lda * 2);
    _tile_loadd(6, b + kb * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (NJ == 2) {
      _tile_loadd(7, b + bstride + kb * kTile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16 * ldc, ldc * 4);
  if constexpr (NJ == 2) {
    _tile_stored(2, c + 16, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
  }
}

// amx_rows32 over all ntb token blocks of one expert's packed activations b: c [32, 16 * ntb].
inline void amx_rows32_all(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ntb, int64_t nkb,
                           float* c, int64_t ldc) {
  for (int64_t j = 0; j < ntb; j += 2) {
    const c10::BFloat16* bj = b + j * nkb * kTile;
    if (j + 1 < ntb) {
      amx_rows32<2>(a, lda, bj, nkb * kTile, nkb, c + 16 * j, ldc, j == 0);
    } else {
      amx_rows32<1>(a, lda, bj, 0, nkb, c + 16 * j, ldc, j == 0);
    }
  }
}

// Token m's row of k values (k % 32 == 0) into its place in the packed blocks at p.
inline void amx_pack_row(const c10::BFloat16* row, int64_t k, int64_t m, c10::BFloat16* p) {
  const int64_t nkb = k / 32;
  c10::BFloat16* dst = p + (m / 16) * nkb * kTile + 2 * (m % 16);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    for (int k2 = 0; k2 < 16; ++k2) {
      dst[kb * kTile + 32 * k2] = row[32 * kb + 2 * k2];
      dst[kb * kTile + 32 * k2 + 1] = row[32 * kb + 2 * k2 + 1];
    }
  }
}
#endif

struct Routing {
  std::vector<int64_t> offset;  // [E + 1]: expert e's sorted rows are offset[e] .. offset[e + 1) - 1
  std::vector<int64_t> token;   // [P]: the token of each sorted row
  std::vector<int64_t> pos;     // [pairs]: the sorted row of each pair, -1 if skipped
};

// Counting sort of the pairs of tokens [t0, t1) by expert (stable).
Routing route(const int64_t* ids, int64_t t0, int64_t t1, int64_t topk, int64_t experts) {
  Routing r;
  const int64_t p0 = t0 * topk, pairs = (t1 - t0) * topk;
  r.offset.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p0 + p];
    if (e >= 0 && e < experts) ++r.offset[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) r.offset[e + 1] += r.offset[e];
  std::vector<int64_t> next(r.offset.begin(), r.offset.end() - 1);
  r.token.resize(r.offset[experts]);
  r.pos.assign(pairs, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p0 + p];
    if (e < 0 || e >= experts) continue;
    const int64_t s = next[e]++;
    r.pos[p] = s;
    r.token[s] = t0 + p / topk;
  }
  return r;
}

// One chunk of tokens [t0, t1). X: x's element type, float or (16-bit mode) W.
//
// Each expert with rows is of one kind: kVec (the register-blocked dot products, float32
// activations), kGemm (torch's GEMMs in x's dtype, for many rows) or kAmx (AMX tiles, bfloat16
// mode on CPUs with AMX; it replaces kGemm there). Each expert's rows are contiguous in its
// kind's buffers from row base[e]: float32 xs [., K] and act [., N] (kVec, and kGemm in float32);
// 16-bit xs16 and act16 (kGemm in 16-bit mode); packed xpk [., K] and apk [., N] (kAmx, rows padded
// to blocks of 16). y [P, K] (float32, sorted rows) holds every expert's down outputs.
template <typename X, typename W>
void moe_chunk(const X* x, const W* w13, const W* w2, const at::Tensor& w13_t, const at::Tensor& w2_t,
               const float* tw, const int64_t* ids, int64_t t0, int64_t t1, int64_t topk, int64_t E, int64_t N,
               int64_t K, float* outf) {
  static_assert(std::is_same_v<X, float> || std::is_same_v<X, W>, "x: float32 or the weights' dtype");
  constexpr bool low = is16<X>;  // 16-bit mode
  const Routing rt = route(ids, t0, t1, topk, E);
  const int64_t P = rt.offset[E];
  if (P == 0) {
    for (int64_t t = t0; t < t1; ++t) std::fill(outf + t * K, outf + (t + 1) * K, 0.f);
    return;
  }
  enum Kind : char { kNone, kVec, kGemm, kAmx };
  bool amx = false;
#if defined(RADIXSERVE_MOE_AMX)
  if constexpr (std::is_same_v<X, c10::BFloat16>) amx = K % 32 == 0 && N % 32 == 0 && amx_ready();
#endif
  std::vector<Kind> kind(E, kNone);
  std::vector<int64_t> base(E, 0);
  int64_t Pf = 0, P16 = 0, Pa = 0, ngemm = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = rt.offset[e + 1] - rt.offset[e];
    if (n == 0) continue;
    kind[e] = kVec;
    if (amx && n >= kAmxRows) {
      kind[e] = kAmx;
    } else if (!amx && std::is_same_v<X, W> && n >= (low ? kGemmRows16 : kGemmRows)) {
      kind[e] = kGemm;
      ++ngemm;
    }
    int64_t& count = kind[e] == kAmx ? Pa : low && kind[e] == kGemm ? P16 : Pf;
    base[e] = count;
    count += kind[e] == kAmx ? (n + 15) / 16 * 16 : n;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor xs_t = at::empty({Pf, K}, f32), act_t = at::empty({Pf, N}, f32), y_t = at::empty({P, K}, f32);
  at::Tensor xs16_t, act16_t;
  if (P16 + Pa > 0) {
    xs16_t = (Pa > 0 ? at::zeros({P16 + Pa, K}, w13_t.options()) : at::empty({P16, K}, w13_t.options()));
    act16_t = at::empty({P16 + Pa, N}, w13_t.options());
  }
  float* xs = xs_t.data_ptr<float>();
  float* act = act_t.data_ptr<float>();
  float* y = y_t.data_ptr<float>();
  // 16-bit rows: kGemm experts' first, then the packed kAmx ones
  X* xs16 = P16 + Pa > 0 ? xs16_t.data_ptr<X>() : nullptr;
  X* act16 = P16 + Pa > 0 ? act16_t.data_ptr<X>() : nullptr;
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t e = std::upper_bound(rt.offset.begin(), rt.offset.end(), s) - rt.offset.begin() - 1;
      const int64_t m = s - rt.offset[e];  // the row within the expert
      const X* src = x + rt.token[s] * K;
      if (kind[e] == kVec || (!low && kind[e] == kGemm)) {
        float* dst = xs + (base[e] + m) * K;
        for (int64_t k = 0; k < K; ++k) dst[k] = to_float(src[k]);
      } else if (kind[e] == kGemm) {
        std::memcpy(xs16 + (base[e] + m) * K, src, K * sizeof(X));
      } else {
#if defined(RADIXSERVE_MOE_AMX)
        if constexpr (std::is_same_v<X, c10::BFloat16>) amx_pack_row(src, K, m, xs16 + (P16 + base[e]) * K);
#endif
      }
    }
  });

  // Tasks: (expert, block of output features), the largest first (tasks are taken in order).
  struct Task {
    int64_t e, f0, nf;
  };
  std::vector<int64_t> order;
  for (int64_t e = 0; e < E; ++e)
    if (kind[e] != kNone) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return rt.offset[a + 1] - rt.offset[a] > rt.offset[b + 1] - rt.offset[b];
  });
  // kGemm experts: one single-threaded GEMM per task (threads need not wait on each other within an
  // expert); an expert is split into more than one block only where there are too few of them
  const int64_t splits = std::max<int64_t>(1, (4 * at::get_num_threads() + ngemm - 1) / std::max<int64_t>(1, ngemm));
  auto gemm_block = [&](int64_t n) { return std::min(n, ((n + splits - 1) / splits + 63) / 64 * 64); };
  std::vector<Task> up, down;
  for (int64_t e : order) {
    int64_t fu = kFeatBlock, fd = kFeatBlock;
    if (kind[e] == kGemm) {
      fu = gemm_block(N), fd = gemm_block(K);
    } else if (kind[e] == kAmx) {
      fu = fd = kAmxFeat;
    } else if (N * static_cast<int64_t>(sizeof(W)) < 2048) {
      fd = 2 * kFeatBlock;  // short down rows: tasks of >= 64 KiB of weights
    }
    for (int64_t f = 0; f < N; f += fu) up.push_back({e, f, std::min(fu, N - f)});
    for (int64_t f = 0; f < K; f += fd) down.push_back({e, f, std::min(fd, K - f)});
  }

  // gate/up and SiLU-and-mul
  parallel_tasks(static_cast<int64_t>(up.size()), [&](int64_t i) {
    const Task& task = up[i];
    const int64_t e = task.e, n = rt.offset[e + 1] - rt.offset[e];
    const W* gate = w13 + (e * 2 * N + task.f0) * K;
    const W* upw = gate + N * K;
    if (kind[e] == kVec) {
      float g[kMaxRows * kFeatBlock], u[kMaxRows * kFeatBlock];
      for (int64_t r0 = 0; r0 < n; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, n - r0));
        const float* xr = xs + (base[e] + r0) * K;
        dot_rows(rows, xr, K, gate, K, task.nf, K, g, kFeatBlock, upw);
        dot_rows(rows, xr, K, upw, K, task.nf, K, u, kFeatBlock, static_cast<const W*>(nullptr));
        for (int r = 0; r < rows; ++r)
          silu_mul(g + r * kFeatBlock, u + r * kFeatBlock, act + (base[e] + r0 + r) * N + task.f0, task.nf);
      }
    } else if (kind[e] == kGemm) {
      using G = std::conditional_t<low, X, float>;  // the GEMMs' dtype
      const at::Tensor xe = (low ? xs16_t : xs_t).narrow(0, base[e], n);
      const at::Tensor w = w13_t[e];
      const at::Tensor hg = at::mm(xe, w.narrow(0, task.f0, task.nf).t());
      const at::Tensor hu = at::mm(xe, w.narrow(0, N + task.f0, task.nf).t());
      G* dst;
      if constexpr (low) {
        dst = act16 + base[e] * N + task.f0;
      } else {
        dst = act + base[e] * N + task.f0;
      }
      for (int64_t r = 0; r < n; ++r)
        silu_mul(hg.data_ptr<G>() + r * task.nf, hu.data_ptr<G>() + r * task.nf, dst + r * N, task.nf);
    } else {
#if defined(RADIXSERVE_MOE_AMX)
      if constexpr (std::is_same_v<X, c10::BFloat16>) {
        // per 32 features: g and u [32, npad] (weight rows x tokens); act into the packed k-block
        // (f0 + f) / 32 of apk
        const int64_t ntb = (n + 15) / 16, npad = 16 * ntb;
        thread_local std::vector<float> buf;
        buf.resize(2 * 32 * npad);
        float* g = buf.data();
        float* u = g + 32 * npad;
        amx_begin();
        for (int64_t f0 = 0; f0 < task.nf; f0 += 32) {
          amx_rows32_all(gate + f0 * K, K, xs16 + (P16 + base[e]) * K, ntb, K / 32, g, npad);
          amx_rows32_all(upw + f0 * K, K, xs16 + (P16 + base[e]) * K, ntb, K / 32, u, npad);
          for (int64_t f = 0; f < 32; ++f) silu_mul(g + f * npad, u + f * npad, g + f * npad, npad);
          X* apk = act16 + (P16 + base[e]) * N + ((task.f0 + f0) / 32) * kTile;
          for (int64_t m = 0; m < npad; ++m) {
            X* dst = apk + (m / 16) * (N / 32) * kTile + 2 * (m % 16);
            for (int64_t f = 0; f < 32; ++f) dst[(f / 2) * 32 + f % 2] = X(g[f * npad + m]);
          }
        }
        _tile_release();
      }
#endif
    }
  });
  // down
  parallel_tasks(static_cast<int64_t>(down.size()), [&](int64_t i) {
    const Task& task = down[i];
    const int64_t e = task.e, n = rt.offset[e + 1] - rt.offset[e];
    const W* w = w2 + (e * K + task.f0) * N;
    float* ye = y + rt.offset[e] * K + task.f0;
    if (kind[e] == kVec) {
      for (int64_t r0 = 0; r0 < n; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, n - r0));
        dot_rows(rows, act + (base[e] + r0) * N, N, w, N, task.nf, N, ye + r0 * K, K, static_cast<const W*>(nullptr));
      }
    } else if (kind[e] == kGemm) {
      using G = std::conditional_t<low, X, float>;
      const at::Tensor a = (low ? act16_t : act_t).narrow(0, base[e], n);
      const at::Tensor o = at::mm(a, w2_t[e].narrow(0, task.f0, task.nf).t());
      const G* src = o.data_ptr<G>();
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < task.nf; ++c) ye[r * K + c] = to_float(src[r * task.nf + c]);
    } else {
#if defined(RADIXSERVE_MOE_AMX)
      if constexpr (std::is_same_v<X, c10::BFloat16>) {
        const int64_t ntb = (n + 15) / 16, npad = 16 * ntb;
        thread_local std::vector<float> buf;
        buf.resize(32 * npad);
        amx_begin();
        for (int64_t f0 = 0; f0 < task.nf; f0 += 32) {
          amx_rows32_all(w + f0 * N, N, act16 + (P16 + base[e]) * N, ntb, N / 32, buf.data(), npad);
          for (int64_t m = 0; m < n; ++m)
            for (int64_t c = 0; c < 32; ++c) ye[m * K + f0 + c] = buf[c * npad + m];
        }
        _tile_release();
      }
#endif
    }
  });

  // out[t] = sum of the weighted rows of t's valid slots, in slot order
  const int64_t T = t1 - t0;
  const int64_t kb = std::min<int64_t>(K, 512), nkb = (K + kb - 1) / kb;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kb * topk));  // a few tokens (decode): serially
  at::parallel_for(0, T * nkb, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nkb, k0 = (i % nkb) * kb, k1 = std::min(K, k0 + kb);
      float* dst = outf + (t0 + t) * K;
      std::fill(dst + k0, dst + k1, 0.f);
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t s = rt.pos[t * topk + j];
        if (s < 0) continue;
        const float wt = tw[(t0 + t) * topk + j];
        const float* src = y + s * K;
        for (int64_t k = k0; k < k1; ++k) dst[k] += wt * src[k];
      }
    }
  });
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids) {
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu(), "fused_moe: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "fused_moe: x must be [tokens, hidden]; got ", x.sizes());
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "fused_moe: w13 must be [experts, 2 * inter, hidden] and w2 ",
              "[experts, hidden, inter]; got ", w13.sizes(), " and ", w2.sizes());
  const int64_t T = x.size(0), K = x.size(1), E = w13.size(0), N = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * N && w13.size(2) == K, "fused_moe: w13 ", w13.sizes(), " does not match x ",
              x.sizes(), " (expected [E, 2N, ", K, "])");
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == K && w2.size(2) == N, "fused_moe: w2 ", w2.sizes(),
              " must be [", E, ", ", K, ", ", N, "]");
  const auto xt = x.scalar_type(), wt = w13.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf,
              "fused_moe: x must be float32, bfloat16 or float16; got ", xt);
  TORCH_CHECK(wt == w2.scalar_type(), "fused_moe: w13 and w2 must share a dtype; got ", wt, " and ",
              w2.scalar_type());
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
              "fused_moe: weights must be float32, bfloat16 or float16; got ", wt);
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "fused_moe: w13 and w2 must be contiguous");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe: topk_weights and topk_ids must both be [", T, ", topk]; got ", topk_weights.sizes(),
              " and ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat, "fused_moe: topk_weights must be float32; got ",
              topk_weights.scalar_type());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be int32 or int64; got ", topk_ids.scalar_type());
  const int64_t topk = topk_ids.size(1);

  // 16-bit activations where x and the weights share a 16-bit dtype, else float32
  const bool low = xt == wt && wt != at::kFloat;
  at::Tensor xa = low ? x.contiguous() : x.to(at::kFloat).contiguous();
  at::Tensor outf = at::empty({T, K}, x.options().dtype(at::kFloat));
  if (T == 0 || K == 0) return outf.to(xt);
  if (topk == 0 || E == 0 || N == 0) return outf.zero_().to(xt);
  at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  at::Tensor tw = topk_weights.contiguous();
  float* op = outf.data_ptr<float>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* twp = tw.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(1, kBufferFloats / std::max<int64_t>(1, topk * K));
  dispatch_float16(wt, "fused_moe: weights", [&](auto tag) {
    using W = decltype(tag);
    auto run = [&](auto xtag) {
      using X = decltype(xtag);
      for (int64_t t0 = 0; t0 < T; t0 += chunk)
        moe_chunk<X, W>(xa.data_ptr<X>(), w13.data_ptr<W>(), w2.data_ptr<W>(), w13, w2, twp, idp, t0,
                        std::min(T, t0 + chunk), topk, E, N, K, op);
    };
    if constexpr (is16<W>) {
      if (low) return run(W{});
    }
    run(float{});
  });
  return xt == at::kFloat ? outf : outf.to(xt);
}

// Kernels of the other translation units of this extension.
at::Tensor quant_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes, bool exact);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

#if defined(RADIXSERVE_LEAN_DECODE)
namespace {

using radixserve_lean::DownActs;
using radixserve_lean::LeanActs;
using radixserve_lean::LeanLinear;
using radixserve_lean::LeanX;
using radixserve_lean::Meet;
using radixserve_lean::Steal;

// o[j] += float(y[j]) * w with the product rounded before the sum, as the loop's ATen mul and
// index_add_ round them (a contracted FMA changed an output's last bit now and then)
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void add_scaled_row(float* o, const c10::BFloat16* y, float w, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  for (int64_t j = 0; j < n; ++j) o[j] += static_cast<float>(y[j]) * w;
}

// read at each call (a getenv, ~0.1 us): A/B runs toggle it in one process
bool lean_moe_disabled() {
  const char* v = std::getenv("RADIXSERVE_DISABLE_LEAN_DECODE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// A decode step's quantized experts in one parallel region (the decode stack's way, cpu_lean.h). The
// per-expert loop below runs two quant_linear calls, an allocation and a handful of ATen ops for each
// expert with tokens, each GEMV its own parallel region: at batch 1 of a Qwen3-MoE-shaped layer (8 of
// 128 experts, 2048 x 768) that is 16 parallel regions over 0.9-1.7 MB of weights each. Here, with
// every expert's rows in the sorted (token, slot) order:
//   0. per expert: its rows of x gathered and made into the activations its gate-up kernels take
//   1. per (expert, group of 128 of its intermediate features): the group's gate and up rows, SiLU
//      and the down projection's activations of the group
//   2. per expert: the down activations' final form; then per (expert, 16 output features) its down rows
//   3. per 64 output features: each token's sum over its experts in expert order, times the router's
//      weights, in float32
// The same row kernels as quant_linear's for the same rows and the same sum order as the loop's
// index_add_, so the result is the loop's bit for bit. Returns an undefined tensor where a chosen
// expert's weights or row count have no lean kernel (the loop runs then).
at::Tensor quant_moe_lean(const at::Tensor& x, at::TensorList w13, at::IntArrayRef w13_types,
                          const std::vector<int64_t>& o13, at::TensorList w2, at::IntArrayRef w2_types,
                          const std::vector<int64_t>& o2, const std::vector<int64_t>& count,
                          const std::vector<int64_t>& start, const int64_t* ord, const float* tw, int64_t topk) {
  using bf16 = c10::BFloat16;
  if (x.scalar_type() != at::kBFloat16 || lean_moe_disabled()) return {};
  const int64_t T = x.size(0), K = x.size(1), E = static_cast<int64_t>(count.size()) - 1;
  std::vector<int64_t> sel;  // experts with tokens, in expert order
  for (int64_t e = 0; e < E; ++e)
    if (count[e] > 0) sel.push_back(e);
  const int64_t S = static_cast<int64_t>(sel.size());
  if (S == 0) return {};
  auto seg = [](at::TensorList w, at::IntArrayRef t, int64_t b, int64_t e) {
    return std::make_pair(std::vector<at::Tensor>(w.begin() + b, w.begin() + e),
                          std::vector<int64_t>(t.begin() + b, t.begin() + e));
  };
  std::vector<LeanLinear> up, down;
  up.reserve(S), down.reserve(S);
  int64_t F = -1;  // the experts' intermediate size
  for (int64_t e : sel) {
    const auto [w, t] = seg(w13, w13_types, o13[e], o13[e + 1]);
    const auto [v, u] = seg(w2, w2_types, o2[e], o2[e + 1]);
    int64_t n13 = 0;
    for (const auto& s : w) n13 += s.size(0);
    if (n13 % 2 != 0 || (F >= 0 && n13 / 2 != F)) return {};
    F = n13 / 2;
    if (!LeanLinear::supported(w, t, K) || !LeanLinear::supported(v, u, F)) return {};
    up.emplace_back(w, t, K, c10::nullopt);
    down.emplace_back(v, u, F, c10::nullopt);
    if (!up.back().runnable(count[e]) || !down.back().runnable(count[e]) || down.back().n != K) return {};
  }
  for (int64_t s = 0; s < S; ++s) up[s].choose(count[sel[s]]), down[s].choose(count[sel[s]]);
  const int64_t P = start[E], G = (F + 127) / 128;
  // down rows per unit: ~32 KB of weights (a unit is a fresh memory stream; tiny ones left the
  // prefetchers no time to ramp up), a multiple of 16
  int64_t down_row_bytes = 0;
  for (const auto& seg : down[0].segs) down_row_bytes = std::max(down_row_bytes, seg.row_bytes);
  const int64_t kRowsPerUnit = std::max<int64_t>(16, (32768 / std::max<int64_t>(1, down_row_bytes) + 15) / 16 * 16);
  constexpr int64_t kColsPerUnit = 64;
  const int64_t row_units = (K + kRowsPerUnit - 1) / kRowsPerUnit, col_units = (K + kColsPerUnit - 1) / kColsPerUnit;
  const auto opts = x.options();
  at::Tensor xs = at::empty({P, K}, opts), gu = at::empty({P, 2 * F}, opts), act = at::empty({P, F}, opts);
  at::Tensor y = at::empty({P, K}, opts), out = at::zeros({T, K}, opts.dtype(at::kFloat));
  const bf16* xp = x.data_ptr<bf16>();
  bf16 *xsp = xs.data_ptr<bf16>(), *gp = gu.data_ptr<bf16>(), *ap = act.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  float* op = out.data_ptr<float>();
  std::vector<LeanActs> up_acts(S), down_own(S);
  std::vector<LeanX> up_x(S), down_x(S);
  std::vector<DownActs> down_acts;
  down_acts.reserve(S);
  for (int64_t s = 0; s < S; ++s) down_acts.emplace_back(count[sel[s]], F, down[s].int8, down[s].int16, down[s].plain);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  Steal steal(threads);
  Meet meet;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    uint64_t epoch = 0;
    auto units_of = [&](int64_t units, auto&& fn) {
      steal.start(tid, nt, units, ++epoch);
      for (int64_t u; (u = steal.next(tid, nt, epoch)) >= 0;) fn(u);
    };
    units_of(S, [&](int64_t s) {
      const int64_t e = sel[s], n = count[e], r0 = start[e];
      for (int64_t i = 0; i < n; ++i) {
        const bf16* src = xp + (ord[r0 + i] / topk) * K;
        std::copy(src, src + K, xsp + (r0 + i) * K);
      }
      up_x[s] = up_acts[s].make(xsp + r0 * K, n, K, up[s]);
    });
    meet.wait(nt);
    units_of(S * G, [&](int64_t u) {
      const int64_t s = u / G, g = u % G, e = sel[s], n = count[e], r0 = start[e];
      const int64_t f0 = g * 128, f1 = std::min(F, f0 + 128);
      bf16* gs = gp + r0 * 2 * F;
      up[s].rows(up_x[s], n, f0, f1, gs, 2 * F);
      up[s].rows(up_x[s], n, F + f0, F + f1, gs, 2 * F);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* gt = reinterpret_cast<const uint16_t*>(gs + i * 2 * F);
        bf16* at = ap + (r0 + i) * F;
        radixserve_rows::silu_mul_bf16(gt + f0, gt + F + f0, reinterpret_cast<uint16_t*>(at) + f0, f1 - f0);
        down_acts[s].write(i, g, at);
      }
    });
    meet.wait(nt);
    units_of(S, [&](int64_t s) { down_x[s] = down_acts[s].acts(down_own[s], count[sel[s]]); });
    meet.wait(nt);
    units_of(S * row_units, [&](int64_t u) {
      const int64_t s = u / row_units, c = u % row_units, e = sel[s];
      down[s].rows(down_x[s], count[e], c * kRowsPerUnit, std::min(K, (c + 1) * kRowsPerUnit), yp + start[e] * K, K);
    });
    meet.wait(nt);
    // out[t] += float(y[row]) * weight, expert after expert (the loop's index_add_ order)
    units_of(col_units, [&](int64_t c) {
      const int64_t j0 = c * kColsPerUnit, j1 = std::min(K, j0 + kColsPerUnit);
      for (int64_t e : sel)
        for (int64_t r = start[e]; r < start[e] + count[e]; ++r) {
          const int64_t p = ord[r];
          add_scaled_row(op + (p / topk) * K + j0, yp + r * K + j0, tw[p], j1 - j0);
        }
    });
  }
  return out.to(x.scalar_type());
}

}  // namespace
#endif  // RADIXSERVE_LEAN_DECODE

// Quantized experts (GGUF blocks; srt/layers/moe/fused_moe.py) in one op: expert e's gate-up projection is
// the w13 segments [o_e, o_e + w13_counts[e]) with their GGML types (as quant_linear takes a projection
// stored in several types), its down projection the w2 segments likewise. The (token, slot) pairs are
// grouped by expert (a stable counting sort; ids outside [0, E) belong to other ranks and are skipped),
// then for each expert with tokens, in expert order: its rows of x gathered, gate-up, SiLU-and-mul, down,
// times the router weights, added into a float32 sum per token. The same kernels in the same order as the
// per-expert Python loop (so the same result), without its per-expert dispatch. Returns [T, K] in x's dtype.
at::Tensor quant_moe(const at::Tensor& x, at::TensorList w13, at::IntArrayRef w13_types, at::IntArrayRef w13_counts,
                     at::TensorList w2, at::IntArrayRef w2_types, at::IntArrayRef w2_counts,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2, "quant_moe: x must be [T, K]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_weights.sizes() == topk_ids.sizes() && topk_ids.size(0) == x.size(0),
              "quant_moe: topk_weights and topk_ids must both be [T, topk]");
  const int64_t E = static_cast<int64_t>(w13_counts.size());
  TORCH_CHECK(static_cast<int64_t>(w2_counts.size()) == E, "quant_moe: one w13 and one w2 segment count per expert");
  TORCH_CHECK(w13.size() == w13_types.size() && w2.size() == w2_types.size(), "quant_moe: one type per segment");
  std::vector<int64_t> o13(E + 1, 0), o2(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(w13_counts[e] > 0 && w2_counts[e] > 0, "quant_moe: expert ", e, " has no weights");
    o13[e + 1] = o13[e] + w13_counts[e];
    o2[e + 1] = o2[e] + w2_counts[e];
  }
  TORCH_CHECK(o13[E] == static_cast<int64_t>(w13.size()) && o2[E] == static_cast<int64_t>(w2.size()),
              "quant_moe: segment counts do not add up to the segments given");
  const int64_t T = x.size(0), K = x.size(1), topk = topk_ids.size(1), P = T * topk;
  at::Tensor out = at::zeros({T, K}, x.options().dtype(at::kFloat));
  if (P == 0 || E == 0) return out.to(x.scalar_type());
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor tw = topk_weights.to(at::kFloat).contiguous().view({-1});
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E + 1, 0), start(E + 2, 0);
  for (int64_t p = 0; p < P; ++p) ++count[idp[p] >= 0 && idp[p] < E ? idp[p] : E];
  for (int64_t e = 0; e <= E; ++e) start[e + 1] = start[e] + count[e];
  at::Tensor order = at::empty({P}, ids.options());
  int64_t* ord = order.data_ptr<int64_t>();
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) ord[fill[idp[p] >= 0 && idp[p] < E ? idp[p] : E]++] = p;
  }
  const at::Tensor xc = x.contiguous();
#if defined(RADIXSERVE_LEAN_DECODE)
  if (at::Tensor lean = quant_moe_lean(xc, w13, w13_types, o13, w2, w2_types, o2, count, start, ord,
                                       tw.data_ptr<float>(), topk);
      lean.defined())
    return lean;
#endif
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    const at::Tensor pairs = order.narrow(0, start[e], n);
    const at::Tensor tokens = at::floor_divide(pairs, topk);
    const at::Tensor h = quant_linear(xc.index_select(0, tokens), w13.slice(o13[e], w13_counts[e]),
                                      w13_types.slice(o13[e], w13_counts[e]), false);
    at::Tensor act = at::empty({n, h.size(1) / 2}, h.options());
    silu_and_mul(act, h);
    const at::Tensor y = quant_linear(act, w2.slice(o2[e], w2_counts[e]), w2_types.slice(o2[e], w2_counts[e]), false);
    out.index_add_(0, tokens, y.to(at::kFloat) * tw.index_select(0, pairs).unsqueeze(1));
  }
  return out.to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor");
  m.def(
      "quant_moe(Tensor x, Tensor[] w13, int[] w13_types, int[] w13_counts, Tensor[] w2, int[] w2_types, "
      "int[] w2_counts, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("quant_moe", &quant_moe);
}
