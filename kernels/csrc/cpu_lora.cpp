// Segment-batched LoRA for CPUs (srt/lora): a batch's rows form segments, each of one adapter's pool
// slot, and a LoRA layer adds (x[seg] @ A[slot].T) @ Bt[slot] to its base output on each segment's
// rows. torch's small GEMMs cost 20-60 us each in dispatch and packing, and a decode batch over 8
// adapters needs 2 per adapter per projection per layer; these kernels do a whole projection in one
// call: blocks of 4 rows, each block's x (as float) against every row of A (the ranks), then the
// ranks against Bt's rows (axpy over the output features), accumulated in float32.
//
// Layout (float32, contiguous): A [slots, K, in], Bt [slots, K, out] (K = stacked ranks: fused
// projections keep each part's rank in its own block of K). x and out: [T, in] / [T, out] in the
// activation dtype. `segs` is flat: slot, start, length per segment. Rows in no segment are untouched.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <vector>

using radixserve_cpu::to_float;

namespace {

constexpr int64_t kRows = 4;

struct Block {
  int64_t slot, start, rows;
};

std::vector<Block> blocks_of(at::IntArrayRef segs) {
  TORCH_CHECK(segs.size() % 3 == 0, "lora: segs holds (slot, start, length) triples");
  std::vector<Block> blocks;
  for (size_t g = 0; g < segs.size(); g += 3) {
    for (int64_t r = 0; r < segs[g + 2]; r += kRows) {
      blocks.push_back({segs[g], segs[g + 1] + r, std::min(kRows, segs[g + 2] - r)});
    }
  }
  return blocks;
}

// xa[r, k] = x[r] . A[k] for the block's rows (xb: kRows rows of `in` floats, unused rows zero).
void shrink_block(const float* xb, int64_t in, const float* A, int64_t K, float* xa) {
  for (int64_t k = 0; k < K; ++k) {
    const float* a = A + k * in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
_Pragma("omp simd reduction(+ : s0, s1, s2, s3)")
    for (int64_t i = 0; i < in; ++i) {
      const float av = a[i];
      s0 += av * xb[i];
      s1 += av * xb[in + i];
      s2 += av * xb[2 * in + i];
      s3 += av * xb[3 * in + i];
    }
    xa[k] = s0;
    xa[K + k] = s1;
    xa[2 * K + k] = s2;
    xa[3 * K + k] = s3;
  }
}

// acc[r] = sum_k xa[r, k] * Bt[k] for the block's rows.
void expand_block(const float* xa, int64_t K, const float* Bt, int64_t n_out, float* acc) {
  std::fill(acc, acc + kRows * n_out, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float c0 = xa[k], c1 = xa[K + k], c2 = xa[2 * K + k], c3 = xa[3 * K + k];
    if (c0 == 0.f && c1 == 0.f && c2 == 0.f && c3 == 0.f) continue;  // padding ranks of smaller adapters
    const float* b = Bt + k * n_out;
_Pragma("omp simd")
    for (int64_t o = 0; o < n_out; ++o) {
      const float bv = b[o];
      acc[o] += c0 * bv;
      acc[n_out + o] += c1 * bv;
      acc[2 * n_out + o] += c2 * bv;
      acc[3 * n_out + o] += c3 * bv;
    }
  }
}

void check_pool(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "lora: ", name, " must be a contiguous float32 [slots, K, features] pool");
}

template <typename scalar_t>
void load_block(const scalar_t* x, const Block& b, int64_t in, float* xb) {
  std::fill(xb, xb + kRows * in, 0.f);
  for (int64_t r = 0; r < b.rows; ++r) {
    const scalar_t* row = x + (b.start + r) * in;
    for (int64_t i = 0; i < in; ++i) xb[r * in + i] = to_float(row[i]);
  }
}

template <typename scalar_t>
void add_block(scalar_t* out, const Block& b, int64_t n_out, const float* acc) {
  for (int64_t r = 0; r < b.rows; ++r) {
    scalar_t* row = out + (b.start + r) * n_out;
    for (int64_t o = 0; o < n_out; ++o) row[o] = static_cast<scalar_t>(to_float(row[o]) + acc[r * n_out + o]);
  }
}

}  // namespace

// out[seg rows] += (x @ A[slot].T) @ Bt[slot], all segments.
void lora_apply(const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt, at::Tensor& out, at::IntArrayRef segs) {
  check_pool(A, "A");
  check_pool(Bt, "Bt");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "lora_apply: x, out");
  TORCH_CHECK(x.size(1) == A.size(2) && out.size(1) == Bt.size(2) && A.size(1) == Bt.size(1) &&
                  x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "lora_apply: shapes");
  const int64_t in = x.size(1), K = A.size(1), n_out = out.size(1), slots = A.size(0);
  const std::vector<Block> blocks = blocks_of(segs);
  for (const Block& b : blocks) TORCH_CHECK(b.slot >= 0 && b.slot < slots && b.start + b.rows <= x.size(0), "lora: segment");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* ap = A.data_ptr<float>();
    const float* bp = Bt.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xb(kRows * in), xa(kRows * K), acc(kRows * n_out);
      for (int64_t j = begin; j < end; ++j) {
        const Block& b = blocks[j];
        load_block(xp, b, in, xb.data());
        shrink_block(xb.data(), in, ap + b.slot * K * in, K, xa.data());
        expand_block(xa.data(), K, bp + b.slot * K * n_out, n_out, acc.data());
        add_block(op, b, n_out, acc.data());
      }
    });
  });
}

// xa [T, K] float32 (zero outside the segments) = x @ A[slot].T: the first half, for tensor-parallel
// row-parallel layers, whose partial xa is all-reduced before lora_expand.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& A, at::IntArrayRef segs) {
  check_pool(A, "A");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == A.size(2), "lora_shrink: x");
  const int64_t in = x.size(1), K = A.size(1);
  at::Tensor xa = at::zeros({x.size(0), K}, x.options().dtype(at::kFloat));
  const std::vector<Block> blocks = blocks_of(segs);
  for (const Block& b : blocks) TORCH_CHECK(b.slot >= 0 && b.slot < A.size(0) && b.start + b.rows <= x.size(0), "lora: segment");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_shrink", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float* ap = A.data_ptr<float>();
    float* xap = xa.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xb(kRows * in), part(kRows * K);
      for (int64_t j = begin; j < end; ++j) {
        const Block& b = blocks[j];
        load_block(xp, b, in, xb.data());
        shrink_block(xb.data(), in, ap + b.slot * K * in, K, part.data());
        std::copy(part.begin(), part.begin() + b.rows * K, xap + b.start * K);
      }
    });
  });
  return xa;
}

void lora_expand(const at::Tensor& xa, const at::Tensor& Bt, at::Tensor& out, at::IntArrayRef segs) {
  check_pool(Bt, "Bt");
  TORCH_CHECK(xa.scalar_type() == at::kFloat && xa.is_contiguous() && xa.size(1) == Bt.size(1), "lora_expand: xa");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == Bt.size(2) && out.size(0) == xa.size(0),
              "lora_expand: out");
  const int64_t K = Bt.size(1), n_out = out.size(1);
  const std::vector<Block> blocks = blocks_of(segs);
  for (const Block& b : blocks) TORCH_CHECK(b.slot >= 0 && b.slot < Bt.size(0) && b.start + b.rows <= out.size(0), "lora: segment");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "lora_expand", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* xap = xa.data_ptr<float>();
    const float* bp = Bt.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> part(kRows * K, 0.f), acc(kRows * n_out);
      for (int64_t j = begin; j < end; ++j) {
        const Block& b = blocks[j];
        std::fill(part.begin(), part.end(), 0.f);
        std::copy(xap + b.start * K, xap + (b.start + b.rows) * K, part.begin());
        expand_block(part.data(), K, bp + b.slot * K * n_out, n_out, acc.data());
        add_block(op, b, n_out, acc.data());
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("lora_apply(Tensor x, Tensor A, Tensor Bt, Tensor(a!) out, int[] segs) -> ()");
  m.def("lora_shrink(Tensor x, Tensor A, int[] segs) -> Tensor");
  m.def("lora_expand(Tensor xa, Tensor Bt, Tensor(a!) out, int[] segs) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("lora_apply", &lora_apply);
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}
