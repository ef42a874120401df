// Segment-batched LoRA for CPUs (srt/lora): a batch's rows form segments, each of one adapter's pool
// slot, and a LoRA layer adds (x[seg] @ A[slot].T) @ Bt[slot] to its base output on each segment's
// rows. torch's small GEMMs cost 20-60 us each in dispatch and packing, and a decode batch over 8
// adapters needs 2 per adapter per projection per layer; these kernels do a whole projection in one
// call: blocks of 4 rows, each block's x (as float) against the rows of A (the ranks; 4 ranks x 4
// rows of sums at a time), then the ranks against Bt (32 output features x 4 rows of sums held over
// the rank loop), accumulated in float32. Long segments (prefill) go to torch's GEMMs instead
// (srt/lora/backend.py).
//
// Layout (float32, contiguous): A [slots, K, in], Bt [slots, K, out] (K = stacked ranks: a fused
// projection's part p has its rank in rows [p * K / P, (p + 1) * K / P) and its output features in
// the p-th of `parts`, the output sizes of its P parts). x and out: [T, in] / [T, out] in the
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

// xa[r, k] = x[r] . A[k] for the block's rows (xb: kRows rows of `in` floats, unused rows zero):
// 4 ranks x 4 rows at a time, 16 running sums, so each loaded element of A and x feeds 4 products.
void shrink_block(const float* xb, int64_t in, const float* A, int64_t K, float* xa) {
  const float *x0 = xb, *x1 = xb + in, *x2 = xb + 2 * in, *x3 = xb + 3 * in;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float *a0 = A + k * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
    float s00 = 0.f, s01 = 0.f, s02 = 0.f, s03 = 0.f, s10 = 0.f, s11 = 0.f, s12 = 0.f, s13 = 0.f;
    float s20 = 0.f, s21 = 0.f, s22 = 0.f, s23 = 0.f, s30 = 0.f, s31 = 0.f, s32 = 0.f, s33 = 0.f;
_Pragma("omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)")
    for (int64_t i = 0; i < in; ++i) {
      const float v0 = x0[i], v1 = x1[i], v2 = x2[i], v3 = x3[i];
      s00 += a0[i] * v0; s01 += a0[i] * v1; s02 += a0[i] * v2; s03 += a0[i] * v3;
      s10 += a1[i] * v0; s11 += a1[i] * v1; s12 += a1[i] * v2; s13 += a1[i] * v3;
      s20 += a2[i] * v0; s21 += a2[i] * v1; s22 += a2[i] * v2; s23 += a2[i] * v3;
      s30 += a3[i] * v0; s31 += a3[i] * v1; s32 += a3[i] * v2; s33 += a3[i] * v3;
    }
    const float sums[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t r = 0; r < kRows; ++r) xa[r * K + k + j] = sums[j][r];
  }
  for (; k < K; ++k) {
    const float* a = A + k * in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
_Pragma("omp simd reduction(+ : s0, s1, s2, s3)")
    for (int64_t i = 0; i < in; ++i) {
      const float av = a[i];
      s0 += av * x0[i];
      s1 += av * x1[i];
      s2 += av * x2[i];
      s3 += av * x3[i];
    }
    xa[k] = s0;
    xa[K + k] = s1;
    xa[2 * K + k] = s2;
    xa[3 * K + k] = s3;
  }
}

// acc[r] = sum_k xa[r, k] * Bt[k] for the block's rows: 32 output features at a time, their 4 x 32
// sums held in registers over the rank loop (Bt read once per block, acc written once). A fused
// projection's part p (its `parts[p]` output features) reads only its own ranks [p * R, (p + 1) * R):
// the rest of Bt's column block is zero.
void expand_block(const float* xa, int64_t K, const float* Bt, int64_t n_out, at::IntArrayRef parts, float* acc) {
  constexpr int64_t W = 32;
  const int64_t R = K / static_cast<int64_t>(parts.size());
  int64_t col = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t k0 = static_cast<int64_t>(p) * R, k1 = k0 + R, end = col + parts[p];
    int64_t o0 = col;
    for (; o0 + W <= end; o0 += W) {
      float t0[W] = {}, t1[W] = {}, t2[W] = {}, t3[W] = {};
      for (int64_t k = k0; k < k1; ++k) {
        const float c0 = xa[k], c1 = xa[K + k], c2 = xa[2 * K + k], c3 = xa[3 * K + k];
        const float* b = Bt + k * n_out + o0;
_Pragma("omp simd")
        for (int64_t j = 0; j < W; ++j) {
          t0[j] += c0 * b[j];
          t1[j] += c1 * b[j];
          t2[j] += c2 * b[j];
          t3[j] += c3 * b[j];
        }
      }
      std::copy(t0, t0 + W, acc + o0);
      std::copy(t1, t1 + W, acc + n_out + o0);
      std::copy(t2, t2 + W, acc + 2 * n_out + o0);
      std::copy(t3, t3 + W, acc + 3 * n_out + o0);
    }
    for (int64_t o = o0; o < end; ++o) {  // the part's tail
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t k = k0; k < k1; ++k) {
        const float bv = Bt[k * n_out + o];
        s0 += xa[k] * bv;
        s1 += xa[K + k] * bv;
        s2 += xa[2 * K + k] * bv;
        s3 += xa[3 * K + k] * bv;
      }
      acc[o] = s0;
      acc[n_out + o] = s1;
      acc[2 * n_out + o] = s2;
      acc[3 * n_out + o] = s3;
    }
    col = end;
  }
}

void check_parts(at::IntArrayRef parts, int64_t K, int64_t n_out) {
  int64_t total = 0;
  for (int64_t p : parts) total += p;
  TORCH_CHECK(!parts.empty() && K % static_cast<int64_t>(parts.size()) == 0 && total == n_out,
              "lora: parts must split the output features, one rank block of K each");
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
void lora_apply(const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt, at::Tensor& out, at::IntArrayRef segs,
                at::IntArrayRef parts) {
  check_pool(A, "A");
  check_pool(Bt, "Bt");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "lora_apply: x, out");
  TORCH_CHECK(x.size(1) == A.size(2) && out.size(1) == Bt.size(2) && A.size(1) == Bt.size(1) &&
                  x.size(0) == out.size(0) && x.scalar_type() == out.scalar_type(),
              "lora_apply: shapes");
  const int64_t in = x.size(1), K = A.size(1), n_out = out.size(1), slots = A.size(0);
  check_parts(parts, K, n_out);
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
        expand_block(xa.data(), K, bp + b.slot * K * n_out, n_out, parts, acc.data());
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

void lora_expand(const at::Tensor& xa, const at::Tensor& Bt, at::Tensor& out, at::IntArrayRef segs,
                 at::IntArrayRef parts) {
  check_pool(Bt, "Bt");
  TORCH_CHECK(xa.scalar_type() == at::kFloat && xa.is_contiguous() && xa.size(1) == Bt.size(1), "lora_expand: xa");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == Bt.size(2) && out.size(0) == xa.size(0),
              "lora_expand: out");
  const int64_t K = Bt.size(1), n_out = out.size(1);
  check_parts(parts, K, n_out);
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
        expand_block(part.data(), K, bp + b.slot * K * n_out, n_out, parts, acc.data());
        add_block(op, b, n_out, acc.data());
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("lora_apply(Tensor x, Tensor A, Tensor Bt, Tensor(a!) out, int[] segs, int[] parts) -> ()");
  m.def("lora_shrink(Tensor x, Tensor A, int[] segs) -> Tensor");
  m.def("lora_expand(Tensor xa, Tensor Bt, Tensor(a!) out, int[] segs, int[] parts) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("lora_apply", &lora_apply);
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}
