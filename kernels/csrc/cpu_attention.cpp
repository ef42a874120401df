// Paged attention for CPUs, reading K and V in place from the per-layer pool through req_to_token.
//
// Layout (shared with kernels/reference.py): k_buffer, v_buffer [num_slots, kv_heads, head_dim];
// req_to_token[req_slot, position] is the KV slot of a token. Queries of one KV head's group are
// processed together, so each K and V row is read once per group (GQA without repeating K/V).
// Softmax is computed online in float32 over tiles of positions; decode splits long contexts into
// ranges processed in parallel and merged by log-sum-exp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using radixserve_cpu::to_float;
using radixserve_cpu::vexp;

constexpr int64_t kTile = 32;        // positions per softmax tile
constexpr int64_t kQueryBlock = 16;  // extend: query tokens per task
constexpr int64_t kPrefetch = 8;     // positions ahead whose K/V rows are prefetched
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Online-softmax attention of `rows` query rows (float, pre-scaled, [rows][d]) of one KV head over
// positions [start, end) of one request. Row r may see positions < limit[r]. Updates the running
// max m, sum l and unnormalized output acc ([rows][d]) of each row. kD > 0 fixes the head dim at
// compile time (fully unrolled inner loops); 0 takes it from `dim`.
template <typename T, int kD>
void attend_impl(const float* q, int64_t rows, const int64_t* limit, const T* kbuf, const T* vbuf, int64_t kv_heads,
                 int64_t head, int64_t dim, const int32_t* slots, int64_t start, int64_t end, float* m, float* l,
                 float* acc, std::vector<float>& scores) {
  const int64_t d = kD > 0 ? kD : dim;
  scores.resize(rows * kTile);
  float row[kD > 0 ? kD : 512];  // one K or V row converted to float, reused by every query row
  for (int64_t t0 = start; t0 < end; t0 += kTile) {
    const int64_t n = std::min(kTile, end - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = t0 + j;
      if (pos + kPrefetch < end) {  // slots are scattered: fetch every line of rows a few positions ahead
        const int64_t ahead = (static_cast<int64_t>(slots[pos + kPrefetch]) * kv_heads + head) * d;
        for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kbuf + ahead) + b);
          __builtin_prefetch(reinterpret_cast<const char*>(vbuf + ahead) + b);
        }
      }
      const T* krow = kbuf + (static_cast<int64_t>(slots[pos]) * kv_heads + head) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = to_float(krow[i]);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qr[i] * row[i];
        scores[r * kTile + j] = pos < limit[r] ? s : kNegInf;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sc = scores.data() + r * kTile;
      float tile_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
      if (tile_max == kNegInf) {
        std::fill(sc, sc + n, 0.f);
        continue;
      }
      const float m_new = std::max(m[r], tile_max);
      const float corr = m[r] == kNegInf ? 0.f : vexp(m[r] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float e = sc[j] == kNegInf ? 0.f : vexp(sc[j] - m_new);
        sc[j] = e;
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
    for (int64_t j = 0; j < n; ++j) {
      const T* vrow = vbuf + (static_cast<int64_t>(slots[t0 + j]) * kv_heads + head) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = to_float(vrow[i]);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * kTile + j];
        if (p == 0.f) continue;
        float* a = acc + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
      }
    }
  }
}

template <typename T>
void attend(const float* q, int64_t rows, const int64_t* limit, const T* kbuf, const T* vbuf, int64_t kv_heads,
            int64_t head, int64_t d, const int32_t* slots, int64_t start, int64_t end, float* m, float* l, float* acc,
            std::vector<float>& scores) {
  if (d == 64) {
    attend_impl<T, 64>(q, rows, limit, kbuf, vbuf, kv_heads, head, d, slots, start, end, m, l, acc, scores);
  } else if (d == 128) {
    attend_impl<T, 128>(q, rows, limit, kbuf, vbuf, kv_heads, head, d, slots, start, end, m, l, acc, scores);
  } else {
    TORCH_CHECK(d <= 512, "head_dim above 512 is not supported by the CPU attention kernels");
    attend_impl<T, 0>(q, rows, limit, kbuf, vbuf, kv_heads, head, d, slots, start, end, m, l, acc, scores);
  }
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

}  // namespace

// q, out: [batch, heads, dim]; seq_lens count the new token, whose KV is already in the pool.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      at::Tensor& out, double scale, int64_t num_splits) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, out);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  const int64_t splits = std::max<int64_t>(1, num_splits);
  const PageTable pages(req_to_token, req_pool_indices, seq_lens);
  // partial results per (request, kv head, split): running max, sum, and output
  auto part_ml = at::empty({batch, kv_heads, splits, group, 2}, q.options().dtype(at::kFloat));
  auto part_o = at::empty({batch, kv_heads, splits, group, d}, q.options().dtype(at::kFloat));
  float* ml = part_ml.data_ptr<float>();
  float* po = part_o.data_ptr<float>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_buffer.scalar_type(), "decode_attention", [&] {
    using kv_t = scalar_t;
    const kv_t* kbuf = k_buffer.data_ptr<kv_t>();
    const kv_t* vbuf = v_buffer.data_ptr<kv_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_q", [&] {
      const scalar_t* qp = q.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, batch * kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(group * d), scores;
        std::vector<int64_t> limit(group);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / (kv_heads * splits), h = (task / splits) % kv_heads, s = task % splits;
          const int64_t len = pages.seq_len(b), chunk = (len + splits - 1) / splits;
          const int64_t lo = std::min(len, s * chunk), hi = std::min(len, lo + chunk);
          float* m = ml + task * group * 2;  // [group][2]: max, sum
          float* acc = po + task * group * d;
          std::vector<float> mm(group, kNegInf), ll(group, 0.f);
          std::fill(acc, acc + group * d, 0.f);
          load_query(qp + (b * heads + h * group) * d, group, d, static_cast<float>(scale), qf.data());
          std::fill(limit.begin(), limit.end(), len);
          attend<kv_t>(qf.data(), group, limit.data(), kbuf, vbuf, kv_heads, h, d, pages.slots(b), lo, hi, mm.data(),
                       ll.data(), acc, scores);
          for (int64_t g = 0; g < group; ++g) {
            m[2 * g] = mm[g];
            m[2 * g + 1] = ll[g];
          }
        }
      });
      // merge the splits of each (request, head) by log-sum-exp
      at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> o(d);
        for (int64_t bh = begin; bh < end; ++bh) {
          const int64_t b = bh / kv_heads, h = bh % kv_heads;
          for (int64_t g = 0; g < group; ++g) {
            float gmax = kNegInf;
            for (int64_t s = 0; s < splits; ++s) gmax = std::max(gmax, ml[((bh * splits + s) * group + g) * 2]);
            std::fill(o.begin(), o.end(), 0.f);
            float total = 0.f;
            for (int64_t s = 0; s < splits; ++s) {
              const float* mls = ml + ((bh * splits + s) * group + g) * 2;
              if (mls[0] == kNegInf) continue;
              const float w = std::exp(mls[0] - gmax);
              total += w * mls[1];
              const float* a = po + ((bh * splits + s) * group + g) * d;
              for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
            }
            scalar_t* dst = op + (b * heads + h * group + g) * d;
            const float inv = total > 0.f ? 1.f / total : 0.f;
            for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(o[i] * inv);
          }
        }
      });
    });
  });
}

// q, out: [tokens, heads, dim], the new tokens of each request packed in batch order (their KV
// already in the pool). Token i of request b sits at position prefix_b + i and attends causally.
void extend_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      const at::Tensor& extend_start_loc, const at::Tensor& extend_seq_lens, at::Tensor& out,
                      double scale) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, out);
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_buffer.size(1), group = heads / kv_heads;
  const PageTable pages(req_to_token, req_pool_indices, seq_lens);
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

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_buffer.scalar_type(), "extend_attention", [&] {
    using kv_t = scalar_t;
    const kv_t* kbuf = k_buffer.data_ptr<kv_t>();
    const kv_t* vbuf = v_buffer.data_ptr<kv_t>();
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
              load_query(qp + ((sloc[t.b] + i) * heads + t.h * group + g) * d, 1, d, static_cast<float>(scale),
                         qf.data() + r * d);
              limit[r] = prefix + i + 1;
            }
          }
          attend<kv_t>(qf.data(), rows, limit.data(), kbuf, vbuf, kv_heads, t.h, d, pages.slots(t.b), 0, prefix + t.q1,
                       m.data(), l.data(), acc.data(), scores);
          for (int64_t i = t.q0; i < t.q1; ++i) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t r = (i - t.q0) * group + g;
              scalar_t* dst = op + ((sloc[t.b] + i) * heads + t.h * group + g) * d;
              const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
              for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(acc[r * d + x] * inv);
            }
          }
        }
      });
    });
  });
}

TORCH_LIBRARY(radixserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor(a!) out, float scale, int num_splits) -> ()");
  m.def(
      "extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor extend_start_loc, Tensor extend_seq_lens, Tensor(a!) out, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("extend_attention", &extend_attention);
}
