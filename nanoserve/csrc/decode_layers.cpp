// Every decoder layer of a forward in one native call: the fused CPU path's nine kernel calls a
// layer (llama.py's BoundDecoderLayer.forward over layer_ops.py's fused table) chained here,
// with no Python between them. Why and what it measured: nanoserve/model/native_layers.py.
//
// The kernels are the ones the Python path calls, reached through the dispatcher
// (`nanoserve::*` ops that quant_matmul.cpp, fused_ops.cpp and paged_attention.cpp register),
// so each runs the same compiled code on the same inputs in the same order: the hidden states
// are the Python path's bit for bit. A layer, with the residual add folded into the next norm:
//
//   x = add_rms_norm(hidden, delta, input_norm)   (rms_norm before the first layer)
//   q = rope_store(qkv_matmul(x))                 (k and v go into the cache; Gemma: q *= s)
//   attn = decode_attention(q, cache, window)
//   x = add_rms_norm(hidden, o_matmul(attn), post_norm)       (Gemma: o_matmul normed first)
//   delta = down_matmul(silu_mul(gate_up_matmul(x)))          (Gemma: gelu_tanh_mul, normed)
//
// and after the last layer, add_rms_norm(hidden, delta, final_norm). The switches are the
// family's layer features (nanoserve/model/layer_features.py), as team_forward.h says.
//
// Up to kTeamMaxTokens tokens (a decode of a few requests) the stack runs instead as ONE
// parallel region (team_forward.h): the same kernels' inner loops, called directly, each thread
// taking its share of every matmul's output rows and of attention's work items, with a spin
// barrier between them, where the dispatcher path forks and joins the thread team for every
// matmul and attention (~5 a layer) and allocates every output. Same functions, same inputs,
// same order per output element: the same bits (tests/model/test_native_layers.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "dispatcher_ops.h"
#include "team_forward.h"

#define NANOSERVE_STR(x) #x
#define NANOSERVE_TIER_NAME(x) NANOSERVE_STR(x)

namespace {

using team_forward::PackedMatmul;

using dispatcher_ops::Ops;
using dispatcher_ops::ops;

using team_forward::Layer;

at::Tensor matmul(const Ops& f, const at::Tensor& x, const PackedMatmul& w) {
  return f.matmul.call(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w),
                       std::get<4>(w));
}

// An optional output norm (Gemma's sandwich) applied where the layer has one.
at::Tensor output(const Ops& f, at::Tensor out, const std::optional<at::Tensor>& norm,
                  double eps) {
  return norm ? f.rms_norm.call(out, *norm, eps) : out;
}

// A model's layers, weights and caches bound once; `forward` runs them all.
class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t head_dim, double eps, at::Tensor final_norm,
             bool is_gelu_tanh, double q_scale)
      : shape_{num_heads, head_dim, eps, is_gelu_tanh, q_scale},
        final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<PackedMatmul> qkv,
                 PackedMatmul o,
                 PackedMatmul gate_up, PackedMatmul down, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 at::Tensor k_cache, at::Tensor v_cache,
                 std::optional<at::Tensor> attn_output_norm,
                 std::optional<at::Tensor> mlp_output_norm, int64_t window,
                 bool uses_local_rope, int64_t kv_group) {
    TORCH_CHECK(attn_output_norm.has_value() == mlp_output_norm.has_value() &&
                    (layers_.empty() || attn_output_norm.has_value() ==
                                            layers_.front().attn_output_norm.has_value()),
                "decode_layers: sandwich norms come in pairs, on every layer or none");
    TORCH_CHECK(window >= 0 && kv_group >= 0, "decode_layers: a negative window or KV group");
    TORCH_CHECK(!qkv.empty(), "decode_layers: qkv has at least one part");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qkv),
                            std::move(o), std::move(gate_up), std::move(down),
                            std::move(qkv_bias), std::move(q_norm), std::move(k_norm),
                            std::move(k_cache), std::move(v_cache), std::move(attn_output_norm),
                            std::move(mlp_output_norm), window, uses_local_rope, kv_group});
  }

  // hidden [T, hidden_size] (the embeddings, updated in place) -> the final norm's output.
  // The step's tensors are rope_store's and decode_attention's (the attention backend's
  // metadata): positions and cache_index int64 [T], block_table int32 [T, max_blocks],
  // context_lens int32 [T]; the local RoPE tables (the global ones where not given) and, per
  // KV layer group 1.., its own cache index and block table.
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos_table, const at::Tensor& sin_table,
                     const at::Tensor& positions, const at::Tensor& cache_index,
                     const at::Tensor& block_table, const at::Tensor& context_lens,
                     const std::optional<at::Tensor>& local_cos,
                     const std::optional<at::Tensor>& local_sin,
                     const std::vector<at::Tensor>& group_cache_index,
                     const std::vector<at::Tensor>& group_block_tables) {
    TORCH_CHECK(!layers_.empty(), "decode_layers: a model has at least one layer");
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value() &&
                    group_cache_index.size() == group_block_tables.size(),
                "decode_layers: local cos and sin come together, and a block table per index");
    std::vector<at::Tensor> indexes{cache_index}, tables{block_table};
    indexes.insert(indexes.end(), group_cache_index.begin(), group_cache_index.end());
    tables.insert(tables.end(), group_block_tables.begin(), group_block_tables.end());
    const int64_t tokens = hidden.size(0);
    const team_forward::Step step{
        cos_table, sin_table, local_cos ? *local_cos : cos_table,
        local_sin ? *local_sin : sin_table, positions, indexes, tables, context_lens,
        shape_.num_heads, shape_.head_dim, shape_.eps,
        1.0 / std::sqrt(static_cast<double>(shape_.head_dim)), shape_.q_scale,
        shape_.is_gelu_tanh};
    if (tokens > 0 && tokens <= team_forward::kTeamMaxTokens)
      return team_forward::forward(layers_, final_norm_, hidden, step);
    return dispatched(hidden, step);
  }

 private:
  // Layer by layer through the dispatcher: the Python loop's kernel calls, in its order.
  at::Tensor dispatched(at::Tensor& hidden, const team_forward::Step& st) {
    const Ops& f = ops();
    const int64_t tokens = hidden.size(0), H = st.num_heads, D = st.head_dim;
    const double eps = st.eps;
    at::Tensor delta;
    for (Layer& layer : layers_) {
      const size_t g = st.group(layer);
      at::Tensor x = delta.defined() ? f.add_rms_norm.call(hidden, delta, layer.input_norm, eps)
                                     : f.rms_norm.call(hidden, layer.input_norm, eps);
      at::Tensor qkv = matmul(f, x, layer.qkv.front());
      if (layer.qkv.size() > 1) {  // ConcatWeight's torch.cat of its parts' products
        std::vector<at::Tensor> parts{qkv};
        for (size_t p = 1; p < layer.qkv.size(); ++p) parts.push_back(matmul(f, x, layer.qkv[p]));
        qkv = at::cat(parts, -1);
      }
      at::Tensor q = f.rope_store.call(qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, eps,
                                       st.cos(layer), st.sin(layer), st.positions,
                                       layer.k_cache, layer.v_cache, st.cache_index[g]);
      if (st.q_scale != 1.0) q = q * st.q_scale;  // the Python loop's op
      at::Tensor attn = at::empty({tokens, H, D}, hidden.options());
      f.attention.call(q, layer.k_cache, layer.v_cache, st.block_table[g], st.context_lens,
                       st.scale, attn, layer.window);
      at::Tensor o = matmul(f, attn.view({tokens, H * D}), layer.o);
      x = f.add_rms_norm.call(hidden, output(f, o, layer.attn_output_norm, eps),
                              layer.post_norm, eps);
      at::Tensor gate_up = matmul(f, x, layer.gate_up);
      at::Tensor h = st.is_gelu_tanh ? f.gelu_tanh_mul.call(gate_up) : f.silu_mul.call(gate_up);
      delta = output(f, matmul(f, h, layer.down), layer.mlp_output_norm, eps);
    }
    return f.add_rms_norm.call(hidden, delta, final_norm_, eps);
  }

  team_forward::Shape shape_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, double, at::Tensor, bool, double>(), py::arg("num_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("final_norm"),
           py::arg("is_gelu_tanh") = false, py::arg("q_scale") = 1.0)
      .def("add_layer", &LayerStack::add_layer,
           "a layer's norms, packed matmuls (packed, ggml_type, N, K, wide; qkv a list of "
           "row parts), optional qkv "
           "bias and q/k norms, its caches, optional sandwich norms, its window, whether it "
           "reads the local RoPE tables, and its KV layer group",
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("attn_output_norm") = py::none(), py::arg("mlp_output_norm") = py::none(),
           py::arg("window") = 0, py::arg("uses_local_rope") = false, py::arg("kv_group") = 0)
      .def("forward", &LayerStack::forward,
           "every layer and the final norm over hidden [T, hidden_size] (updated in place)",
           py::arg("hidden"), py::arg("cos_table"), py::arg("sin_table"), py::arg("positions"),
           py::arg("cache_index"), py::arg("block_table"), py::arg("context_lens"),
           py::arg("local_cos") = py::none(), py::arg("local_sin") = py::none(),
           py::arg("group_cache_index") = std::vector<at::Tensor>(),
           py::arg("group_block_tables") = std::vector<at::Tensor>(), nogil);
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule, flat (schedule.h)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat)");
  m.attr("cpu_tier") = NANOSERVE_TIER_NAME(NANOSERVE_CPU_TIER);  // the tier it was built for
}
