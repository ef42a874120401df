// The sampler's row pass on CPU: a decode batch's next tokens from float32 logits, each row greedy or
// sampled at its temperature, with its top-k / top-p / min-p filters, in one op.
//
// Sampling is the exponential race of srt/layers/sampler.py (argmax of p_i / E_i, E_i ~ Exp(1), which
// draws exactly from p), written as argmax of logit_i / T - log E_i (the softmax's normalizer is the
// same for every token of a row). E_i is the seeded hash noise of seeded_exponential, a pure function
// of (seed, position, token id); a row without a seed gets a fresh random seed from the caller (torch's
// generator), so torch.manual_seed still governs it. A row without filters is one pass over its
// logits (no softmax, no probabilities). A filtered row computes exp((l - max) / T) once, finds a
// cutoff below which no token can survive its filters, and sorts only the tokens above it (a top-p
// nucleus is usually small; torch sorted the whole vocabulary of every row of the batch).
//
// Measured on a 2-core Xeon (64 rows of 49,152 logits): torch's sample() 68 ms at temperature 0.8 and
// 320-350 ms with top-p / top-k / min-p; see docs/sampling.md for this op's figures.

// FP operations may be executed speculatively (they trap nowhere here): lets GCC turn the noise's
// selects into blends and vectorize its loop (~30 -> ~3 ns a token on a 2-core Xeon). The values are
// the same; only floating-point exception flags could differ.
#pragma GCC optimize("no-trapping-math")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "cpu_sampling.h"

int64_t argmax_row(const float* x, int64_t n);  // cpu_norm_act.cpp

namespace {

using radixserve_cpu::vexp;

// seeded_exponential's 32-bit mix (sampler.py's _hash32), on uint32 (the same products mod 2^32).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x5BD1E995u;
  return x ^ (x >> 16);
}

// A row's key: seeded_exponential's hash of (seed, position).
inline uint32_t row_key(uint64_t seed, uint64_t position) {
  return mix32(mix32(mix32(static_cast<uint32_t>(seed >> 32)) ^ static_cast<uint32_t>(seed)) ^
               static_cast<uint32_t>(position));
}

// log(x) for normal x > 0 (cephes' logf: the mantissa on [sqrt(1/2), sqrt(2)) and a degree-9
// polynomial, relative error ~1e-7), written so the compiler vectorizes it. 0 gives about -88.
inline float vlog(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  int32_t e = static_cast<int32_t>(u >> 23) - 126;
  u = (u & 0x007FFFFFu) | 0x3F000000u;  // the mantissa on [0.5, 1)
  float m;
  std::memcpy(&m, &u, sizeof(m));
  const bool small = m < 0.70710678f;  // (selects of values computed either way: vectorized as blends)
  e -= small ? 1 : 0;
  const float f = (m - 1.f) + (small ? m : 0.f);
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  const float ef = static_cast<float>(e);
  y += -2.12194440e-4f * ef;
  y += -0.5f * z;
  return f + y + 0.693359375f * ef;
}

// -log(E) for token `token` of a row keyed `key`: E = -log(u), u = (h + 0.5) / 2^32 as
// seeded_exponential draws it, computed as -log1p(-w) from w = 1 - u = (~h + 0.5) / 2^32 so that the
// small E that decide the race keep their precision in float32.
inline float gumbel(uint32_t key, uint32_t token) {
  const uint32_t h = mix32(mix32(key ^ (token * 0x9E3779B1u)));
  const float w = (static_cast<float>(~h) + 0.5f) * 2.3283064365386963e-10f;
  const float y = 1.f - w, d = y - 1.f;
  const float ly = vlog(y), q = w / (d == 0.f ? -1.f : d);  // log1p(-w) = log(y) * (-w) / (y - 1)
  const float lp = ly * q;
  const float e = d == 0.f ? w : lp;
  return -vlog(e);
}

constexpr int64_t kChunk = 512;

// First index of the largest of logit / T + gumbel over the row (the race on every token).
int64_t race_row(const float* l, int64_t n, float inv_t, uint32_t key) {
  float buf[kChunk];
  float best = -std::numeric_limits<float>::infinity();
  int64_t where = -1;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    const float* lc = l + c0;
    const uint32_t base = static_cast<uint32_t>(c0);
_Pragma("omp simd")
    for (int64_t i = 0; i < len; ++i) buf[i] = lc[i] * inv_t + gumbel(key, base + static_cast<uint32_t>(i));
    const int64_t j = argmax_row(buf, len);
    if (std::isnan(buf[j])) return c0 + j;
    if (where < 0 || buf[j] > best) best = buf[j], where = c0 + j;
  }
  return where;
}

// The race among the tokens a row's filters keep: the top-n by probability, n the least of top_k, the
// top-p prefix (tokens whose preceding mass is at most top_p) and the min-p floor (probability at least
// min_p times the largest), as filter_probs keeps them.
int64_t filtered_row(const float* l, int64_t n, float inv_t, uint32_t key, int64_t top_k, float top_p, float min_p) {
  thread_local std::vector<float> e;
  thread_local std::vector<std::pair<float, int32_t>> cand;
  const int64_t top = argmax_row(l, n);
  const float m = l[top];
  if (std::isnan(m) || m == -std::numeric_limits<float>::infinity()) return top;
  e.resize(n);
  float* ep = e.data();
  float z = 0.f;
_Pragma("omp simd reduction(+ : z)")
  for (int64_t i = 0; i < n; ++i) {
    ep[i] = vexp((l[i] - m) * inv_t);  // the largest is exactly 1
    z += ep[i];
  }
  const bool by_p = top_p < 1.f;
  const float mass_p = top_p * z;
  // the cutoff: tokens below it cannot survive (at least top_k above it, or more than top_p of the mass
  // above it, or it is at most the min-p floor)
  float cut = 1.f / 16.f;
  for (;;) {
    int64_t count = 0;
    float mass = 0.f;
_Pragma("omp simd reduction(+ : count, mass)")
    for (int64_t i = 0; i < n; ++i) {
      const bool in = ep[i] >= cut;
      count += in ? 1 : 0;
      mass += in ? ep[i] : 0.f;
    }
    if (count >= top_k || (by_p && mass > mass_p) || cut <= min_p || cut == 0.f) break;
    cut = cut > 1e-30f ? cut * (1.f / 16.f) : 0.f;
  }
  cand.clear();
  for (int64_t i = 0; i < n; ++i)
    if (ep[i] >= cut) cand.emplace_back(ep[i], static_cast<int32_t>(i));
  // The kept tokens are the first of the candidates in descending order. Not sorted all: bucketed by
  // value, whole buckets are kept while even their smallest token passes every filter, and only the
  // bucket where the filters stop is refined, then sorted (a wide top-p nucleus of thousands of tokens
  // sorted in full cost ~2 ms a row).
  float best = -std::numeric_limits<float>::infinity();
  int64_t where = -1;  // the most probable token is always kept: set below
  auto race = [&](int32_t i) {
    const float s = (l[i] - m) * inv_t + gumbel(key, static_cast<uint32_t>(i));
    if (where < 0 || s > best || (s == best && i < where)) best = s, where = i;
  };
  // the race over many kept tokens at once, vectorized as race_row is (the noise a token at a time
  // cost ~30 ns: ~0.3 ms for a row's nucleus of 10,000)
  thread_local std::vector<int32_t> whole_ids;
  auto race_ids = [&](const std::vector<int32_t>& ids) {
    float buf[kChunk];
    for (size_t c0 = 0; c0 < ids.size(); c0 += kChunk) {
      const int64_t len = std::min<int64_t>(kChunk, static_cast<int64_t>(ids.size() - c0));
      const int32_t* ip = ids.data() + c0;
_Pragma("omp simd")
      for (int64_t j = 0; j < len; ++j)
        buf[j] = (l[ip[j]] - m) * inv_t + gumbel(key, static_cast<uint32_t>(ip[j]));
      const int64_t j = argmax_row(buf, len);
      const int32_t i = ip[j];
      if (where < 0 || buf[j] > best || (buf[j] == best && i < where)) best = buf[j], where = i;
    }
  };
  // Two levels of buckets: the float's top 12 bits (exponent and 4 mantissa bits; v in (0, 1], so at
  // most 0x7F0), then within the edge bucket the next 8 bits. Descending keys are descending values.
  thread_local std::vector<int32_t> counts;
  thread_local std::vector<float> masses, lows;
  thread_local std::vector<std::pair<float, int32_t>> pool, next;
  pool.assign(cand.begin(), cand.end());
  int64_t kept = 0;
  float prefix = 0.f;
  for (const int shift : {19, 11}) {
    const int32_t keys = shift == 19 ? 0x7F0 + 1 : 256;
    auto key_of = [&](float v) {
      uint32_t u;
      std::memcpy(&u, &v, sizeof(u));
      return static_cast<int32_t>((u >> shift) & (shift == 19 ? 0xFFFu : 0xFFu));
    };
    counts.assign(keys, 0);
    masses.assign(keys, 0.f);
    lows.assign(keys, 2.f);
    for (const auto& c : pool) {
      const int32_t b = key_of(c.first);
      counts[b] += 1;
      masses[b] += c.first;
      lows[b] = std::min(lows[b], c.first);
    }
    int32_t edge = -1;  // the bucket the filters stop in (-1: all of this pool is kept)
    int64_t kept_before_edge = kept;
    float prefix_before_edge = prefix;
    for (int32_t b = keys - 1; b >= 0; --b) {
      if (counts[b] == 0) continue;
      const bool whole = kept_before_edge + counts[b] <= top_k &&
                         !(by_p && prefix_before_edge + masses[b] - lows[b] > mass_p) && lows[b] >= min_p;
      if (!whole) {
        edge = b;
        break;
      }
      kept_before_edge += counts[b];
      prefix_before_edge += masses[b];
    }
    next.clear();
    whole_ids.clear();
    for (const auto& c : pool) {
      const int32_t b = key_of(c.first);
      if (edge < 0 || b > edge)
        whole_ids.push_back(c.second);
      else if (b == edge)
        next.push_back(c);
    }
    race_ids(whole_ids);
    kept = kept_before_edge, prefix = prefix_before_edge;
    pool.swap(next);
    if (edge < 0 || pool.size() <= 64) break;
  }
  std::sort(pool.begin(), pool.end(), [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (const auto& c : pool) {  // the filters in order: top-k, top-p (the mass before), min-p
    if (kept >= top_k || (by_p && prefix > mass_p) || c.first < min_p) break;
    race(c.second);
    kept += 1;
    prefix += c.first;
  }
  return where;
}

}  // namespace

namespace radixserve_sampling {

Rows::Rows(const at::Tensor& temperatures, const at::Tensor& top_ks, const at::Tensor& top_ps,
           const at::Tensor& min_ps, const at::Tensor& greedy, const at::Tensor& seeds, const at::Tensor& positions,
           int64_t rows)
    : t_(temperatures.to(at::kFloat).reshape({-1}).contiguous()),
      k_(top_ks.to(at::kLong).contiguous()),
      p_(top_ps.to(at::kFloat).contiguous()),
      mp_(min_ps.to(at::kFloat).contiguous()),
      g_(greedy.to(at::kBool).contiguous()),
      s_(seeds.to(at::kLong).contiguous()),
      pos_(positions.to(at::kLong).contiguous()),
      rows_(rows),
      steps_(seeds.dim() == 2 ? seeds.size(0) : 1) {
  for (const at::Tensor* v : {&t_, &k_, &p_, &mp_, &g_, &pos_})
    TORCH_CHECK(v->numel() == rows, "sample_rows: one value per row in every per-row tensor");
  TORCH_CHECK(s_.dim() <= 2 && s_.numel() == steps_ * rows && (s_.dim() < 2 || s_.size(1) == rows),
              "sample_rows: seeds must be [rows] or [steps, rows]");
}

int64_t Rows::pick(const float* l, int64_t n, int64_t r, int64_t step) const {
  const float temp = t_.const_data_ptr<float>()[r];
  if (g_.const_data_ptr<bool>()[r] || !(temp > 0.f)) return argmax_row(l, n);
  const float inv_t = 1.f / temp;
  const int64_t seed = s_.const_data_ptr<int64_t>()[std::min(step, steps_ - 1) * rows_ + r];
  const int64_t pos = pos_.const_data_ptr<int64_t>()[r] + step;
  const uint32_t key = row_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(pos));
  const int64_t k = k_.const_data_ptr<int64_t>()[r], top_k = k < 1 ? n : std::min(k, n);
  const float top_p = p_.const_data_ptr<float>()[r], min_p = mp_.const_data_ptr<float>()[r];
  if (top_k >= n && !(top_p < 1.f) && !(min_p > 0.f)) return race_row(l, n, inv_t, key);
  return filtered_row(l, n, inv_t, key, top_k, std::min(top_p, 1.f), std::max(min_p, 0.f));
}

}  // namespace radixserve_sampling

namespace {

// ids[B] (int64) for float32 logits [B, V]: greedy rows their first largest logit; the others sampled
// at temperatures[b] with their filters (top_ks[b] >= V, top_ps[b] >= 1 and min_ps[b] <= 0 for none)
// and the noise of (seeds[b], positions[b]).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& top_ks,
                       const at::Tensor& top_ps, const at::Tensor& min_ps, const at::Tensor& greedy,
                       const at::Tensor& seeds, const at::Tensor& positions) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows: logits must be float32 [rows, vocab]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n < (int64_t{1} << 31), "sample_rows: vocabulary too large");
  TORCH_CHECK(seeds.dim() == 1, "sample_rows: one seed per row");
  const radixserve_sampling::Rows spec(temperatures, top_ks, top_ps, min_ps, greedy, seeds, positions, rows);
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = spec.pick(xp + r * n, n, r, 0);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "sample_rows(Tensor logits, Tensor temperatures, Tensor top_ks, Tensor top_ps, Tensor min_ps, "
      "Tensor greedy, Tensor seeds, Tensor positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("sample_rows", &sample_rows); }
