// Fused mixture-of-experts MLP for CPUs (kernels/reference.py: fused_moe).
//
// Layout: x [T, K] (float32, bfloat16 or float16, rows contiguous); w13 [E, 2N, K], expert e's gate
// rows 0..N-1 then its up rows N..2N-1; w2 [E, K, N]; both weights float32, bfloat16 or float16 (one
// dtype), contiguous. topk_weights [T, topk] float32 and topk_ids [T, topk] (int32 or int64) route
// token t to experts topk_ids[t, j] with weights topk_weights[t, j]; ids outside [0, E) belong to
// other ranks (expert parallelism) and are skipped. out [T, K] in x's dtype:
//   out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t),  e = topk_ids[t, j],
// everything after the inputs' conversion computed and summed in float32.
//
// Method, per chunk of tokens (bounding the buffers):
//  1. The (token, slot) pairs are grouped by expert with a counting sort (stable: by pair index
//     within an expert); pair p = t * topk + j lands at sorted row pos[p].
//  2. Gate/up: act [P, N] float32 (sorted rows) = silu(x_rows @ gate_e.T) * (x_rows @ up_e.T).
//  3. Down: y [P, K] float32 (sorted rows) = act_rows @ w2[e].T.
//  4. out[t] = sum over t's valid slots j, in slot order, of topk_weights[t, j] * y[pos[t * topk + j]].
// Every element is written by exactly one task and the sum of step 4 runs in a fixed order, so the
// result is deterministic and (but for torch's GEMMs, below) independent of the thread count.
//
// Steps 2 and 3 run in one parallel_for each over (expert, block of output features), so decode
// (a few tokens per expert: a memory-bound GEMV over the expert's weights) uses every thread. Each
// task takes its expert's rows 1-4 at a time against several weight rows at once (register-blocked
// dot products: each loaded vector of x and of weights feeds several products; 16-bit weights are
// widened to float in registers). The sums of one output element run over the same lanes in the
// same order whatever the blocking, so results do not depend on how rows were grouped. Experts with
// many rows and float32 weights (prefill) go to torch's GEMMs instead, outside the parallel region.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using radixserve_cpu::to_float;

// ---- vectors of kW floats: AVX-512 (16), AVX2 (8), or plain arrays the compiler vectorizes ----

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kW = 16;
constexpr int kMaxAcc = 16;  // accumulators a block may keep in registers (32 zmm)
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
constexpr int kMaxAcc = 8;  // 16 ymm
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
constexpr int kMaxAcc = 8;
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

// out[r * C + c] = sum_i a[r][i] * b[c][i], i < k: R float rows a (at a + r * lda) against C rows of
// b (type W, at b + c * ldb), R x C vector accumulators, each loaded vector used R or C times.
template <int R, int C, typename W>
inline void dot_block(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t k, float* out) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  int64_t i = 0;
  for (; i + kW <= k; i += kW) {
    Vec bv[C];
    for (int c = 0; c < C; ++c) bv[c] = Vec::load(b + c * ldb + i);
    for (int r = 0; r < R; ++r) {
      const Vec av = Vec::load(a + r * lda + i);
      for (int c = 0; c < C; ++c) acc[r][c] = Vec::fma(av, bv[c], acc[r][c]);
    }
  }
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

// Weight rows per block for R activation rows: as many accumulators as the registers hold, at most 8.
constexpr int cols_for(int R) { return std::min(8, std::max(1, kMaxAcc / R)); }

// out[r * ldo + c] = a[r] . b[c] for r < R (1..4), c < ncols: blocks of cols_for(R) weight rows, then
// the remainder one at a time.
template <int R, typename W>
void dot_rows_r(const float* a, int64_t lda, const W* b, int64_t ldb, int64_t ncols, int64_t k, float* out,
                int64_t ldo) {
  constexpr int C = cols_for(R);
  float tmp[R * C];
  int64_t c0 = 0;
  for (; c0 + C <= ncols; c0 += C) {
    dot_block<R, C>(a, lda, b + c0 * ldb, ldb, k, tmp);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * ldo + c0 + c] = tmp[r * C + c];
  }
  for (; c0 < ncols; ++c0) {
    dot_block<R, 1>(a, lda, b + c0 * ldb, ldb, k, tmp);
    for (int r = 0; r < R; ++r) out[r * ldo + c0] = tmp[r];
  }
}

template <typename W>
void dot_rows(int rows, const float* a, int64_t lda, const W* b, int64_t ldb, int64_t ncols, int64_t k, float* out,
              int64_t ldo) {
  switch (rows) {
    case 1: return dot_rows_r<1>(a, lda, b, ldb, ncols, k, out, ldo);
    case 2: return dot_rows_r<2>(a, lda, b, ldb, ncols, k, out, ldo);
    case 3: return dot_rows_r<3>(a, lda, b, ldb, ncols, k, out, ldo);
    default: return dot_rows_r<4>(a, lda, b, ldb, ncols, k, out, ldo);
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

constexpr int64_t kRowBlock = 4;       // activation rows per dot block
constexpr int64_t kFeatBlock = 32;     // output features per task (gate/up: N; down: K)
constexpr int64_t kGemmRows = 32;      // an expert with this many rows (and float32 weights) uses at::mm
constexpr int64_t kBufferFloats = 16 << 20;  // y buffer budget per chunk of tokens (64 MiB)

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

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

template <typename W>
void moe_chunk(const float* xf, const W* w13, const W* w2, const at::Tensor& xf_t, const at::Tensor& w13_t,
               const at::Tensor& w2_t, const float* tw, const int64_t* ids, int64_t t0, int64_t t1, int64_t topk,
               int64_t E, int64_t N, int64_t K, float* outf) {
  const Routing rt = route(ids, t0, t1, topk, E);
  const int64_t P = rt.offset[E];
  if (P == 0) {
    for (int64_t t = t0; t < t1; ++t) std::fill(outf + t * K, outf + (t + 1) * K, 0.f);
    return;
  }
  // xs [P, K]: the token rows in sorted order, so that an expert's rows are contiguous
  at::Tensor xs_t = at::empty({P, K}, xf_t.options());
  at::Tensor act_t = at::empty({P, N}, xf_t.options());
  at::Tensor y_t = at::empty({P, K}, xf_t.options());
  float* xs = xs_t.data_ptr<float>();
  float* act = act_t.data_ptr<float>();
  float* y = y_t.data_ptr<float>();
  const int64_t* token = rt.token.data();
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) std::memcpy(xs + s * K, xf + token[s] * K, K * sizeof(float));
  });

  // experts with many rows and float32 weights: torch's (multi-threaded) GEMMs, one expert at a time
  std::vector<char> big(E, 0);
  if (std::is_same_v<W, float>) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t off = rt.offset[e], n = rt.offset[e + 1] - off;
      if (n < kGemmRows) continue;
      big[e] = 1;
      at::Tensor h = at::mm(xs_t.narrow(0, off, n), w13_t[e].t());
      at::Tensor a = act_t.narrow(0, off, n);
      at::mul_out(a, at::silu(h.narrow(1, 0, N)), h.narrow(1, N, N));
      at::Tensor yo = y_t.narrow(0, off, n);
      at::mm_out(yo, a, w2_t[e].t());
    }
  }

  // the other experts: tasks of (expert, block of output features)
  struct Task {
    int64_t e, f0, nf;
  };
  std::vector<Task> up_tasks, down_tasks;
  for (int64_t e = 0; e < E; ++e) {
    if (big[e] || rt.offset[e + 1] == rt.offset[e]) continue;
    for (int64_t f = 0; f < N; f += kFeatBlock) up_tasks.push_back({e, f, std::min(kFeatBlock, N - f)});
    for (int64_t f = 0; f < K; f += kFeatBlock) down_tasks.push_back({e, f, std::min(kFeatBlock, K - f)});
  }
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    float g[kRowBlock * kFeatBlock], u[kRowBlock * kFeatBlock];
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = up_tasks[i];
      const int64_t off = rt.offset[task.e], n = rt.offset[task.e + 1] - off;
      const W* gate = w13 + (task.e * 2 * N + task.f0) * K;
      const W* upw = gate + N * K;
      for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
        const int rows = static_cast<int>(std::min(kRowBlock, n - r0));
        const float* xr = xs + (off + r0) * K;
        dot_rows(rows, xr, K, gate, K, task.nf, K, g, kFeatBlock);
        dot_rows(rows, xr, K, upw, K, task.nf, K, u, kFeatBlock);
        for (int r = 0; r < rows; ++r) {
          float* dst = act + (off + r0 + r) * N + task.f0;
          for (int64_t c = 0; c < task.nf; ++c) dst[c] = silu(g[r * kFeatBlock + c]) * u[r * kFeatBlock + c];
        }
      }
    }
  });
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = down_tasks[i];
      const int64_t off = rt.offset[task.e], n = rt.offset[task.e + 1] - off;
      const W* w = w2 + (task.e * K + task.f0) * N;
      for (int64_t r0 = 0; r0 < n; r0 += kRowBlock) {
        const int rows = static_cast<int>(std::min(kRowBlock, n - r0));
        dot_rows(rows, act + (off + r0) * N, N, w, N, task.nf, N, y + (off + r0) * K + task.f0, K);
      }
    }
  });

  // out[t] = sum of the weighted rows of t's valid slots, in slot order
  const int64_t T = t1 - t0;
  const int64_t kb = std::min<int64_t>(K, 512), nkb = (K + kb - 1) / kb;
  at::parallel_for(0, T * nkb, 1, [&](int64_t begin, int64_t end) {
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

  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor outf = xt == at::kFloat ? at::empty({T, K}, x.options()) : at::empty({T, K}, xf.options());
  if (T == 0 || K == 0) return outf.to(xt);
  if (topk == 0 || E == 0 || N == 0) return outf.zero_().to(xt);
  at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  at::Tensor tw = topk_weights.contiguous();
  const float* xp = xf.data_ptr<float>();
  float* op = outf.data_ptr<float>();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* twp = tw.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(1, kBufferFloats / std::max<int64_t>(1, topk * K));
  dispatch_float16(wt, "fused_moe: weights", [&](auto tag) {
    using W = decltype(tag);
    for (int64_t t0 = 0; t0 < T; t0 += chunk)
      moe_chunk<W>(xp, w13.data_ptr<W>(), w2.data_ptr<W>(), xf, w13, w2, twp, idp, t0, std::min(T, t0 + chunk), topk,
                   E, N, K, op);
  });
  return xt == at::kFloat ? outf : outf.to(xt);
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("fused_moe", &fused_moe); }
