// The lean decode kernels' building blocks, shared by the decode stack (cpu_decode_layer.cpp: a step's
// layers in one parallel region) and the quantized MoE op (cpu_moe.cpp: a decode step's experts in
// one parallel region): a projection's weight segments multiplied row range by row range with the
// kernels quant_linear itself picks, the activations in the forms those kernels take, and the
// work-stealing unit dispenser of a phase.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_i16act.h"
#include "cpu_sync.h"
#include "cpu_qvnni.h"

int64_t quant_decode_kernel(int64_t qtype, int64_t k, at::ScalarType dtype, int64_t m);
bool quant_q8_tiles_split(int64_t m);

#if defined(RADIXSERVE_HAVE_QVNNI) || defined(RADIXSERVE_HAVE_I16ACT)
#define RADIXSERVE_LEAN_DECODE 1
#endif

#if defined(RADIXSERVE_LEAN_DECODE)
namespace radixserve_lean {

// GGML types the decode kernels below take, and their blocks: (weights, bytes).
inline bool lean_geometry(int64_t qtype, int64_t& block, int64_t& bytes) {
  switch (qtype) {
    case 2: block = 32, bytes = 18; return true;    // Q4_0
    case 3: block = 32, bytes = 20; return true;    // Q4_1
    case 8: block = 32, bytes = 34; return true;    // Q8_0
    case 12: block = 256, bytes = 144; return true;  // Q4_K
    case 13: block = 256, bytes = 176; return true;  // Q5_K
    case 14: block = 256, bytes = 210; return true;  // Q6_K
    case 258: block = 32, bytes = 18; return true;   // Q4_0 in row tiles (cpu_rowtiles.h)
    case 259: block = 32, bytes = 20; return true;   // Q4_1 in row tiles
    default: return false;
  }
}

// A projection's weight segments (stacked along N), each multiplied by the kernel quant_linear takes
// for it (quant_decode_kernel): 1 the int8 GEMV, 2 the int16-activation dots, 3 the row tiles' GEMV.
struct LeanLinear {
  // tensors, not pointers: the weights move to huge-page memory after loading (Tensor.set_)
  struct Seg {
    at::Tensor w;
    int64_t rows, row_bytes, col, qtype;
    int64_t kind = 0;
#if defined(RADIXSERVE_HAVE_I16ACT)
    radixserve_i16act::DotFn dots[4] = {nullptr, nullptr, nullptr, nullptr};
#endif
  };
  std::vector<Seg> segs;
  int64_t n = 0, k = 0;
  at::Tensor bias;
  bool int8 = false, int16 = false, plain = false;  // the activation forms the chosen kernels take

  static bool supported(const std::vector<at::Tensor>& w, const std::vector<int64_t>& t, int64_t k) {
    if (w.empty() || k % 32 != 0) return false;
    for (size_t i = 0; i < w.size(); ++i) {
      int64_t block = 0, bytes = 0;
      if (!lean_geometry(t[i], block, bytes) || k % block != 0 || w[i].scalar_type() != at::kByte ||
          w[i].dim() != 2 || !w[i].is_contiguous() || w[i].size(1) != k / block * bytes)
        return false;
    }
    return true;
  }

  LeanLinear(const std::vector<at::Tensor>& w, const std::vector<int64_t>& t, int64_t k_,
             const c10::optional<at::Tensor>& b)
      : k(k_) {
    for (size_t i = 0; i < w.size(); ++i) {
      segs.push_back({w[i], w[i].size(0), w[i].size(1), n, t[i]});
      n += w[i].size(0);
    }
    if (b.has_value()) bias = *b;
  }

  // Whether every segment has a kernel here for m rows of bf16 activations now (the ISA and the int8
  // mode can change at run time).
  bool runnable(int64_t m) const {
    for (const Seg& s : segs)
      if (quant_decode_kernel(s.qtype, k, at::kBFloat16, m) == 0) return false;
    return true;
  }

  // The kernels for m rows (before the parallel region).
  void choose(int64_t m) {
    int8 = int16 = plain = false;
    for (Seg& s : segs) {
      s.kind = quant_decode_kernel(s.qtype, k, at::kBFloat16, m);
      int8 |= s.kind == 1;
      int16 |= s.kind == 2;
      plain |= s.kind == 3;
#if defined(RADIXSERVE_HAVE_I16ACT)
      if (s.kind == 2)
        for (int r = 1; r <= 4; ++r) s.dots[r - 1] = radixserve_i16act::dot_for(s.qtype, r);
#endif
    }
  }

  // Prefetches (into L2) up to `bytes` of the weight from row c0 on (a multiple of 16 where rows are tiled),
  // in memory order.
  void prefetch_rows(int64_t c0, int64_t bytes) const {
    for (const Seg& s : segs) {
      if (bytes <= 0) return;
      const int64_t b = std::max(c0, s.col) - s.col;
      if (b >= s.rows) continue;
      const uint8_t* w = static_cast<const uint8_t*>(s.w.const_data_ptr()) + b * s.row_bytes;
      const int64_t n = std::min(bytes, (s.rows - b) * s.row_bytes);
      for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(w + o, 0, 2);
      bytes -= n;
    }
  }

  // Rows [c0, c1) of x (m rows) @ W.T into out (row stride ldo), and the bias: each row as quant_linear
  // computes it, and the bias as bf16 add_ does (float sum, rounded).
  template <class Acts>
  void rows(const Acts& x, int64_t m, int64_t c0, int64_t c1, c10::BFloat16* out, int64_t ldo) const {
    for (const Seg& s : segs) {
      const uint8_t* w = static_cast<const uint8_t*>(s.w.const_data_ptr());
      const int64_t b = std::max(c0, s.col) - s.col, e = std::min(c1, s.col + s.rows) - s.col;
      if (b >= e) continue;
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
      if (s.kind == 1) {
        for (int64_t j0 = b; j0 < e; j0 += 64) {
          const int64_t j1 = std::min(e, j0 + 64);
          for (int64_t r = 0; r < m; r += radixserve_qvnni::kGemvRows) {
            const int rows = static_cast<int>(std::min<int64_t>(radixserve_qvnni::kGemvRows, m - r));
            if (s.qtype == 3)
              radixserve_qvnni::gemv_range_rows<true>(rows, w, s.row_bytes, j0, j1, k / 32, x.g, r, out + s.col, ldo);
            else
              radixserve_qvnni::gemv_range_rows<false>(rows, w, s.row_bytes, j0, j1, k / 32, x.g, r, out + s.col, ldo);
          }
        }
      }
#endif
#if defined(RADIXSERVE_HAVE_QVNNI)
      if (s.kind == 3)
        radixserve_qvnni::tile_range(w, s.row_bytes, s.rows / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows,
                                     s.qtype == 259, b, e, x.p, m, out + s.col, ldo);
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
      if (s.kind == 2) {
        float res[4];
        for (int64_t j = b; j < e; ++j)
          for (int64_t r = 0; r < m; r += 4) {
            const int rows = static_cast<int>(std::min<int64_t>(4, m - r));
            s.dots[rows - 1](w + j * s.row_bytes, x.a16, r, res);
            for (int i = 0; i < rows; ++i) out[(r + i) * ldo + s.col + j] = static_cast<c10::BFloat16>(res[i]);
          }
      }
#endif
    }
    if (!bias.defined()) return;
    const c10::BFloat16* bp = static_cast<const c10::BFloat16*>(bias.const_data_ptr());
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = c0; j < c1; ++j)
        out[t * ldo + j] = static_cast<c10::BFloat16>(static_cast<float>(out[t * ldo + j]) + static_cast<float>(bp[j]));
  }
};

// Activations in the forms the kernels take: `g` (int8, group layout), `p` (int8 per block, rows as
// they are) and `a16` (int16 per block).
struct LeanX {
#if defined(RADIXSERVE_HAVE_QVNNI)
  radixserve_qvnni::Acts p{nullptr, nullptr, nullptr, 0, 0};
#endif
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  radixserve_qvnni::GroupActs g{nullptr, nullptr, 0};
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
  radixserve_i16act::Acts a16{nullptr, nullptr, nullptr, 0};
#endif
};

// One thread's activations of m rows of k values, made as quant_linear makes them: int8 per block then
// the group layout (and the pre-spread scales), int16 per block from the float values.
struct LeanActs {
  std::vector<int8_t> q, gq;
  std::vector<float> ds, gds, spread, xf, d16;
  std::vector<int16_t> q16;

  LeanX make(const c10::BFloat16* x, int64_t m, int64_t k, const LeanLinear& W) {
    LeanX out;
    const int64_t nb = k / 32;
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (W.int8 || W.plain) {
      q.resize(m * k);
      ds.resize(2 * m * nb);
      radixserve_qvnni::quantize(x, m, k, q.data(), ds.data(), ds.data() + m * nb);
      out.p = {q.data(), ds.data(), ds.data() + m * nb, k, nb};
    }
#endif
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
    if (W.int8) {
      const int64_t groups = radixserve_qvnni::groups_for(k);
      gq.resize(m * groups * 128);
      gds.resize(m * groups * 8);
      const radixserve_qvnni::Acts& a = out.p;
      for (int64_t r = 0; r < m; ++r)
        radixserve_qvnni::group_row(a, r, gq.data() + r * groups * 128, gds.data() + r * groups * 8);
      out.g = with_spread({gq.data(), gds.data(), groups}, m, k);
    }
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
    if (W.int16) {
      xf.resize(m * k);
      q16.resize(m * k);
      d16.resize(2 * m * nb);
      for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(x[i]);
      for (int64_t r = 0; r < m; ++r)
        radixserve_i16act::prepare_row(xf.data() + r * k, k, q16.data() + r * k, d16.data() + r * nb,
                                       d16.data() + (m + r) * nb);
      out.a16 = {q16.data(), d16.data(), d16.data() + m * nb, nb};
    }
#endif
    (void)x, (void)m, (void)nb, (void)W;
    return out;
  }

#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  // x's `spread` where quant_linear would use one (same results either way: the same products).
  radixserve_qvnni::GroupActs with_spread(radixserve_qvnni::GroupActs x, int64_t m, int64_t k) {
    if (k > radixserve_qvnni::kSpreadMaxK) return x;
    spread.resize(m * x.groups * 32);
    for (int64_t r = 0; r < m; ++r)
      radixserve_qvnni::spread_row(x.ds + r * x.groups * 8, x.groups, spread.data() + r * x.groups * 32);
    x.spread = spread.data();
    return x;
  }
#endif
};

// The down projection's activations, written per group of 128 inputs by whichever thread ran that
// group's SiLU: the int8 group layout, int8 blocks as they are and / or int16 blocks, as its kernels
// take them.
struct DownActs {
  int64_t T, k, nb, groups;
  std::vector<int8_t> gq, pq;
  std::vector<float> gds, d16, pds;
  std::vector<int16_t> q16;

  DownActs(int64_t T_, int64_t k_, bool int8, bool int16, bool plain)
      : T(T_), k(k_), nb(k_ / 32), groups((k_ + 127) / 128) {
    if (int8) gq.resize(T * groups * 128), gds.resize(T * groups * 8);
    if (int16) q16.resize(T * k), d16.resize(2 * T * nb);
    if (plain) pq.resize(T * k), pds.resize(2 * T * nb);
  }

  // Row t's inputs of group g (its 4 blocks), from the bf16 values at x (the row).
  void write(int64_t t, int64_t g, const c10::BFloat16* x) {
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (!pq.empty())
      for (int64_t b = 4 * g; b < std::min(nb, 4 * g + 4); ++b)
        radixserve_qvnni::quantize_block(x + 32 * b, pq.data() + t * k + 32 * b, pds.data() + t * nb + b,
                                         pds.data() + (T + t) * nb + b);
#endif
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
    if (!gq.empty()) quantize_groups(x, g, gq.data() + t * groups * 128, gds.data() + t * groups * 8);
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
    if (!q16.empty()) {
      const int64_t b0 = 4 * g, b1 = std::min(nb, b0 + 4);
      alignas(64) float f[128];
      for (int64_t i = 0; i < (b1 - b0) * 32; ++i) f[i] = static_cast<float>(x[b0 * 32 + i]);
      radixserve_i16act::prepare_row(f, (b1 - b0) * 32, q16.data() + t * k + b0 * 32, d16.data() + t * nb + b0,
                                     d16.data() + (T + t) * nb + b0);
    }
#endif
    (void)t, (void)g, (void)x;
  }

  LeanX acts(LeanActs& own, int64_t m) {
    LeanX out;
#if defined(RADIXSERVE_HAVE_QVNNI)
    if (!pq.empty()) out.p = {pq.data(), pds.data(), pds.data() + T * nb, k, nb};
#endif
#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
    if (!gq.empty()) out.g = own.with_spread({gq.data(), gds.data(), groups}, m, k);
#endif
#if defined(RADIXSERVE_HAVE_I16ACT)
    if (!q16.empty()) out.a16 = {q16.data(), d16.data(), d16.data() + T * nb, nb};
#endif
    (void)own, (void)m;
    return out;
  }

#if defined(RADIXSERVE_HAVE_QVNNI_GEMV)
  // Group g of row x quantized straight into the group layout (group_row's bytes).
  void quantize_groups(const c10::BFloat16* x, int64_t g, int8_t* q, float* ds) const {
    alignas(64) int8_t qb[32];
    int8_t* qg = q + g * 128;
    for (int j = 0; j < 4; ++j) {
      const int64_t b = 4 * g + j;
      float d = 0.f, sum = 0.f;
      if (b < nb) {
        radixserve_qvnni::quantize_block(x + 32 * b, qb, &d, &sum);
        std::memcpy(qg + 16 * j, qb, 16);
        std::memcpy(qg + 64 + 16 * j, qb + 16, 16);
      } else {
        std::memset(qg + 16 * j, 0, 16);
        std::memset(qg + 64 + 16 * j, 0, 16);
      }
      ds[g * 8 + j] = d;
      ds[g * 8 + 4 + j] = sum * 0.25f;
    }
  }
#endif
};

}  // namespace radixserve_lean
#endif  // RADIXSERVE_LEAN_DECODE
