// Gemma 4's decoder layers as one native call: gemma4_layers.py's BoundGemma4Layer.forward over
// layer_ops.py's fused table, layer after layer, with no Python between the calls. Why and what
// it measured: nanoserve/model/gemma4_native.py.
//
// Every call is the one the Python layer makes, in its order: the fused kernels through the
// dispatcher (`nanoserve::*` ops that quant_matmul.cpp, fused_ops.cpp and paged_attention.cpp
// register) and, where the Python layer runs a PyTorch op, the same ATen op on the same view
// (at::rms_norm, at::gelu, at::cat, mul, add_, mul_): the hidden states and caches are the
// Python loop's bit for bit (tests/model/test_gemma4_native.py). A layer:
//
//   x = rms_norm(h, input_norm);  qkv = x Wqkv
//   v = at::rms_norm(v) in place; q = rope_store(qkv)   (k and v written to its cache)
//     a KV-shared layer: qkv = q alone; q = rope(at::rms_norm(q, q_norm)) in ATen, no write
//   attn = decode_attention(q * sqrt(D), its (or its source's) cache, its KV group, window)
//   x = add_rms_norm(h, rms_norm(attn Wo, attn_output_norm), post_norm)
//   h += rms_norm(gelu_tanh_mul(x Wgate_up) Wdown, mlp_output_norm)
//   h += rms_norm(at::gelu(h Wgate, tanh) * ple[:, layer] Wproj, ple_norm)  (per-layer inputs)
//   h *= layer_scalar
//
// and rms_norm(h, final_norm) after the last. Each op is its own call (the dispatcher path of
// decode_layers.cpp); a few tokens as one parallel region, as team_forward.h runs the other
// families, is a later step. The MoE block is not here: a model with experts runs the Python
// loop. No instructions of its own: the matmuls are the tier's that registered
// packed_matmul, so one build serves every tier.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "dispatcher_ops.h"
namespace {

// packed_matmul's weight arguments: (packed, ggml_type, N, K, wide form or None)
using PackedMatmul = std::tuple<at::Tensor, int64_t, int64_t, int64_t, std::optional<at::Tensor>>;

using dispatcher_ops::Ops;
using dispatcher_ops::ops;

at::Tensor matmul(const Ops& f, const at::Tensor& x, const PackedMatmul& w) {
  return f.matmul.call(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w),
                       std::get<4>(w));
}

// A weight of several row parts (a GGUF file's q, k and v in two types): ConcatWeight's
// torch.cat of each part's product.
at::Tensor matmul(const Ops& f, const at::Tensor& x, const std::vector<PackedMatmul>& parts) {
  at::Tensor out = matmul(f, x, parts.front());
  if (parts.size() == 1) return out;
  std::vector<at::Tensor> products{out};
  for (size_t p = 1; p < parts.size(); ++p) products.push_back(matmul(f, x, parts[p]));
  return at::cat(products, -1);
}

// rope.py's apply_rope: pairs (i, i + D/2) of x [T, H, D] turned by cos, sin [T, 1, D].
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct Layer {
  at::Tensor input_norm, post_norm, attn_output_norm, mlp_output_norm;
  std::vector<PackedMatmul> qkv;  // q, k, v rows (q alone where it shares KV), in row parts
  PackedMatmul o, gate_up, down;
  at::Tensor q_norm;
  std::optional<at::Tensor> k_norm;  // None where it shares KV
  at::Tensor k_cache, v_cache;  // its own, or (sharing KV) its source layer's
  std::optional<PackedMatmul> ple_gate, ple_proj;  // the per-layer input's gated residual
  std::optional<at::Tensor> ple_norm;
  at::Tensor layer_scalar;  // [1]
  int64_t index, head_dim, num_kv_heads;
  bool owns_kv;
  double q_scale;  // sqrt(head_dim), as Python computes it: attention's scale is 1
  int64_t window;  // the keys it attends (0: the whole context)
  bool uses_local_rope;  // the step's local cos/sin tables, not its global ones
  int64_t kv_group;  // the step's block table and cache index it reads (0 past the last)
};

// The step's tensors: the attention backend's metadata, a cache index and block table per KV
// layer group.
struct Step {
  const at::Tensor &cos_table, &sin_table, &local_cos, &local_sin, &positions;
  const std::vector<at::Tensor>&cache_index, &block_table;
  const at::Tensor& context_lens;
  const std::optional<at::Tensor>& per_layer_inputs;  // [T, L, P]

  // A layer's KV group in this step: a step given one group's metadata uses it for every layer.
  size_t group(const Layer& layer) const {
    return static_cast<size_t>(layer.kv_group) < cache_index.size()
               ? static_cast<size_t>(layer.kv_group) : 0;
  }
  const at::Tensor& cos(const Layer& layer) const {
    return layer.uses_local_rope ? local_cos : cos_table;
  }
  const at::Tensor& sin(const Layer& layer) const {
    return layer.uses_local_rope ? local_sin : sin_table;
  }
};

// A Gemma 4 model's layers, weights and caches bound once; `forward` runs them all.
class Gemma4Stack {
 public:
  Gemma4Stack(int64_t num_heads, double eps, at::Tensor final_norm)
      : num_heads_(num_heads), eps_(eps), final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor attn_output_norm,
                 at::Tensor mlp_output_norm, std::vector<PackedMatmul> qkv, PackedMatmul o,
                 PackedMatmul gate_up, PackedMatmul down, at::Tensor q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache,
                 std::optional<PackedMatmul> ple_gate, std::optional<PackedMatmul> ple_proj,
                 std::optional<at::Tensor> ple_norm, at::Tensor layer_scalar, int64_t head_dim,
                 int64_t num_kv_heads, bool owns_kv, double q_scale, int64_t window,
                 bool uses_local_rope, int64_t kv_group) {
    TORCH_CHECK(!qkv.empty(), "gemma4_layers: qkv has at least one part");
    TORCH_CHECK(owns_kv == k_norm.has_value(),
                "gemma4_layers: a layer that owns its KV has a k norm, a KV-shared one none");
    TORCH_CHECK(ple_gate.has_value() == ple_proj.has_value() &&
                    ple_gate.has_value() == ple_norm.has_value(),
                "gemma4_layers: the per-layer input's gate, projection and norm come together");
    TORCH_CHECK(window >= 0 && kv_group >= 0, "gemma4_layers: a negative window or KV group");
    const int64_t index = static_cast<int64_t>(layers_.size());
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm),
                            std::move(attn_output_norm), std::move(mlp_output_norm),
                            std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
                            std::move(q_norm), std::move(k_norm), std::move(k_cache),
                            std::move(v_cache), std::move(ple_gate), std::move(ple_proj),
                            std::move(ple_norm), std::move(layer_scalar), index, head_dim,
                            num_kv_heads, owns_kv, q_scale, window, uses_local_rope, kv_group});
  }

  // hidden [T, hidden_size] (the embeddings, updated in place) -> the final norm's output. The
  // step's tensors are those of decode_layers.cpp's LayerStack.forward, and the per-layer
  // inputs [T, L, P] (gemma4_layers.py's per_layer_inputs) where the layers take them.
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos_table, const at::Tensor& sin_table,
                     const at::Tensor& positions, const at::Tensor& cache_index,
                     const at::Tensor& block_table, const at::Tensor& context_lens,
                     const std::optional<at::Tensor>& local_cos,
                     const std::optional<at::Tensor>& local_sin,
                     const std::vector<at::Tensor>& group_cache_index,
                     const std::vector<at::Tensor>& group_block_tables,
                     const std::optional<at::Tensor>& per_layer_inputs) {
    TORCH_CHECK(!layers_.empty(), "gemma4_layers: a model has at least one layer");
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value() &&
                    group_cache_index.size() == group_block_tables.size(),
                "gemma4_layers: local cos and sin come together, and a block table per index");
    TORCH_CHECK(per_layer_inputs.has_value() || !layers_.front().ple_gate.has_value(),
                "gemma4_layers: this model's layers take per-layer inputs");
    std::vector<at::Tensor> indexes{cache_index}, tables{block_table};
    indexes.insert(indexes.end(), group_cache_index.begin(), group_cache_index.end());
    tables.insert(tables.end(), group_block_tables.begin(), group_block_tables.end());
    const Step step{cos_table, sin_table, local_cos ? *local_cos : cos_table,
                    local_sin ? *local_sin : sin_table, positions, indexes, tables,
                    context_lens, per_layer_inputs};
    const Ops& f = ops();
    for (const Layer& layer : layers_) run_layer(f, layer, hidden, step);
    return f.rms_norm.call(hidden, final_norm_, eps_);
  }

 private:
  // BoundGemma4Layer.forward: hidden updated in place.
  void run_layer(const Ops& f, const Layer& layer, at::Tensor& hidden, const Step& st) const {
    const int64_t tokens = hidden.size(0), H = num_heads_, D = layer.head_dim;
    const size_t g = st.group(layer);
    // 1) attention: its output normed, then added
    at::Tensor x = f.rms_norm.call(hidden, layer.input_norm, eps_);
    at::Tensor q = query(f, layer, matmul(f, x, layer.qkv), st, g) * layer.q_scale;
    at::Tensor attn = at::empty({tokens, H, D}, hidden.options());
    f.attention.call(q, layer.k_cache, layer.v_cache, st.block_table[g], st.context_lens,
                     1.0 / std::sqrt(static_cast<double>(D)), attn, layer.window);
    at::Tensor o = f.rms_norm.call(matmul(f, attn.view({tokens, H * D}), layer.o),
                                   layer.attn_output_norm, eps_);
    // 2) the MLP on the stream after the attention
    x = f.add_rms_norm.call(hidden, o, layer.post_norm, eps_);
    at::Tensor mlp = matmul(f, f.gelu_tanh_mul.call(matmul(f, x, layer.gate_up)), layer.down);
    hidden.add_(f.rms_norm.call(mlp, layer.mlp_output_norm, eps_));
    // 3) the per-layer input's gated residual, then the layer's scale
    if (layer.ple_gate) {
      at::Tensor gate = at::gelu(matmul(f, hidden, *layer.ple_gate), "tanh") *
                        st.per_layer_inputs->select(1, layer.index);  // [T, P]
      hidden.add_(f.rms_norm.call(matmul(f, gate, *layer.ple_proj), *layer.ple_norm, eps_));
    }
    hidden.mul_(layer.layer_scalar);
  }

  // q [T, H, D], normed and turned; k and v (where the layer owns its cache) written to it.
  at::Tensor query(const Ops& f, const Layer& layer, at::Tensor qkv, const Step& st,
                   size_t g) const {
    const int64_t tokens = qkv.size(0), H = num_heads_, D = layer.head_dim;
    if (!layer.owns_kv) {  // q alone: the Python layer's PyTorch ops, rows of the whole tables
      at::Tensor q = at::rms_norm(qkv.view({tokens, H, D}), {D}, layer.q_norm, eps_);
      at::Tensor cos = st.cos(layer).index_select(0, st.positions).unsqueeze(1);
      at::Tensor sin = st.sin(layer).index_select(0, st.positions).unsqueeze(1);
      return apply_rope(q, cos, sin);
    }
    const int64_t kv_end = (H + layer.num_kv_heads) * D;
    at::Tensor v = qkv.slice(1, kv_end).view({tokens, layer.num_kv_heads, D});
    v.copy_(at::rms_norm(v, {D}, std::nullopt, eps_));  // the value's norm has no weight
    return f.rope_store.call(qkv, std::nullopt, layer.q_norm, layer.k_norm, eps_, st.cos(layer),
                             st.sin(layer), st.positions, layer.k_cache, layer.v_cache,
                             st.cache_index[g]);
  }

  int64_t num_heads_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Gemma4Stack>(m, "Gemma4Stack")
      .def(py::init<int64_t, double, at::Tensor>(), py::arg("num_heads"), py::arg("eps"),
           py::arg("final_norm"))
      .def("add_layer", &Gemma4Stack::add_layer,
           "a layer's norms, packed matmuls (packed, ggml_type, N, K, wide; qkv a list of row "
           "parts), q/k norms (k None where it shares KV), the caches it reads, its per-layer "
           "input's gate, projection and norm (None where it has none), layer scalar, head "
           "size, KV heads, whether it owns its KV, query scale, window, whether it reads the "
           "local RoPE tables, and its KV layer group",
           py::arg("input_norm"), py::arg("post_norm"), py::arg("attn_output_norm"),
           py::arg("mlp_output_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("q_norm"), py::arg("k_norm"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("ple_gate"), py::arg("ple_proj"), py::arg("ple_norm"),
           py::arg("layer_scalar"), py::arg("head_dim"), py::arg("num_kv_heads"),
           py::arg("owns_kv"), py::arg("q_scale"), py::arg("window"),
           py::arg("uses_local_rope"), py::arg("kv_group"))
      .def("forward", &Gemma4Stack::forward,
           "every layer and the final norm over hidden [T, hidden_size] (updated in place)",
           py::arg("hidden"), py::arg("cos_table"), py::arg("sin_table"), py::arg("positions"),
           py::arg("cache_index"), py::arg("block_table"), py::arg("context_lens"),
           py::arg("local_cos") = py::none(), py::arg("local_sin") = py::none(),
           py::arg("group_cache_index") = std::vector<at::Tensor>(),
           py::arg("group_block_tables") = std::vector<at::Tensor>(),
           py::arg("per_layer_inputs") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
