// One decoder layer of a decode step (Llama family: Llama, Mistral, Qwen2, Qwen3) in a single op.
//
// At batch 1 a decode step of a small model costs more in per-op dispatch and Python than in
// arithmetic: about 15 torch ops per layer. This op runs the same kernels in the same order as the
// Python layer (srt/models/llama.py with the fused CPU ops and quantized linears), so its output
// is identical, from one call per layer:
//   residual += hidden; h = rmsnorm(residual)            (first layer: residual = hidden)
//   q, k, v = split(h @ Wqkv.T + b); QK-norm per head (Qwen3); NeoX rotary on q and k
//   K/V written to the layer's pool slots (in the pool's format); paged decode attention
//   o = attn @ Wo.T + b; residual += o; h = rmsnorm(residual)
//   returns silu(h @ Wgate.T) * (h @ Wup.T) @ Wdown.T
// With LoRA adapters in the batch, each projection adds its segments' deltas (cpu_lora.cpp) to its
// output, as the Python layers do. Without gate-up and down weights (a mixture-of-experts layer) it
// stops after the second norm and returns its output, the experts' input.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <poll.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <tuple>
#include <vector>

#include "cpu_i16act.h"
#include "cpu_qvnni.h"

#include "cpu_lean.h"
#include "cpu_rowops.h"
#include "cpu_sampling.h"

// Kernels of the other translation units of this extension.
void rms_norm(at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void rotary_neox(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_cache,
                 const at::Tensor& sin_cache, int64_t head_dim);
void decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                      const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                      int64_t kv_format, double k_scale, double v_scale, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                      int64_t num_splits);
void kv_store(at::Tensor& k_buffer, at::Tensor& v_buffer, const c10::optional<at::Tensor>& k_scales,
              const c10::optional<at::Tensor>& v_scales, int64_t kv_format, double k_scale, double v_scale,
              const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v);
at::Tensor quant_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes, bool exact);
void lora_apply(const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bt, at::Tensor& out, at::IntArrayRef segs,
                at::IntArrayRef parts);
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& w_in, int64_t qtype_in, int64_t k,
                           at::ScalarType dtype);
int64_t argmax_row(const float* x, int64_t n);
void quant_embedding_bf16(const int64_t* ids, int64_t t, const at::Tensor& w, int64_t qtype, int64_t k,
                          c10::BFloat16* out);


namespace {

at::Tensor project(const at::Tensor& x, at::TensorList w, at::IntArrayRef t, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = quant_linear(x, w, t, false);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

// LoRA adapters (srt/lora, cpu_lora.cpp): `lora` holds (A, Bt) pools of the qkv, o, gate_up and down
// projections in that order (empty tensors for projections no adapter targets), `segs` the batch's
// segments; no LoRA when `lora` is empty. The fused projections' parts: q, k, v and gate, up.
void add_lora(const at::Tensor& x, at::Tensor& out, at::TensorList lora, int64_t which, at::IntArrayRef segs,
              at::IntArrayRef parts) {
  if (lora.empty() || lora[2 * which].numel() == 0) return;
  lora_apply(x, lora[2 * which], lora[2 * which + 1], out, segs, parts);
}

// Per-head RMSNorm of a [T, heads * head_dim] slice, returned contiguous.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim, double eps) {
  at::Tensor flat = x.reshape({-1, head_dim}).clone();
  rms_norm(flat, c10::nullopt, weight, eps);
  return flat.view(x.sizes());
}

}  // namespace

at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first, const at::Tensor& ln1,
                        const at::Tensor& ln2, double eps, at::TensorList qkv_w, at::IntArrayRef qkv_t,
                        const c10::optional<at::Tensor>& qkv_bias, int64_t q_size, int64_t kv_size,
                        const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                        const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                        int64_t head_dim, at::Tensor& k_buffer, at::Tensor& v_buffer,
                        const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                        int64_t kv_format, double k_scale, double v_scale, const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                        const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, double scale,
                        int64_t num_splits, at::TensorList o_w, at::IntArrayRef o_t,
                        const c10::optional<at::Tensor>& o_bias, at::TensorList gate_up_w, at::IntArrayRef gate_up_t,
                        at::TensorList down_w, at::IntArrayRef down_t, at::TensorList lora, at::IntArrayRef lora_segs) {
  TORCH_CHECK(lora.empty() || lora.size() == 8, "decode_layer: lora holds (A, Bt) of 4 projections");
  TORCH_CHECK(hidden.dim() == 2 && residual.sizes() == hidden.sizes() && residual.is_contiguous(),
              "decode_layer: hidden and residual must be [T, hidden_size]");
  const int64_t tokens = hidden.size(0);
  at::Tensor h = hidden.contiguous().clone();
  if (first) {
    residual.copy_(hidden);
    rms_norm(h, c10::nullopt, ln1, eps);
  } else {
    rms_norm(h, residual, ln1, eps);  // residual += h; h = norm(residual)
  }
  at::Tensor qkv = project(h, qkv_w, qkv_t, qkv_bias);
  add_lora(h, qkv, lora, 0, lora_segs, {q_size, kv_size, kv_size});
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor k = qkv.narrow(1, q_size, kv_size);
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).contiguous();
  if (q_norm.has_value() && q_norm->defined()) {
    q = head_norm(q, *q_norm, head_dim, eps);
    k = head_norm(k, *k_norm, head_dim, eps);
  }
  rotary_neox(q, positions, cos_cache, sin_cache, head_dim);
  rotary_neox(k, positions, cos_cache, sin_cache, head_dim);
  const int64_t kv_heads = kv_size / head_dim, q_heads = q_size / head_dim;
  kv_store(k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale, out_cache_loc,
           k.reshape({tokens, kv_heads, head_dim}), v.view({tokens, kv_heads, head_dim}));
  at::Tensor q3 = q.reshape({tokens, q_heads, head_dim}).contiguous();
  at::Tensor attn = at::empty_like(q3);
  decode_attention(q3, k_buffer, v_buffer, k_scales, v_scales, kv_format, k_scale, v_scale, req_to_token,
                   req_pool_indices, seq_lens, attn, scale, num_splits);
  at::Tensor attn2 = attn.view({tokens, q_size});
  at::Tensor o = project(attn2, o_w, o_t, o_bias);
  add_lora(attn2, o, lora, 1, lora_segs, {o.size(1)});
  rms_norm(o, residual, ln2, eps);  // residual += o; o = norm(residual)
  if (gate_up_w.empty() && down_w.empty()) return o;  // a MoE layer: the caller runs its experts on o
  at::Tensor gate_up = quant_linear(o, gate_up_w, gate_up_t, false);
  add_lora(o, gate_up, lora, 2, lora_segs, {gate_up.size(1) / 2, gate_up.size(1) / 2});
  at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul(act, gate_up);
  at::Tensor down = quant_linear(act, down_w, down_t, false);
  add_lora(act, down, lora, 3, lora_segs, {down.size(1)});
  return down;
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor(a!) residual, bool first, Tensor ln1, Tensor ln2, float eps, "
      "Tensor[] qkv_w, int[] qkv_t, Tensor? qkv_bias, int q_size, int kv_size, Tensor? q_norm, Tensor? k_norm, "
      "Tensor positions, Tensor cos_cache, Tensor sin_cache, int head_dim, Tensor(b!) k_buffer, "
      "Tensor(c!) v_buffer, Tensor(d!)? k_scales, Tensor(e!)? v_scales, int kv_format, float k_scale, "
      "float v_scale, Tensor out_cache_loc, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
      "float scale, int num_splits, Tensor[] o_w, int[] o_t, Tensor? o_bias, Tensor[] gate_up_w, int[] gate_up_t, "
      "Tensor[] down_w, int[] down_t, Tensor[] lora, int[] lora_segs) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("decode_layer", &decode_layer); }

// DecodeStack: a model's decoder layers for CPU decode steps, run by one call per step
// (srt/layers/fused_decode.py). decode_layer made each layer one op; a step of a 30-layer model still made
// 30 calls from Python, each converting ~40 arguments and walking two Python frames (one call per
// step: the default model's batch-1 decode 169 -> 190 tok/s on a 2-core Zen 4). A DecodeStack holds what does not
// change between steps (weights, norms, rotary tables, sizes), added once per layer; `run` takes what
// does (the hidden states, positions, the KV pools' buffers and the batch's page table) and calls
// decode_layer for every layer in order, so its output is the per-layer path's, bit for bit.

namespace {

c10::optional<at::Tensor> maybe(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t : c10::nullopt;
}

}  // namespace

// The stack's layers in one parallel region per step ("lean" path). Each op of decode_layer is its
// own parallel region, with ATen allocations and serial work between them: in a 2-thread batch-1 step
// of the default model about half of each layer's time was the second thread waiting. Here every
// thread runs the whole step, with a barrier after each of a layer's five phases, whose units of work
// the threads share out (Steal: each its own range first, then the others' tails):
//   1. norm and int8 activations (each thread its own copy of the residual stream and of the quantized
//      activations: a few KB, cheaper than a barrier); per head of q, k and v its rows, then the head's
//      QK-norm, rotary and K / V rows into the pool
//   2. attention tasks (and, with split contexts, a merge phase)
//   3. the O rows, 16 at a time
//   4. norm; per group of 128 inputs of the down projection its gate rows and the matching up rows,
//      then SiLU and the int8 activations of those inputs
//   5. the down rows, 16 at a time
// The pieces are the ops' own (the same row functions, the same GEMV kernel per weight row), so the
// output is decode_layer's bit for bit (batch-1 step of the default model on a 2-core Zen 4: 4.9 ->
// about 3.5 ms). Taken for bf16 activations whose projections' rows quant_linear multiplies by the
// int8 GEMV (radixserve_qvnni: Q4_0 / Q4_1 on AVX-512 VNNI + VBMI) or by the int16-activation dots
// (radixserve_i16act: Q8_0, Q4_K, Q5_K, Q6_K, and Q4_0 / Q4_1 on AVX2), either or both in one projection;
// otherwise the per-layer ops run. The building blocks (LeanLinear, LeanActs, DownActs, Steal) are in
// cpu_lean.h, which the quantized MoE op shares.
#if defined(RADIXSERVE_LEAN_DECODE)
using namespace radixserve_lean;  // NOLINT(build/namespaces)
#endif

struct DecodeStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor ln1, ln2;
    double eps;
    std::vector<at::Tensor> qkv_w;
    std::vector<int64_t> qkv_t;
    c10::optional<at::Tensor> qkv_bias;
    int64_t q_size, kv_size;
    c10::optional<at::Tensor> q_norm, k_norm;
    at::Tensor cos_cache, sin_cache;
    int64_t head_dim;
    double scale;
    std::vector<at::Tensor> o_w;
    std::vector<int64_t> o_t;
    c10::optional<at::Tensor> o_bias;
    std::vector<at::Tensor> gate_up_w;
    std::vector<int64_t> gate_up_t;
    std::vector<at::Tensor> down_w;
    std::vector<int64_t> down_t;
  };
  std::vector<Layer> layers;
#if defined(RADIXSERVE_LEAN_DECODE)
  struct Lean {
    LeanLinear qkv, o, gate_up, down;
  };
  std::vector<Lean> lean;  // one per layer while every layer qualifies, else empty
#endif
  bool lean_ok = true;

  // The layer's arguments of decode_layer that stay fixed between steps, in its order.
  int64_t add_layer(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> qkv_w,
                    std::vector<int64_t> qkv_t, c10::optional<at::Tensor> qkv_bias, int64_t q_size, int64_t kv_size,
                    c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, at::Tensor cos_cache,
                    at::Tensor sin_cache, int64_t head_dim, double scale, std::vector<at::Tensor> o_w,
                    std::vector<int64_t> o_t, c10::optional<at::Tensor> o_bias, std::vector<at::Tensor> gate_up_w,
                    std::vector<int64_t> gate_up_t, std::vector<at::Tensor> down_w, std::vector<int64_t> down_t) {
    TORCH_CHECK(qkv_w.size() == qkv_t.size() && o_w.size() == o_t.size() && gate_up_w.size() == gate_up_t.size() &&
                    down_w.size() == down_t.size(),
                "DecodeStack.add_layer: one qtype per weight segment");
    layers.push_back(Layer{std::move(ln1), std::move(ln2), eps, std::move(qkv_w), std::move(qkv_t),
                           maybe(qkv_bias), q_size, kv_size, maybe(q_norm), maybe(k_norm), std::move(cos_cache),
                           std::move(sin_cache), head_dim, scale, std::move(o_w), std::move(o_t), maybe(o_bias),
                           std::move(gate_up_w), std::move(gate_up_t), std::move(down_w), std::move(down_t)});
    add_lean(layers.back());
    return static_cast<int64_t>(layers.size());
  }

  // Whether the layer can run on the lean path (see above), and its projections as LeanLinear.
  void add_lean(const Layer& L) {
#if defined(RADIXSERVE_LEAN_DECODE)
    if (!lean_ok) return;
    const int64_t hidden = L.ln1.numel();
    auto bf16_vec = [](const c10::optional<at::Tensor>& t, int64_t n) {
      return !t.has_value() ||
             (t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 1 && t->size(0) == n);
    };
    int64_t intermediate = 0;
    for (const auto& w : L.gate_up_w) intermediate += w.size(0);
    intermediate /= 2;
    const Layer& first = layers.front();
    lean_ok = L.head_dim > 0 && L.q_size % L.head_dim == 0 && L.kv_size % L.head_dim == 0 && L.kv_size > 0 &&
              (L.q_size / L.head_dim) % (L.kv_size / L.head_dim) == 0 && bf16_vec(L.ln1, hidden) &&
              bf16_vec(L.ln2, hidden) && bf16_vec(L.qkv_bias, L.q_size + 2 * L.kv_size) &&
              bf16_vec(L.o_bias, hidden) && bf16_vec(L.q_norm, L.head_dim) && bf16_vec(L.k_norm, L.head_dim) &&
              L.q_norm.has_value() == L.k_norm.has_value() && L.cos_cache.scalar_type() == at::kFloat &&
              L.sin_cache.scalar_type() == at::kFloat && L.cos_cache.is_contiguous() && L.sin_cache.is_contiguous() &&
              L.cos_cache.dim() == 2 && L.cos_cache.sizes() == L.sin_cache.sizes() &&
              L.cos_cache.size(1) <= L.head_dim && L.cos_cache.size(1) % 2 == 0 &&
              LeanLinear::supported(L.qkv_w, L.qkv_t, hidden) && LeanLinear::supported(L.o_w, L.o_t, L.q_size) &&
              LeanLinear::supported(L.gate_up_w, L.gate_up_t, hidden) &&
              LeanLinear::supported(L.down_w, L.down_t, intermediate) && L.ln1.numel() == first.ln1.numel() &&
              L.q_size == first.q_size && L.kv_size == first.kv_size && L.head_dim == first.head_dim;
    if (!lean_ok) {
      lean.clear();
      return;
    }
    Lean l{LeanLinear(L.qkv_w, L.qkv_t, hidden, L.qkv_bias), LeanLinear(L.o_w, L.o_t, L.q_size, L.o_bias),
           LeanLinear(L.gate_up_w, L.gate_up_t, hidden, c10::nullopt),
           LeanLinear(L.down_w, L.down_t, intermediate, c10::nullopt)};
    lean_ok = l.qkv.n == L.q_size + 2 * L.kv_size && l.o.n == hidden && l.down.n == hidden &&
              l.gate_up.n == 2 * intermediate;
    if (lean_ok)
      lean.push_back(std::move(l));
    else
      lean.clear();
#else
    (void)L;
    lean_ok = false;
#endif
  }

  // Every layer on hidden [T, hidden_size]: returns the last layer's output and the residual stream
  // (the model's final norm adds them). Layer i's cache (set_kv): k_buffers[i], v_buffers[i], the int8
  // formats' k_scales[i] / v_scales[i] (empty lists otherwise), fp8's k_scale[i] / v_scale[i].
  // The KV pool's per-layer buffers, set when the pool changes (a step passes only what changes).
  std::vector<at::Tensor> k_buffers, v_buffers, k_scales, v_scales;
  std::vector<double> k_scale, v_scale;
  int64_t kv_format = -1;

  void set_kv(std::vector<at::Tensor> k_buffers_, std::vector<at::Tensor> v_buffers_,
              std::vector<at::Tensor> k_scales_, std::vector<at::Tensor> v_scales_, int64_t kv_format_,
              std::vector<double> k_scale_, std::vector<double> v_scale_) {
    const size_t n = layers.size();
    TORCH_CHECK(n > 0 && k_buffers_.size() == n && v_buffers_.size() == n && k_scale_.size() == n &&
                    v_scale_.size() == n,
                "DecodeStack.set_kv: one KV buffer pair and fp8 scale pair per layer (", n, " layers)");
    TORCH_CHECK(k_scales_.empty() ? v_scales_.empty() : k_scales_.size() == n && v_scales_.size() == n,
                "DecodeStack.set_kv: int8 KV scales for every layer or none");
    k_buffers = std::move(k_buffers_), v_buffers = std::move(v_buffers_);
    k_scales = std::move(k_scales_), v_scales = std::move(v_scales_);
    k_scale = std::move(k_scale_), v_scale = std::move(v_scale_);
    kv_format = kv_format_;
  }

  // The model's final norm and a Q8_0 LM head in row tiles (set_head): run_head multiplies them after the
  // layers, in the same parallel region, with quant_linear's kernel for that head (split activations over
  // the tiles), so its logits are quant_linear's bit for bit. Between the stack's call and a separate norm
  // and LM head call, a batch-1 step of the default model spent ~0.15 ms (2-core Xeon): Python and the
  // op dispatcher running from caches the layers' weights had just gone through.
  struct Head {
    at::Tensor norm, w;
    double eps = 0;
  };
  c10::optional<Head> head;

  void set_head(at::Tensor norm, double eps, at::Tensor w, int64_t qtype) {
    TORCH_CHECK(!layers.empty(), "DecodeStack.set_head: add the layers first");
    const int64_t H = layers[0].ln1.numel();
    TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.is_contiguous() && norm.dim() == 1 && norm.size(0) == H,
                "DecodeStack.set_head: the final norm's weight must be a contiguous bf16 [", H, "]");
    TORCH_CHECK(qtype == 264 && H % 32 == 0 && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 &&
                    w.size(1) == H / 32 * 34 && w.size(0) >= 1,
                "DecodeStack.set_head: the LM head must be a Q8_0 weight in row tiles (qtype 264) of [n, ", H / 32 * 34,
                "] bytes");
    head = Head{std::move(norm), std::move(w), eps};
  }

  // Whether run_head can run `tokens` rows of `dtype` activations now.
  bool head_for(at::ScalarType dtype, int64_t tokens) const {
    return head.has_value() && lean_for(dtype, tokens) && quant_q8_tiles_split(tokens);
  }

  // The layers, the final norm and the LM head on hidden [T, hidden_size]: (the final norm's output,
  // the LM head's [T, n] logits as float32), as run + the model's norm + quant_linear (whose output is in
  // hidden's dtype: bf16, which the float32 logits hold exactly) give them.
  std::tuple<at::Tensor, at::Tensor> run_head(at::Tensor hidden, at::Tensor positions, at::Tensor out_cache_loc,
                                              at::Tensor req_to_token, at::Tensor req_pool_indices,
                                              at::Tensor seq_lens, int64_t num_splits) {
    TORCH_CHECK(kv_format >= 0 && k_buffers.size() == layers.size(), "DecodeStack.run_head: set_kv first");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == layers[0].ln1.numel(),
                "DecodeStack.run_head: hidden must be [T, hidden_size]");
    TORCH_CHECK(head_for(hidden.scalar_type(), hidden.size(0)),
                "DecodeStack.run_head: no head set, or not a lean batch (see head_for)");
#if defined(RADIXSERVE_LEAN_DECODE)
    for (Lean& l : lean)
      for (LeanLinear* W : {&l.qkv, &l.o, &l.gate_up, &l.down}) W->choose(hidden.size(0));
    at::Tensor normed, logits;
    run_lean(hidden, positions, out_cache_loc, req_to_token, req_pool_indices, seq_lens, num_splits, &normed, &logits);
    return {normed, logits};
#else
    TORCH_CHECK(false, "DecodeStack.run_head: built without the lean kernels");
#endif
  }

  // The model's token embedding as one quantized table (set_embed): run_steps embeds each step's tokens
  // with quant_embedding, as the model's embedding layer does, in its dtype.
  struct Embed {
    at::Tensor w;
    int64_t qtype = 0, k = 0;
    at::ScalarType dtype = at::kBFloat16;
  };
  c10::optional<Embed> embed;

  void set_embed(at::Tensor w, int64_t qtype, int64_t k, at::ScalarType dtype) {
    TORCH_CHECK(!layers.empty() && k == layers[0].ln1.numel(),
                "DecodeStack.set_embed: the table's rows must have the hidden size's ", layers.empty() ? 0 : layers[0].ln1.numel(),
                " columns, got ", k);
    quant_embedding(at::zeros({1}, at::kLong), w, qtype, k, dtype);  // checks the table (run_steps then does not)
    embed = Embed{std::move(w), qtype, k, dtype};
  }

  // Whether run_steps can run `tokens` rows now (an embedding and a head set, a lean batch).
  bool steps_for(int64_t tokens) const { return embed.has_value() && head_for(embed->dtype, tokens); }

  // Decode steps without returning to Python (--num-continuous-decode-steps): step s embeds `ids` (the
  // batch's last tokens for s = 0, then the tokens step s - 1 picked), runs run_head at positions and
  // context lengths s further than `positions` / `seq_lens`, with its new K / V in slots step_locs[s]
  // (written into req_to_token by the caller) and `num_splits[s]`, and picks each row's token from the
  // first `vocab` logits: the first largest (the sampler's greedy argmax) where `sampling` is empty, else
  // the sampler's row pass with sample_rows' tensors [temperatures, top_ks, top_ps, min_ps, greedy, seeds
  // [steps, T], positions] (step s: seeds[s], positions + s). Returns the ids [steps, T]: those of the same
  // steps run one by one. Between steps, Python ran ~0.15 ms from caches the weights had just gone through.
  // `interrupt_fd` >= 0: a descriptor that turns readable when a message waits for the scheduler (its
  // ZeroMQ socket's ZMQ_FD); once it does, the call ends after the step it is in and returns that many
  // rows (the scheduler then admits the new request or takes the abort a step later, not `steps` later).
  // `stop_ids` [T, K] (-1 pads; empty: none) and `stop_steps` [T] (empty: none): the call also ends after
  // the step in which a row picks one of its stop ids or takes its stop_steps-th step (a request stops:
  // its answer need not wait for the others' steps, nor a batch of one compute steps past its end).
  at::Tensor run_steps(at::Tensor ids, at::Tensor positions, at::Tensor step_locs, at::Tensor req_to_token,
                       at::Tensor req_pool_indices, at::Tensor seq_lens, std::vector<int64_t> num_splits,
                       int64_t vocab, std::vector<at::Tensor> sampling, int64_t interrupt_fd, at::Tensor stop_ids,
                       at::Tensor stop_steps) {
    const int64_t T = ids.numel(), steps = step_locs.dim() == 2 ? step_locs.size(0) : 0;
    TORCH_CHECK(steps_for(T), "DecodeStack.run_steps: set_embed and set_head first, on a lean batch (steps_for)");
    TORCH_CHECK(steps >= 1 && step_locs.size(1) == T && static_cast<int64_t>(num_splits.size()) == steps,
                "DecodeStack.run_steps: step_locs must be [steps, T] with one num_splits per step");
    TORCH_CHECK(positions.numel() == T && seq_lens.numel() == T, "DecodeStack.run_steps: one position and length per row");
    TORCH_CHECK(vocab >= 1 && vocab <= head->w.size(0), "DecodeStack.run_steps: vocab ", vocab, " outside [1, ",
                head->w.size(0), "]");
    TORCH_CHECK(sampling.empty() || sampling.size() == 7, "DecodeStack.run_steps: sampling is [] or sample_rows' 7 tensors");
    std::unique_ptr<radixserve_sampling::Rows> spec;
    if (!sampling.empty()) {
      spec = std::make_unique<radixserve_sampling::Rows>(sampling[0], sampling[1], sampling[2], sampling[3],
                                                         sampling[4], sampling[5], sampling[6], T);
      TORCH_CHECK(spec->steps() == steps, "DecodeStack.run_steps: one seed per row and step");
    }
    const bool by_id = stop_ids.numel() > 0, by_step = stop_steps.numel() > 0;
    TORCH_CHECK(!by_id || (stop_ids.dim() == 2 && stop_ids.size(0) == T), "DecodeStack.run_steps: stop_ids must be [T, K]");
    TORCH_CHECK(!by_step || stop_steps.numel() == T, "DecodeStack.run_steps: one stop_steps per row");
    const at::Tensor sids = by_id ? stop_ids.to(at::kLong).contiguous() : stop_ids;
    const at::Tensor ssteps = by_step ? stop_steps.to(at::kLong).contiguous() : stop_steps;
    const int64_t K = by_id ? sids.size(1) : 0;
    const int64_t* sip = by_id ? sids.data_ptr<int64_t>() : nullptr;
    const int64_t* ssp = by_step ? ssteps.data_ptr<int64_t>() : nullptr;
    at::Tensor out = at::empty({steps, T}, at::kLong);
    at::Tensor cur = ids.to(at::kLong).contiguous().clone(), pos = positions.to(at::kLong).contiguous().clone();
    const at::Tensor locs = step_locs.contiguous();
    int64_t* cp = cur.data_ptr<int64_t>();
    int64_t* op = out.data_ptr<int64_t>();
    int64_t* pp = pos.data_ptr<int64_t>();
    auto stopped = [&](int64_t s) {  // whether a row stopped at step s (on its token cp[t])
      for (int64_t t = 0; t < T; ++t) {
        if (ssp != nullptr && s + 1 >= ssp[t]) return true;
        for (int64_t k = 0; k < K; ++k)
          if (sip[t * K + k] == cp[t]) return true;
      }
      return false;
    };
#if defined(RADIXSERVE_LEAN_DECODE)
    for (Lean& l : lean)
      for (LeanLinear* W : {&l.qkv, &l.o, &l.gate_up, &l.down}) W->choose(T);
    // made once, then moved on a step at a time (each step's setup cost ~10 us of a ~2.5 ms step)
    const auto attn = attention(locs.select(0, 0), req_to_token, req_pool_indices, seq_lens, num_splits[0]);
#endif
    for (int64_t s = 0; s < steps; ++s) {
      at::Tensor hidden;
      if (embed->dtype == at::kBFloat16) {  // (quant_embedding's output, without its ATen ops)
        hidden = at::empty({T, embed->k}, at::kBFloat16);
        quant_embedding_bf16(cp, T, embed->w, embed->qtype, embed->k, hidden.data_ptr<c10::BFloat16>());
      } else {
        hidden = quant_embedding(cur, embed->w, embed->qtype, embed->k, embed->dtype);
      }
#if defined(RADIXSERVE_LEAN_DECODE)
      if (s > 0) attn->next_step(locs.select(0, s), num_splits[s]);
      at::Tensor normed, logits;
      run_lean(hidden, pos, locs.select(0, s), req_to_token, req_pool_indices, seq_lens, num_splits[s], &normed, &logits,
               attn.get());
      const float* lp = logits.data_ptr<float>();
      const int64_t width = logits.size(1);
      at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          cp[t] = spec ? spec->pick(lp + t * width, vocab, t, s) : argmax_row(lp + t * width, vocab);
      });
#else
      TORCH_CHECK(false, "DecodeStack.run_steps: built without the lean kernels");
#endif
      std::copy(cp, cp + T, op + s * T);
      for (int64_t t = 0; t < T; ++t) ++pp[t];
      if (s + 1 < steps && ((interrupt_fd >= 0 && readable(interrupt_fd)) || stopped(s))) return out.narrow(0, 0, s + 1);
    }
    return out;
  }

  static bool readable(int64_t fd) {
    struct pollfd p = {static_cast<int>(fd), POLLIN, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLERR | POLLHUP)) != 0;
  }

  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor positions, at::Tensor out_cache_loc,
                                         at::Tensor req_to_token, at::Tensor req_pool_indices, at::Tensor seq_lens,
                                         int64_t num_splits) {
    const size_t n = layers.size();
    TORCH_CHECK(kv_format >= 0 && k_buffers.size() == n, "DecodeStack.run: set_kv first");
    TORCH_CHECK(hidden.dim() == 2, "DecodeStack.run: hidden must be [T, hidden_size]");
#if defined(RADIXSERVE_LEAN_DECODE)
    if (lean_for(hidden.scalar_type(), hidden.size(0)) && hidden.size(1) == layers[0].ln1.numel()) {
      for (Lean& l : lean)
        for (LeanLinear* W : {&l.qkv, &l.o, &l.gate_up, &l.down}) W->choose(hidden.size(0));
      return run_lean(hidden, positions, out_cache_loc, req_to_token, req_pool_indices, seq_lens, num_splits);
    }
#endif
    at::Tensor residual = at::empty_like(hidden);
    at::Tensor h = hidden;
    for (size_t i = 0; i < n; ++i) {
      const Layer& L = layers[i];
      const c10::optional<at::Tensor> ks = k_scales.empty() ? c10::nullopt : c10::optional<at::Tensor>(k_scales[i]);
      const c10::optional<at::Tensor> vs = v_scales.empty() ? c10::nullopt : c10::optional<at::Tensor>(v_scales[i]);
      h = decode_layer(h, residual, i == 0, L.ln1, L.ln2, L.eps, L.qkv_w, L.qkv_t, L.qkv_bias, L.q_size, L.kv_size,
                       L.q_norm, L.k_norm, positions, L.cos_cache, L.sin_cache, L.head_dim, k_buffers[i], v_buffers[i],
                       ks, vs, kv_format, k_scale[i], v_scale[i], out_cache_loc, req_to_token, req_pool_indices,
                       seq_lens, L.scale, num_splits, L.o_w, L.o_t, L.o_bias, L.gate_up_w, L.gate_up_t, L.down_w,
                       L.down_t, {}, {});
    }
    return {h, residual};
  }

  // RADIXSERVE_DISABLE_LEAN_DECODE=1: the per-layer ops (for A/B runs and tests).
  static bool lean_disabled() {
    static const bool off = [] {
      const char* v = std::getenv("RADIXSERVE_DISABLE_LEAN_DECODE");
      return v != nullptr && v[0] != '\0' && v[0] != '0';
    }();
    return off;
  }

#if defined(RADIXSERVE_LEAN_DECODE)
  // The batch's attention over every layer's cache (checked here, before any parallel region).
  std::unique_ptr<radixserve_rows::DecodeAttention> attention(const at::Tensor& out_cache_loc,
                                                              const at::Tensor& req_to_token,
                                                              const at::Tensor& req_pool_indices,
                                                              const at::Tensor& seq_lens, int64_t num_splits) const {
    const Layer& L0 = layers[0];
    auto attn = std::make_unique<radixserve_rows::DecodeAttention>(
        req_to_token, req_pool_indices, seq_lens, out_cache_loc, L0.q_size / L0.head_dim, L0.head_dim, kv_format,
        num_splits, std::max<int64_t>(1, at::get_num_threads()));
    TORCH_CHECK(seq_lens.size(0) == out_cache_loc.numel(), "DecodeStack.run: one token per request in a decode batch");
    for (size_t i = 0; i < layers.size(); ++i)
      attn->add_layer(k_buffers[i], v_buffers[i],
                      k_scales.empty() ? c10::nullopt : c10::optional<at::Tensor>(k_scales[i]),
                      v_scales.empty() ? c10::nullopt : c10::optional<at::Tensor>(v_scales[i]), k_scale[i], v_scale[i]);
    TORCH_CHECK(attn->kv_heads() == L0.kv_size / L0.head_dim, "DecodeStack.run: the KV pool's heads do not match the model's");
    return attn;
  }

  // A step of the lean path; `prepared` (run_steps: one for all its steps, moved on by next_step) or
  // else an attention made from out_cache_loc, req_to_token, req_pool_indices, seq_lens and num_splits.
  std::tuple<at::Tensor, at::Tensor> run_lean(const at::Tensor& hidden_in, const at::Tensor& positions,
                                              const at::Tensor& out_cache_loc, const at::Tensor& req_to_token,
                                              const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                              int64_t num_splits, at::Tensor* normed_out = nullptr,
                                              at::Tensor* logits_out = nullptr,
                                              radixserve_rows::DecodeAttention* prepared = nullptr) {
    using bf16 = c10::BFloat16;
    const Layer& L0 = layers[0];
    const at::Tensor hidden = hidden_in.contiguous();
    const int64_t T = hidden.size(0), H = hidden.size(1), hd = L0.head_dim;
    const int64_t q_size = L0.q_size, kv_size = L0.kv_size, qkv_n = q_size + 2 * kv_size;
    const int64_t qh = q_size / hd, kh = kv_size / hd, inter = lean[0].down.k;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    TORCH_CHECK(pos.numel() == T, "DecodeStack.run: one position per token");
    const int64_t* pp = pos.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      for (const Layer& L : layers)
        TORCH_CHECK(pp[t] >= 0 && pp[t] < L.cos_cache.size(0), "DecodeStack.run: position ", pp[t], " out of range");
    std::unique_ptr<radixserve_rows::DecodeAttention> made;
    if (prepared == nullptr) made = attention(out_cache_loc, req_to_token, req_pool_indices, seq_lens, num_splits);
    radixserve_rows::DecodeAttention& attn = prepared != nullptr ? *prepared : *made;
    TORCH_CHECK(seq_lens.size(0) == T, "DecodeStack.run: one token per request in a decode batch");
    const auto opts = hidden.options();
    at::Tensor residual = at::empty({T, H}, opts), down = at::empty({T, H}, opts);
    at::Tensor qkv = at::empty({T, qkv_n}, opts), att = at::empty({T, q_size}, opts), o = at::empty({T, H}, opts);
    at::Tensor gu = at::empty({T, 2 * inter}, opts), act = at::empty({T, inter}, opts);
    const int64_t groups = (inter + 127) / 128;
    bool down_int8 = false, down_int16 = false, down_plain = false;
    for (const Lean& l : lean) down_int8 |= l.down.int8, down_int16 |= l.down.int16, down_plain |= l.down.plain;
    DownActs down_acts(T, inter, down_int8, down_int16, down_plain);
    const bf16* xin = hidden.data_ptr<bf16>();
    bf16 *res_out = residual.data_ptr<bf16>(), *dp = down.data_ptr<bf16>(), *qp = qkv.data_ptr<bf16>();
    bf16 *ap = att.data_ptr<bf16>(), *op = o.data_ptr<bf16>(), *gp = gu.data_ptr<bf16>(), *xp = act.data_ptr<bf16>();
    const int64_t rot = L0.cos_cache.size(1);
    // with the head (run_head): its outputs, tiles and whether quant_linear would have split the
    // activations' low parts too (float32 hidden only; the lean path is bf16)
    const bool with_head = normed_out != nullptr && logits_out != nullptr && head.has_value();
    const int64_t vocab = with_head ? head->w.size(0) : 0, vocab16 = vocab / radixserve_rowtiles::kRows * radixserve_rowtiles::kRows;
    const int64_t head_row_bytes = with_head ? head->w.size(1) : 0;
    constexpr int64_t kHeadTilesPerUnit = 8;
    const int64_t head_units = (vocab16 / radixserve_rowtiles::kRows + kHeadTilesPerUnit - 1) / kHeadTilesPerUnit;
    bf16* np = nullptr;
    float* lp = nullptr;
    if (with_head) {
      *normed_out = at::empty({T, H}, opts);
      *logits_out = at::empty({T, vocab}, opts.dtype(at::kFloat));
      np = normed_out->data_ptr<bf16>(), lp = logits_out->data_ptr<float>();
    }
    Steal steal(threads);
    Meet meet;
    const uint64_t epoch0 = 0;
#pragma omp parallel num_threads(threads)
    {
      const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
      std::vector<bf16> res(T * H), h(T * H);
      LeanActs acts;
      uint64_t epoch = epoch0;
      // fn(u) for every unit of a phase of `units`, shared out as described at Steal
      auto units_of = [&](int64_t units, auto&& fn) {
        steal.start(tid, nt, units, ++epoch);
        for (int64_t u; (u = steal.next(tid, nt, epoch)) >= 0;) fn(u);
      };
      // The O and down phases' rows: 16-row tiles, a thread taking spans of about 48 KB of weights from
      // its own range (the default model's O rows 16 at a time, ~6 KB, took ~0.23 ms a step against ~0.17
      // in spans of 144 rows) but its last two tiles one by one, which a thread that finished first may
      // take (in 64-row units the default model's down phase left one thread waiting ~1.3 us a layer)
      auto rows_of = [&](const LeanLinear& W, auto&& fn) {
        const int64_t row_bytes = std::max<int64_t>(1, W.segs.front().row_bytes);
        const int64_t most = std::max<int64_t>(1, (48 * 1024 / row_bytes + 15) / 16);
        steal.start(tid, nt, (H + 15) / 16, ++epoch);
        int64_t count = 0;
        for (int64_t u; (u = steal.next_span(tid, nt, epoch, most, 2, count)) >= 0;)
          fn(u * 16, std::min(H, (u + count) * 16));
      };
      // Before each barrier a thread prefetches the first rows the next phase gives it (Steal's own range
      // first): the memory would otherwise idle while the threads meet and the next phase's reads start
      // (with the K / V rows prefetched at each layer's start, the default model's batch-1 step 4% faster
      // on a 2-core Zen 4, paired runs; 2% at batch 8)
      auto first_tile = [&](int64_t t, int64_t n) { return ((H + 15) / 16) * t / n; };
      for (size_t i = 0; i < layers.size(); ++i) {
        const Layer& L = layers[i];
        const Lean& W = lean[i];
        const bf16 *ln1 = L.ln1.data_ptr<bf16>(), *ln2 = L.ln2.data_ptr<bf16>();
        const float eps = static_cast<float>(L.eps);
        attn.prefetch(static_cast<int64_t>(i), tid, nt);  // this layer's K / V rows, during the qkv rows
        // residual += x; h = norm(residual)   (first layer: residual = x; h = norm(x))
        for (int64_t t = 0; t < T; ++t) {
          const bf16* x = (i == 0 ? xin : dp) + t * H;
          if (i == 0) std::copy(x, x + H, res.data() + t * H);
          radixserve_rows::rms_norm_row(x, i == 0 ? static_cast<bf16*>(nullptr) : res.data() + t * H, ln1, H, eps,
                                        h.data() + t * H);
        }
        // per head of q, k and v: its rows, then QK-norm and rotary, and K / V rows into the pool
        {
          const LeanX x = acts.make(h.data(), T, H, W.qkv);
          const bf16* qn = L.q_norm.has_value() ? L.q_norm->data_ptr<bf16>() : nullptr;
          const bf16* kn = L.k_norm.has_value() ? L.k_norm->data_ptr<bf16>() : nullptr;
          const float* cp = L.cos_cache.data_ptr<float>();
          const float* sp = L.sin_cache.data_ptr<float>();
          units_of(qh + 2 * kh, [&](int64_t j) {
            W.qkv.rows(x, T, j * hd, (j + 1) * hd, qp, qkv_n);
            for (int64_t t = 0; t < T; ++t) {
              bf16* v = qp + t * qkv_n + j * hd;
              if (j < qh + kh) {
                if (qn != nullptr)
                  radixserve_rows::rms_norm_row(v, static_cast<bf16*>(nullptr), j < qh ? qn : kn, hd, eps, v);
                radixserve_rows::rotary_head(v, cp + pp[t] * rot, sp + pp[t] * rot, rot);
              }
              if (j >= qh) attn.store(static_cast<int64_t>(i), t, (j - qh) % kh, j >= qh + kh, v);
            }
          });
        }
        W.o.prefetch_rows(first_tile(tid, nt) * 16, 32768);  // (attention leaves the memory idle)
        meet.wait(nt);
        attn.attend(static_cast<int64_t>(i), qp, qkv_n, ap, L.scale, tid, nt);
        meet.wait(nt);
        if (attn.needs_merge()) {  // (each thread merging every head itself instead: ~2% slower)
          attn.merge(static_cast<int64_t>(i), ap, tid, nt);
          meet.wait(nt);
        }
        {
          const LeanX x = acts.make(ap, T, q_size, W.o);
          rows_of(W.o, [&](int64_t r0, int64_t r1) { W.o.rows(x, T, r0, r1, op, H); });
        }
        {
          const int64_t e0 = (groups * tid / nt) * 128;
          W.gate_up.prefetch_rows(e0, 8192);
          W.gate_up.prefetch_rows(inter + e0, 8192);
        }
        meet.wait(nt);
        for (int64_t t = 0; t < T; ++t)
          radixserve_rows::rms_norm_row(op + t * H, res.data() + t * H, ln2, H, eps, h.data() + t * H);
        // per span of groups of 128 inputs of the down projection: its gate rows, the matching up rows,
        // then SiLU and the int8 activations of those inputs. Spans of up to ~192 KB of gate rows from a
        // thread's own range, its last two groups one by one (Steal::next_span): the default model's
        // gate / up rows one group (46 KB) at a time, two streams alternating, ran a batch-1 step 3.8 %
        // slower on a 2-core Zen 4 than spans of four groups (paired runs, both CCD states)
        {
          const LeanX x = acts.make(h.data(), T, H, W.gate_up);
          const int64_t group_bytes = 128 * std::max<int64_t>(1, W.gate_up.segs.front().row_bytes);
          steal.start(tid, nt, groups, ++epoch);
          int64_t count = 0;
          for (int64_t g0; (g0 = steal.next_span(tid, nt, epoch, std::max<int64_t>(1, (192 << 10) / group_bytes), 2,
                                                  count)) >= 0;) {
            const int64_t e0 = g0 * 128, e1 = std::min(inter, (g0 + count) * 128);
            W.gate_up.rows(x, T, e0, e1, gp, 2 * inter);
            W.gate_up.rows(x, T, inter + e0, inter + e1, gp, 2 * inter);
            for (int64_t g = g0; g < g0 + count; ++g) {
              const int64_t f0 = g * 128, f1 = std::min(inter, f0 + 128);
              for (int64_t t = 0; t < T; ++t) {
                const uint16_t* gt = reinterpret_cast<const uint16_t*>(gp + t * 2 * inter);
                radixserve_rows::silu_mul_bf16(gt + f0, gt + inter + f0,
                                               reinterpret_cast<uint16_t*>(xp + t * inter) + f0, f1 - f0);
                down_acts.write(t, g, xp + t * inter);
              }
            }
          }
        }
        W.down.prefetch_rows(first_tile(tid, nt) * 16, 16384);
        meet.wait(nt);
        {
          const LeanX x = down_acts.acts(acts, T);
          rows_of(W.down, [&](int64_t r0, int64_t r1) { W.down.rows(x, T, r0, r1, dp, H); });
        }
        if (i + 1 < layers.size()) lean[i + 1].qkv.prefetch_rows(((qh + 2 * kh) * tid / nt) * hd, 16384);
        meet.wait(nt);
      }
      if (tid == 0) std::copy(res.begin(), res.end(), res_out);
#if defined(RADIXSERVE_HAVE_QVNNI)
      if (with_head) {
        // the model's final norm (every thread its own copy, as before each layer), then the LM head's
        // activations as quant_linear makes them for bf16 rows: float, split per block, h alone
        const bf16* hn = head->norm.data_ptr<bf16>();
        const float heps = static_cast<float>(head->eps);
        std::vector<float> xf(T * H);
        for (int64_t t = 0; t < T; ++t) {
          radixserve_rows::rms_norm_row(dp + t * H, res.data() + t * H, hn, H, heps, h.data() + t * H);
          for (int64_t c = 0; c < H; ++c) xf[t * H + c] = static_cast<float>(h[t * H + c]);
        }
        if (tid == 0) std::copy(h.begin(), h.end(), np);
        std::vector<int16_t> sh(T * H), sl(T * H);
        std::vector<float> sd(T * (H / 32));
        radixserve_qvnni::split_rows(xf.data(), T, H, sh.data(), sl.data(), sd.data());
        const radixserve_qvnni::SplitActs sa{sh.data(), sl.data(), sd.data(), H, H / 32, false};
        const uint8_t* wp = head->w.data_ptr<uint8_t>();
        const bool head_pf = radixserve_qvnni::head_prefetch(vocab * head_row_bytes);
        const int64_t tiles = vocab16 / radixserve_rowtiles::kRows;
        // a unit's logits as quant_linear's bf16 output, then as float32 (LogitsProcessor's .float())
        constexpr int64_t kUnitRows = kHeadTilesPerUnit * radixserve_rowtiles::kRows;
        std::vector<bf16> unit(T * kUnitRows);
        units_of(head_units + (vocab > vocab16 ? 1 : 0), [&](int64_t u) {
          if (u < head_units) {
            const int64_t t0 = u * kHeadTilesPerUnit, t1 = std::min(tiles, t0 + kHeadTilesPerUnit);
            const int64_t j0 = t0 * radixserve_rowtiles::kRows, cols = (t1 - t0) * radixserve_rowtiles::kRows;
            radixserve_qvnni::tiles_q8(sa, T, wp + j0 * head_row_bytes, head_row_bytes, 0, t1 - t0, unit.data(),
                                       kUnitRows, head_pf);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t c = 0; c < cols; ++c) lp[t * vocab + j0 + c] = static_cast<float>(unit[t * kUnitRows + c]);
          } else {  // the rows after the last tile, in the file's layout
            for (int64_t j = vocab16; j < vocab; ++j)
              for (int64_t t = 0; t < T; ++t)
                lp[t * vocab + j] = static_cast<float>(
                    static_cast<bf16>(radixserve_qvnni::file_row_dot_q8(wp + j * head_row_bytes, H / 32, sa, t)));
          }
        });
      }
#endif
    }
    return {down, residual};
  }
#endif

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // Whether `run` takes the lean path for `tokens` rows of `dtype` activations now.
  bool lean_for(at::ScalarType dtype, int64_t tokens) const {
#if defined(RADIXSERVE_LEAN_DECODE)
    if (!lean_ok || layers.empty() || lean.size() != layers.size() || dtype != at::kBFloat16 || tokens < 1 ||
        lean_disabled())
      return false;
    for (const Lean& l : lean)
      if (!l.qkv.runnable(tokens) || !l.o.runnable(tokens) || !l.gate_up.runnable(tokens) || !l.down.runnable(tokens))
        return false;
    return true;
#else
    (void)dtype, (void)tokens;
    return false;
#endif
  }
};

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_kv", &DecodeStack::set_kv)
      .def("run", &DecodeStack::run)
      .def("size", &DecodeStack::size)
      .def("lean_for", [](const c10::intrusive_ptr<DecodeStack>& self, at::ScalarType dtype, int64_t tokens) {
        return self->lean_for(dtype, tokens);
      })
      .def("set_head", &DecodeStack::set_head)
      .def("run_head", &DecodeStack::run_head)
      .def("head_for", [](const c10::intrusive_ptr<DecodeStack>& self, at::ScalarType dtype, int64_t tokens) {
        return self->head_for(dtype, tokens);
      })
      .def("set_embed", &DecodeStack::set_embed)
      .def("run_steps", &DecodeStack::run_steps)
      .def("steps_for", [](const c10::intrusive_ptr<DecodeStack>& self, int64_t tokens) {
        return self->steps_for(tokens);
      });
}
