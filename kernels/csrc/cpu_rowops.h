// Row-level pieces of the CPU kernels, for callers that run their own threads (the fused decode
// stack runs a whole decoder layer in one parallel region, cpu_decode_layer.cpp). Each is the body of
// the op of the same name, compiled once (cpu_norm_act.cpp, cpu_attention.cpp), so both paths execute
// the same instructions and agree bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace radixserve_rows {

// dst = rmsnorm(src) * w over h values, where src = x, or with a residual: res += x and src = res
// (rms_norm's row). dst may be x.
template <typename T>
void rms_norm_row(const T* x, T* res, const T* w, int64_t h, float eps, T* dst);

// NeoX rotary of one head (head_dim values at v) at a position's cos / sin rows (rot values).
template <typename T>
void rotary_head(T* v, const float* cos_row, const float* sin_row, int64_t rot);

// out[i] = silu(gate[i]) * up[i] for i < n (silu_and_mul's bf16 row).
void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);

// A decode batch's attention over the paged KV pool, in phases for a caller's threads: `store` writes
// the new tokens' K / V rows, `attend` runs this thread's share of the (request, KV head, split, query
// rows) tasks, `merge` combines the splits (only when splits > 1). The caller separates the phases by
// barriers. Bit for bit decode_attention + kv_store (a query row's arithmetic does not depend on which
// rows share its task).
class DecodeAttention {
 public:
  // Everything is checked here and in add_layer (before the parallel region: the phases throw nothing).
  DecodeAttention(const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                  const at::Tensor& out_cache_loc, int64_t heads, int64_t head_dim, int64_t kv_format,
                  int64_t num_splits, int64_t threads);
  void add_layer(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const c10::optional<at::Tensor>& k_scales,
                 const c10::optional<at::Tensor>& v_scales, double k_scale, double v_scale);
  // Token t's K (or V) row of one KV head into its slot of out_cache_loc.
  void store(int64_t layer, int64_t t, int64_t kv_head, bool value, const c10::BFloat16* row) const;
  void attend(int64_t layer, const c10::BFloat16* q, int64_t q_stride, c10::BFloat16* out, double scale,
              int64_t thread, int64_t threads);
  void merge(int64_t layer, c10::BFloat16* out, int64_t thread, int64_t threads);
  // Prefetches (into L2) the K / V rows (every KV head's) that attend will read on `thread` of `threads`,
  // their first kPrefetchBytes at most.
  static constexpr int64_t kPrefetchBytes = 64 * 1024;
  void prefetch(int64_t layer, int64_t thread, int64_t threads) const;
  // The next decode step of the same requests: every context one longer, the new tokens' K / V in
  // out_cache_loc's slots, contexts split num_splits ways (checked as the constructor and add_layer do).
  void next_step(const at::Tensor& out_cache_loc, int64_t num_splits);
  bool needs_merge() const { return splits_ > 1; }
  int64_t kv_heads() const { return kv_heads_; }

 private:
  struct Layer {
    at::Tensor k_buffer, v_buffer;
    c10::optional<at::Tensor> k_scales, v_scales;
    double k_scale, v_scale;
  };
  at::Tensor req_idx_, lens_, req_to_token_, slots_;
  int64_t batch_, heads_, d_, kv_heads_ = 0, group_ = 0, format_, splits_, parts_ = 1, threads_;
  bool own_lens_ = false;  // lens_ may share the caller's seq_lens until next_step copies it
  std::vector<Layer> layers_;
  std::vector<float> ml_, po_;  // per (request, KV head, split, group row): max and sum; output
  void shape();                 // parts_ and the split buffers for the batch, heads and splits
};

}  // namespace radixserve_rows
