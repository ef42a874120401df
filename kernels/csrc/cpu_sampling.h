// The sampler's row pass (cpu_sampling.cpp), for the ops that sample inside their own loops (the
// decode stack's continuous decode steps, cpu_decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace radixserve_sampling {

// A batch's per-row sampling settings, as sample_rows takes them: temperatures, top_ks, top_ps,
// min_ps, greedy and positions one value per row; seeds one per row, or [steps, rows] (one per row
// and step). Checked and read once.
class Rows {
 public:
  Rows(const at::Tensor& temperatures, const at::Tensor& top_ks, const at::Tensor& top_ps, const at::Tensor& min_ps,
       const at::Tensor& greedy, const at::Tensor& seeds, const at::Tensor& positions, int64_t rows);
  // Row r's next token from its logits l[0, n) at step `step`: its seed of that step (seeds[step][r], or
  // seeds[r]) and its position + step. Thread-safe (scratch space is per thread).
  int64_t pick(const float* l, int64_t n, int64_t r, int64_t step) const;
  int64_t steps() const { return steps_; }

 private:
  at::Tensor t_, k_, p_, mp_, g_, s_, pos_;
  int64_t rows_, steps_;
};

}  // namespace radixserve_sampling
