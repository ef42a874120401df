// A model's decoder layers for CPU decode steps, run by one call per step (srt/layers/fused_decode.py).
//
// decode_layer (cpu_decode_layer.cpp) made each layer one op; a step of a 30-layer model still made
// 30 calls from Python, each converting ~40 arguments and walking two Python frames: ~0.3 ms of a
// 4.8 ms batch-1 step of the default model on a 2-core Zen 4. A DecodeStack holds what does not
// change between steps (weights, norms, rotary tables, sizes), added once per layer; `run` takes what
// does (the hidden states, positions, the KV pools' buffers and the batch's page table) and calls
// decode_layer for every layer in order, so its output is the per-layer path's, bit for bit.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

at::Tensor decode_layer(const at::Tensor& hidden, at::Tensor& residual, bool first, const at::Tensor& ln1,
                        const at::Tensor& ln2, double eps, at::TensorList qkv_w, at::IntArrayRef qkv_t,
                        const c10::optional<at::Tensor>& qkv_bias, int64_t q_size, int64_t kv_size,
                        const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                        const at::Tensor& positions, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                        int64_t head_dim, at::Tensor& k_buffer, at::Tensor& v_buffer,
                        const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales,
                        int64_t kv_format, double k_scale, double v_scale, const at::Tensor& out_cache_loc,
                        const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                        double scale, int64_t num_splits, at::TensorList o_w, at::IntArrayRef o_t,
                        const c10::optional<at::Tensor>& o_bias, at::TensorList gate_up_w, at::IntArrayRef gate_up_t,
                        at::TensorList down_w, at::IntArrayRef down_t, at::TensorList lora, at::IntArrayRef lora_segs);

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
