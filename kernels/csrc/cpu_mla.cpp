// MLA (DeepSeek's multi-head latent attention) for CPUs, in absorbed form over a paged pool
// (kernels/reference.py: mla_decode_attention, mla_extend_attention).
//
// Layout: kv_buffer [num_slots, 1, Dk] (or [num_slots, Dk]), float32 / bfloat16 / float16: ONE row per
// token, [compressed KV latent | roped key part], shared by every query head. The key is the whole
// row, the value its first Dv values (Dv = out.size(-1) <= Dk). req_to_token[req_slot, position]
// (int32) is a token's slot. q [.., H, Dk] has the key up-projection folded in; out [.., H, Dv] is in
// latent space. mla_decode: one query per request at position seq_len - 1. mla_extend: request b's
// extend_seq_lens[b] new tokens are q rows extend_start_loc[b] + i, at positions
// seq_len - extend_seq_lens + i, attending causally (their rows already in the pool).
//
// Method: a task takes the query rows of a request (all H heads; for extend, a few of its tokens)
// and a range of its positions, and streams the range's KV rows once, in tiles of kTile positions:
// each tile's rows are widened to float (zero-padded to a whole number of vectors) in an L1 buffer,
// then used by every query row twice: scores = q_rows @ tile.T (register-blocked, several query
// rows x several positions per block), online softmax per row in float32, and acc = acc * corr +
// p @ tile[:, :Dv] (several rows x 64 output columns held in registers over the tile). Long contexts
// are split into ranges (flash-decoding: num_splits per request for decode, chosen from the thread
// count for extend), run as separate tasks of one parallel_for and merged by log-sum-exp, so batch 1
// uses every thread. Every result is accumulated in float32.

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
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using radixserve_cpu::to_float;
using radixserve_cpu::vexp;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 16;      // positions per tile (16 rows of 576 floats: 36 KB, in L1)
constexpr int64_t kMaxRows = 128;  // extend: query rows (tokens x heads) per task, at least one token

// ---- vectors of kW floats: AVX-512 (16), AVX2 (8), or plain arrays the compiler vectorizes ----

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kW = 16;
constexpr int kMaxAcc = 16;  // accumulators a block may keep in registers (32 zmm)
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static Vec widen_bf16(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
  static Vec load(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load(const c10::BFloat16* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static Vec load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static Vec load(const c10::Half* p, int n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p))}; }
  static void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
  static Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static float sum(Vec a) { return _mm512_reduce_add_ps(a.v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kW = 8;
constexpr int kMaxAcc = 8;  // 16 ymm
struct Vec {
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
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
  static void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
  static Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static float sum(Vec a) { return radixserve_cpu::hsum256(a.v); }
};
#else
constexpr int kW = 8;
constexpr int kMaxAcc = 8;
struct Vec {
  float v[kW];
  static Vec zero() { return Vec{}; }
  static Vec set1(float x) {
    Vec r;
    for (int i = 0; i < kW; ++i) r.v[i] = x;
    return r;
  }
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
  static void store(float* p, Vec a) { std::memcpy(p, a.v, sizeof(a.v)); }
  static Vec mul(Vec a, Vec b) {
    for (int i = 0; i < kW; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static Vec fma(Vec a, Vec b, Vec c) {
    for (int i = 0; i < kW; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static float sum(Vec a) {
    for (int w = kW / 2; w > 0; w /= 2)
      for (int i = 0; i < w; ++i) a.v[i] += a.v[i + w];
    return a.v[0];
  }
};
#endif

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

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- scores: s[r * kTile + j] = q[r] . tile[j], both zero-padded float rows of ld values ----

template <int R, int C>
inline void score_block(const float* q, const float* tile, int64_t ld, float* s) {
  Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  for (int64_t i = 0; i < ld; i += kW) {
    Vec kv[C];
    for (int c = 0; c < C; ++c) kv[c] = Vec::load(tile + c * ld + i);
    for (int r = 0; r < R; ++r) {
      const Vec qv = Vec::load(q + r * ld + i);
      for (int c = 0; c < C; ++c) acc[r][c] = Vec::fma(qv, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s[r * kTile + c] = Vec::sum(acc[r][c]);
}

constexpr int kScoreRows = 4;
constexpr int kScoreCols = std::max(1, kMaxAcc / kScoreRows);  // positions per block

template <int R>
void score_rows(const float* q, const float* tile, int64_t n, int64_t ld, float* s) {
  int64_t j = 0;
  for (; j + kScoreCols <= n; j += kScoreCols) score_block<R, kScoreCols>(q, tile + j * ld, ld, s + j);
  for (; j < n; ++j) score_block<R, 1>(q, tile + j * ld, ld, s + j);
}

void scores(const float* q, int64_t rows, const float* tile, int64_t n, int64_t ld, float* s) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows) score_rows<kScoreRows>(q + r * ld, tile, n, ld, s + r * kTile);
  switch (rows - r) {
    case 1: score_rows<1>(q + r * ld, tile, n, ld, s + r * kTile); break;
    case 2: score_rows<2>(q + r * ld, tile, n, ld, s + r * kTile); break;
    case 3: score_rows<3>(q + r * ld, tile, n, ld, s + r * kTile); break;
    default: break;
  }
}

// ---- values: acc[r] = acc[r] * corr[r] + sum_j p[r * kTile + j] * tile[j][:ldv] ----

constexpr int kPvCols = 4;                                // vectors of output columns per block
constexpr int kPvRows = std::max(1, kMaxAcc / kPvCols);  // query rows per block

template <int R, int NV>
inline void pv_block(const float* p, const float* corr, const float* tile, int64_t ldk, int64_t n, float* acc,
                     int64_t ldv) {
  Vec o[R][NV];
  for (int r = 0; r < R; ++r) {
    const Vec cv = Vec::set1(corr[r]);
    for (int c = 0; c < NV; ++c) o[r][c] = Vec::mul(Vec::load(acc + r * ldv + c * kW), cv);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec v[NV];
    for (int c = 0; c < NV; ++c) v[c] = Vec::load(tile + j * ldk + c * kW);
    for (int r = 0; r < R; ++r) {
      const Vec pv = Vec::set1(p[r * kTile + j]);
      for (int c = 0; c < NV; ++c) o[r][c] = Vec::fma(pv, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) Vec::store(acc + r * ldv + c * kW, o[r][c]);
}

template <int R>
void pv_rows(const float* p, const float* corr, const float* tile, int64_t ldk, int64_t n, float* acc, int64_t ldv) {
  int64_t c0 = 0;
  for (; c0 + kPvCols * kW <= ldv; c0 += kPvCols * kW) pv_block<R, kPvCols>(p, corr, tile + c0, ldk, n, acc + c0, ldv);
  for (; c0 < ldv; c0 += kW) pv_block<R, 1>(p, corr, tile + c0, ldk, n, acc + c0, ldv);
}

void values(const float* p, const float* corr, int64_t rows, const float* tile, int64_t ldk, int64_t n, float* acc,
            int64_t ldv) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows) pv_rows<kPvRows>(p + r * kTile, corr + r, tile, ldk, n, acc + r * ldv, ldv);
  for (; r < rows; ++r) pv_rows<1>(p + r * kTile, corr + r, tile, ldk, n, acc + r * ldv, ldv);
}

// One task's working memory (per thread), for up to `rows` query rows.
struct Scratch {
  std::vector<float> q, acc, s, tile, m, l, corr;
  std::vector<int64_t> limit;
  Scratch(int64_t rows, int64_t ldk, int64_t ldv)
      : q(rows * ldk, 0.f), acc(rows * ldv), s(rows * kTile), tile(kTile * ldk, 0.f), m(rows), l(rows), corr(rows),
        limit(rows) {}
};

// Online-softmax attention of `rows` query rows (sc.q, pre-scaled, zero-padded to ldk) over positions
// [lo, hi) of one request (slots), row r seeing positions < sc.limit[r]. Updates sc.m, sc.l, sc.acc.
template <typename KV>
void attend(Scratch& sc, int64_t rows, const KV* kv, int64_t kv_stride, int64_t dk, int64_t ldk, int64_t ldv,
            const int32_t* slots, int64_t lo, int64_t hi) {
  float* tile = sc.tile.data();
  float* s = sc.s.data();
  const int64_t row_bytes = dk * static_cast<int64_t>(sizeof(KV));
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = std::min(kTile, hi - t0);
    for (int64_t j = 0; j < n; ++j) {  // the tile's rows as float; the next tile's rows prefetched
      if (t0 + kTile + j < hi) {
        const char* next = reinterpret_cast<const char*>(kv + slots[t0 + kTile + j] * kv_stride);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
      }
      const KV* src = kv + slots[t0 + j] * kv_stride;
      float* dst = tile + j * ldk;
      int64_t i = 0;
      for (; i + kW <= dk; i += kW) Vec::store(dst + i, Vec::load(src + i));
      if (i < dk) Vec::store(dst + i, Vec::load(src + i, static_cast<int>(dk - i)));  // zeros beyond dk
    }
    scores(sc.q.data(), rows, tile, n, ldk, s);
    for (int64_t r = 0; r < rows; ++r) {  // online softmax, row by row
      float* sr = s + r * kTile;
      const int64_t visible = std::min(n, std::max<int64_t>(0, sc.limit[r] - t0));
      float tile_max = kNegInf;
      for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, sr[j]);
      if (tile_max == kNegInf) {  // nothing visible in this tile
        std::fill(sr, sr + n, 0.f);
        sc.corr[r] = 1.f;
        continue;
      }
      const float m_new = std::max(sc.m[r], tile_max);
      const float corr = sc.m[r] == kNegInf ? 0.f : vexp(sc.m[r] - m_new);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float e = j < visible ? vexp(sr[j] - m_new) : 0.f;
        sr[j] = e;
        sum += e;
      }
      sc.l[r] = sc.l[r] * corr + sum;
      sc.m[r] = m_new;
      sc.corr[r] = corr;
    }
    values(s, sc.corr.data(), rows, tile, ldk, n, sc.acc.data(), ldv);
  }
}

// A block of query tokens of one request and its position ranges: tokens tok0 .. tok0 + ntok - 1
// (rows of q and out) at positions pos0 .. pos0 + ntok - 1, their context split into `splits`
// ranges of [0, pos0 + ntok), each a task whose partial results start at row part0 + s * ntok * H.
struct Group {
  int64_t req, tok0, ntok, pos0, splits, task0, part0;
};

struct Problem {
  std::vector<Group> groups;
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, split)
  int64_t part_rows = 0, max_rows = 0;

  void add(int64_t req, int64_t tok0, int64_t ntok, int64_t pos0, int64_t splits, int64_t heads) {
    const int64_t ctx = pos0 + ntok;
    splits = std::max<int64_t>(1, std::min(splits, (ctx + kTile - 1) / kTile));  // no empty ranges
    const int64_t g = static_cast<int64_t>(groups.size());
    groups.push_back({req, tok0, ntok, pos0, splits, static_cast<int64_t>(tasks.size()), part_rows});
    for (int64_t s = 0; s < splits; ++s) tasks.emplace_back(g, s);
    part_rows += splits * ntok * heads;
    max_rows = std::max(max_rows, ntok * heads);
  }
};

struct Args {
  at::Tensor ridx, lens;  // int64 copies
  int64_t heads, dk, dv, slots_total, kv_stride;
  const int32_t* table;
  int64_t table_stride;
};

Args check_common(const at::Tensor& q, const at::Tensor& kv_buffer, const at::Tensor& req_to_token,
                  const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& out,
                  const char* name) {
  TORCH_CHECK(q.device().is_cpu() && kv_buffer.device().is_cpu() && out.device().is_cpu(), name,
              ": CPU tensors only");
  TORCH_CHECK(q.dim() == 3, name, ": q must be [tokens, heads, Dk]; got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              name, ": q must be float32, bfloat16 or float16; got ", q.scalar_type());
  const int64_t dk = q.size(2);
  TORCH_CHECK(kv_buffer.dim() == 2 || (kv_buffer.dim() == 3 && kv_buffer.size(1) == 1), name,
              ": kv_buffer must be [slots, 1, Dk] or [slots, Dk] (one row per token); got ", kv_buffer.sizes());
  TORCH_CHECK(kv_buffer.size(-1) == dk, name, ": kv_buffer rows hold ", kv_buffer.size(-1), " values but q has Dk = ",
              dk);
  TORCH_CHECK(kv_buffer.stride(-1) == 1, name, ": kv_buffer rows must be contiguous");
  const auto kt = kv_buffer.scalar_type();
  TORCH_CHECK(kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf, name,
              ": kv_buffer must be float32, bfloat16 or float16; got ", kt);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1), name, ": out must be [",
              q.size(0), ", ", q.size(1), ", Dv]; got ", out.sizes());
  TORCH_CHECK(out.size(2) >= 1 && out.size(2) <= dk, name, ": Dv = out.size(2) = ", out.size(2),
              " must be in [1, Dk = ", dk, "]");
  TORCH_CHECK(out.is_contiguous(), name, ": out must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              name, ": out must be float32, bfloat16 or float16; got ", out.scalar_type());
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1, name,
              ": req_to_token must be int32 [req_slots, max_len] with contiguous rows");
  TORCH_CHECK(req_pool_indices.dim() == 1 && seq_lens.dim() == 1 && req_pool_indices.size(0) == seq_lens.size(0),
              name, ": req_pool_indices and seq_lens must be [batch]");
  TORCH_CHECK(!at::isFloatingType(req_pool_indices.scalar_type()) && !at::isFloatingType(seq_lens.scalar_type()),
              name, ": req_pool_indices and seq_lens must be integer tensors");
  Args a;
  a.ridx = req_pool_indices.to(at::kLong).contiguous();
  a.lens = seq_lens.to(at::kLong).contiguous();
  a.heads = q.size(1);
  a.dk = dk;
  a.dv = out.size(2);
  a.slots_total = kv_buffer.size(0);
  a.kv_stride = kv_buffer.stride(0);
  a.table = req_to_token.data_ptr<int32_t>();
  a.table_stride = req_to_token.stride(0);
  const int64_t* ridx = a.ridx.data_ptr<int64_t>();
  const int64_t* lens = a.lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < a.lens.size(0); ++b) {
    TORCH_CHECK(ridx[b] >= 0 && ridx[b] < req_to_token.size(0), name, ": req_pool_indices[", b, "] = ", ridx[b],
                " is outside req_to_token's ", req_to_token.size(0), " rows");
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= req_to_token.size(1), name, ": seq_lens[", b, "] = ", lens[b],
                " is outside [0, ", req_to_token.size(1), "]");
    const int32_t* slots = a.table + ridx[b] * a.table_stride;
    for (int64_t i = 0; i < lens[b]; ++i)
      TORCH_CHECK(slots[i] >= 0 && slots[i] < a.slots_total, name, ": request ", b, " position ", i, " maps to slot ",
                  slots[i], ", outside kv_buffer's ", a.slots_total, " rows");
  }
  return a;
}

// Runs every task of `pb` and merges each group's splits into out (rows tok0 * H ..).
void run(const Problem& pb, const at::Tensor& q, const at::Tensor& kv_buffer, const Args& a, at::Tensor& out,
         double scale) {
  if (pb.tasks.empty()) return;
  const int64_t H = a.heads, dk = a.dk, dv = a.dv;
  const int64_t ldk = round_up(dk, kW), ldv = round_up(dv, kW);
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
  at::Tensor part_ml = at::empty({pb.part_rows, 2}, qf.options());
  at::Tensor part_o = at::empty({pb.part_rows, dv}, qf.options());
  float* ml = part_ml.data_ptr<float>();
  float* po = part_o.data_ptr<float>();
  const int32_t* table = a.table;
  const int64_t* ridx = a.ridx.data_ptr<int64_t>();
  const float sc_q = static_cast<float>(scale);

  dispatch_float16(kv_buffer.scalar_type(), "kv_buffer", [&](auto tag) {
    using kv_t = decltype(tag);
    const kv_t* kv = kv_buffer.data_ptr<kv_t>();
    at::parallel_for(0, static_cast<int64_t>(pb.tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch sc(pb.max_rows, ldk, ldv);
      for (int64_t t = begin; t < end; ++t) {
        const Group& g = pb.groups[pb.tasks[t].first];
        const int64_t s = pb.tasks[t].second, rows = g.ntok * H, ctx = g.pos0 + g.ntok;
        const int64_t chunk = (ctx + g.splits - 1) / g.splits;
        const int64_t lo = std::min(ctx, s * chunk), hi = std::min(ctx, lo + chunk);
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = qp + (g.tok0 * H + r) * dk;
          float* dst = sc.q.data() + r * ldk;
          for (int64_t i = 0; i < dk; ++i) dst[i] = src[i] * sc_q;
          sc.limit[r] = g.pos0 + r / H + 1;
        }
        std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
        std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
        std::fill(sc.acc.begin(), sc.acc.begin() + rows * ldv, 0.f);
        attend(sc, rows, kv, a.kv_stride, dk, ldk, ldv, table + ridx[g.req] * a.table_stride, lo, hi);
        const int64_t p0 = g.part0 + s * rows;
        for (int64_t r = 0; r < rows; ++r) {
          ml[(p0 + r) * 2] = sc.m[r];
          ml[(p0 + r) * 2 + 1] = sc.l[r];
          std::memcpy(po + (p0 + r) * dv, sc.acc.data() + r * ldv, dv * sizeof(float));
        }
      }
    });
  });

  // merge each group's splits by log-sum-exp (rows whose context is empty get zeros)
  dispatch_float16(out.scalar_type(), "out", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(pb.groups.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> o(dv);
      for (int64_t gi = begin; gi < end; ++gi) {
        const Group& g = pb.groups[gi];
        const int64_t rows = g.ntok * H;
        for (int64_t r = 0; r < rows; ++r) {
          float gmax = kNegInf;
          for (int64_t s = 0; s < g.splits; ++s) gmax = std::max(gmax, ml[(g.part0 + s * rows + r) * 2]);
          std::fill(o.begin(), o.end(), 0.f);
          float total = 0.f;
          for (int64_t s = 0; s < g.splits; ++s) {
            const int64_t pr = g.part0 + s * rows + r;
            if (ml[pr * 2] == kNegInf) continue;
            const float w = g.splits == 1 ? 1.f : std::exp(ml[pr * 2] - gmax);
            total += w * ml[pr * 2 + 1];
            const float* src = po + pr * dv;
            for (int64_t i = 0; i < dv; ++i) o[i] += w * src[i];
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          scalar_t* dst = op + (g.tok0 * H + r) * dv;
          for (int64_t i = 0; i < dv; ++i) dst[i] = static_cast<scalar_t>(o[i] * inv);
        }
      }
    });
  });
}

}  // namespace

// q [B, H, Dk], out [B, H, Dv]: request b's query at position seq_lens[b] - 1 over its positions
// 0 .. seq_lens[b] - 1, each context split into num_splits ranges.
void mla_decode(const at::Tensor& q, const at::Tensor& kv_buffer, const at::Tensor& req_to_token,
                const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                int64_t num_splits) {
  const Args a = check_common(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, out, "mla_decode");
  const int64_t B = q.size(0);
  TORCH_CHECK(a.lens.size(0) == B, "mla_decode: seq_lens has ", a.lens.size(0), " entries for ", B, " queries");
  const int64_t* lens = a.lens.data_ptr<int64_t>();
  Problem pb;
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] == 0) {  // no context: zeros
      out[b].zero_();
      continue;
    }
    pb.add(b, b, 1, lens[b] - 1, std::max<int64_t>(1, num_splits), a.heads);
  }
  run(pb, q, kv_buffer, a, out, scale);
}

// q [T, H, Dk], out [T, H, Dv]: request b's extend_seq_lens[b] new tokens are rows extend_start_loc[b] + i
// at positions seq_lens[b] - extend_seq_lens[b] + i, attending causally. Other rows are untouched.
void mla_extend(const at::Tensor& q, const at::Tensor& kv_buffer, const at::Tensor& req_to_token,
                const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& extend_start_loc,
                const at::Tensor& extend_seq_lens, at::Tensor& out, double scale) {
  const Args a = check_common(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, out, "mla_extend");
  const int64_t B = a.lens.size(0), T = q.size(0), H = a.heads;
  TORCH_CHECK(extend_start_loc.dim() == 1 && extend_seq_lens.dim() == 1 && extend_start_loc.size(0) == B &&
                  extend_seq_lens.size(0) == B,
              "mla_extend: extend_start_loc and extend_seq_lens must be [batch = ", B, "]");
  TORCH_CHECK(!at::isFloatingType(extend_start_loc.scalar_type()) && !at::isFloatingType(extend_seq_lens.scalar_type()),
              "mla_extend: extend_start_loc and extend_seq_lens must be integer tensors");
  const at::Tensor starts_t = extend_start_loc.to(at::kLong).contiguous();
  const at::Tensor ext_t = extend_seq_lens.to(at::kLong).contiguous();
  const int64_t* starts = starts_t.data_ptr<int64_t>();
  const int64_t* ext = ext_t.data_ptr<int64_t>();
  const int64_t* lens = a.lens.data_ptr<int64_t>();
  const int64_t block = std::max<int64_t>(1, kMaxRows / std::max<int64_t>(1, H));  // tokens per task
  int64_t blocks = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ext[b] >= 0 && ext[b] <= lens[b], "mla_extend: extend_seq_lens[", b, "] = ", ext[b],
                " must be in [0, seq_lens[", b, "] = ", lens[b], "]");
    TORCH_CHECK(starts[b] >= 0 && starts[b] + ext[b] <= T, "mla_extend: request ", b, "'s rows [", starts[b], ", ",
                starts[b] + ext[b], ") are outside q's ", T, " rows");
    blocks += (ext[b] + block - 1) / block;
  }
  // split contexts until there are about two tasks per thread, keeping ranges of >= 256 positions
  const int64_t want = (2 * at::get_num_threads() + std::max<int64_t>(1, blocks) - 1) / std::max<int64_t>(1, blocks);
  Problem pb;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t prefix = lens[b] - ext[b];
    for (int64_t i = 0; i < ext[b]; i += block) {
      const int64_t n = std::min(block, ext[b] - i), ctx = prefix + i + n;
      pb.add(b, starts[b] + i, n, prefix + i, std::min(want, (ctx + 255) / 256), H);
    }
  }
  run(pb, q, kv_buffer, a, out, scale);
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "mla_decode(Tensor q, Tensor kv_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
      "Tensor(a!) out, float scale, int num_splits) -> ()");
  m.def(
      "mla_extend(Tensor q, Tensor kv_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
      "Tensor extend_start_loc, Tensor extend_seq_lens, Tensor(a!) out, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("mla_extend", &mla_extend);
}
