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
// output, as the Python layers do.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>

#include <vector>

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
    return static_cast<int64_t>(layers.size());
  }

  // Every layer on hidden [T, hidden_size]: returns the last layer's output and the residual stream
  // (the model's final norm adds them). Layer i's cache: k_buffers[i], v_buffers[i], the int8
  // formats' k_scales[i] / v_scales[i] (empty lists otherwise), fp8's k_scale[i] / v_scale[i].
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor hidden, at::Tensor positions, std::vector<at::Tensor> k_buffers,
                                         std::vector<at::Tensor> v_buffers, std::vector<at::Tensor> k_scales,
                                         std::vector<at::Tensor> v_scales, int64_t kv_format,
                                         std::vector<double> k_scale, std::vector<double> v_scale,
                                         at::Tensor out_cache_loc, at::Tensor req_to_token,
                                         at::Tensor req_pool_indices, at::Tensor seq_lens, int64_t num_splits) {
    const size_t n = layers.size();
    TORCH_CHECK(n > 0 && k_buffers.size() == n && v_buffers.size() == n && k_scale.size() == n &&
                    v_scale.size() == n,
                "DecodeStack.run: one KV buffer pair and fp8 scale pair per layer (", n, " layers)");
    TORCH_CHECK(k_scales.empty() ? v_scales.empty() : k_scales.size() == n && v_scales.size() == n,
                "DecodeStack.run: int8 KV scales for every layer or none");
    TORCH_CHECK(hidden.dim() == 2, "DecodeStack.run: hidden must be [T, hidden_size]");
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

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run)
      .def("size", &DecodeStack::size);
}
