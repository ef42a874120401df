// Fused elementwise kernels for CPUs: RMSNorm (optionally with the residual add before it),
// SiLU-and-mul and NeoX-style rotary embedding, each one pass over memory instead of several
// torch ops (at batch 1 a decode step is dominated by per-op overhead, not arithmetic); and the
// greedy sampler's argmax over a row of logits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_rowops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

using radixserve_cpu::to_float;
using radixserve_cpu::vexp;

namespace radixserve_rows {

template <typename T>
void rms_norm_row(const T* x, T* res, const T* w, int64_t h, float eps, T* dst) {
  const T* src = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < h; ++i) res[i] = static_cast<T>(to_float(x[i]) + to_float(res[i]));
    src = res;  // the norm reads the sum
  }
  float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
  for (int64_t i = 0; i < h; ++i) ss += to_float(src[i]) * to_float(src[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    const T normed = static_cast<T>(to_float(src[i]) * inv);
    dst[i] = static_cast<T>(to_float(w[i]) * to_float(normed));
  }
}

template <typename T>
void rotary_head(T* v, const float* c, const float* s, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const T x1 = v[i], x2 = v[i + half];
    const T c1 = static_cast<T>(c[i]), s1 = static_cast<T>(s[i]);
    const T c2 = static_cast<T>(c[i + half]), s2 = static_cast<T>(s[i + half]);
    const T a = static_cast<T>(to_float(x1) * to_float(c1));
    const T b = static_cast<T>(-to_float(x2) * to_float(s1));
    const T e = static_cast<T>(to_float(x2) * to_float(c2));
    const T f = static_cast<T>(to_float(x1) * to_float(s2));
    v[i] = static_cast<T>(to_float(a) + to_float(b));
    v[i + half] = static_cast<T>(to_float(e) + to_float(f));
  }
}

// bf16 through bit conversions the compiler vectorizes (c10's per-element rounding does not), in
// pieces of 256 in registers/L1; the same roundings as the generic loop: silu rounded to bf16, then
// the product rounded to bf16
void silu_mul_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t d) {
  constexpr int64_t kPiece = 256;
  alignas(64) float g[kPiece], u[kPiece];
  alignas(64) uint16_t s16[kPiece];
  for (int64_t i0 = 0; i0 < d; i0 += kPiece) {
    const int64_t n = std::min(kPiece, d - i0);
    radixserve_cpu::bf16_to_floats(gate + i0, g, n);
    radixserve_cpu::bf16_to_floats(up + i0, u, n);
_Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + vexp(-g[i]));
    radixserve_cpu::floats_to_bf16(g, s16, n);
    radixserve_cpu::bf16_to_floats(s16, g, n);
_Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) g[i] *= u[i];
    radixserve_cpu::floats_to_bf16(g, out + i0, n);
  }
}

#define RADIXSERVE_ROWS(T)                                                                   \
  template void rms_norm_row<T>(const T*, T*, const T*, int64_t, float, T*);                \
  template void rotary_head<T>(T*, const float*, const float*, int64_t);
RADIXSERVE_ROWS(float)
RADIXSERVE_ROWS(double)
RADIXSERVE_ROWS(c10::BFloat16)
RADIXSERVE_ROWS(c10::Half)
#undef RADIXSERVE_ROWS

}  // namespace radixserve_rows

// In place: residual += x; x = rmsnorm(residual) * weight. With no residual (undefined tensor):
// x = rmsnorm(x) * weight. Both [tokens, hidden], contiguous. Same operation order as HF: the norm
// in float32, cast to the activation dtype, then scaled by the weight.
void rms_norm(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs");
  const int64_t rows = x.size(0), h = x.size(1);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual shape");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = has_res ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        radixserve_rows::rms_norm_row(xp + t * h, rp != nullptr ? rp + t * h : nullptr, wp, h,
                                      static_cast<float>(eps), xp + t * h);
    });
  });
}

// out[t, i] = silu(x[t, i]) * x[t, d + i] for x [tokens, 2d].
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul: contiguous inputs");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) radixserve_rows::silu_mul_bf16(xp + t * 2 * d, xp + t * 2 * d + d, op + t * d, d);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = xp + t * 2 * d;
        const scalar_t* u = g + d;
        scalar_t* o = op + t * d;
_Pragma("omp simd")
        for (int64_t i = 0; i < d; ++i) {
          const float a = to_float(g[i]);
          const scalar_t s = static_cast<scalar_t>(a / (1.f + vexp(-a)));
          o[i] = static_cast<scalar_t>(to_float(s) * to_float(u[i]));
        }
      }
    });
  });
}

// In place NeoX rotary on x [tokens, heads * head_dim] (rows may be strided, e.g. a slice of a
// fused QKV output): the first rotary_dim of each head rotate by position's cos/sin
// ([max_pos, rotary_dim], halves duplicated), computed in the activation dtype like HF.
void rotary_neox(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache,
                 const at::Tensor& sin_cache, int64_t head_dim) {
  TORCH_CHECK(x.stride(1) == 1, "rotary_neox: rows must be contiguous");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && cos_cache.is_contiguous(), "rotary_neox: float32 caches");
  const int64_t rows = x.size(0), heads = x.size(1) / head_dim, rot = cos_cache.size(1);
  const int64_t row_stride = x.stride(0);
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_neox", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pp[t] * rot;
        const float* s = sp + pp[t] * rot;
        for (int64_t hd = 0; hd < heads; ++hd) radixserve_rows::rotary_head(xp + t * row_stride + hd * head_dim, c, s, rot);
      }
    });
  });
}

// Index of the largest value of a float row: the first one where several are (NaN counts as the
// largest, as torch.argmax has it). torch.argmax took 44 us for a 49152-token vocabulary on a 2-core
// Zen 4 (a scalar pass); this, 3-4.
int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  int64_t i = 0;
  __m512 best = _mm512_set1_ps(-INFINITY);
  bool nan = false;
  for (; i + 16 <= n && !nan; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
    best = _mm512_max_ps(best, v);
  }
  if (!nan && i > 0) {  // the max of x[0, i); then the tail, then the first index holding the max
    const float top = _mm512_reduce_max_ps(best);
    float tail = top;
    int64_t where = -1;
    for (int64_t j = i; j < n; ++j) {
      if (std::isnan(x[j])) return j;
      if (x[j] > tail) tail = x[j], where = j;
    }
    if (where >= 0) return where;
    const __m512 t = _mm512_set1_ps(top);
    for (int64_t j = 0; j < i; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_EQ_OQ);
      if (hit != 0) return j + __builtin_ctz(hit);
    }
  }
#endif
  int64_t where = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[where]) where = i;
  }
  return where;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [rows, vocab]");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_neox(Tensor(a!) x, Tensor positions, Tensor cos_cache, Tensor sin_cache, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("argmax_rows", &argmax_rows);
}
