// A hybrid model's decoder layers (Qwen3.5/3.6: Gated DeltaNet layers among gated full
// attention layers) as one native call, with no Python between the layers. Why and what it
// measured: nanoserve/model/hybrid_native.py.
//
// Every call is the one the Python layer makes, in its order: the fused kernels through the
// dispatcher (`nanoserve::*` ops that quant_matmul.cpp, fused_ops.cpp and paged_attention.cpp
// register), the DeltaNet mixer through delta_net.h's own `delta_rule` (the function the
// `delta_rule` extension runs), the two gates through gated_rows.h's functions (the ones the
// fused table's `gated_rms_norm` and `sigmoid_mul` run), and, where the Python layer runs a
// PyTorch op, the same ATen op on the same view (cat, contiguous copies): the hidden states,
// caches and states are the Python loop's bit for bit (tests/model/test_hybrid_native.py). A
// DeltaNet layer (hybrid_layers.py's BoundDeltaNetLayer.forward):
//
//   x = add_rms_norm(h, delta, input_norm)          (rms_norm before the first layer)
//   qkv | z = x Win;  b | a = x Wba
//   core = delta_rule(qkv, a, b, its conv, the step's states)   (states updated in place)
//   x = add_rms_norm(h, gated_rms_norm(core, z, norm) Wout, post_norm)   (per value head)
//   delta = silu_mul(x Wgate_up) Wdown
//
// and a full attention layer (llama.py's BoundDecoderLayer._forward_gated):
//
//   x = add_rms_norm(h, delta, input_norm);  q = rope_store(x Wqkv)   (k, v into the cache)
//   attn = sigmoid_mul(decode_attention(q, cache), x Wgate)  (no gate: attention alone)
//   x = add_rms_norm(h, attn Wo, post_norm);  delta = silu_mul(x Wgate_up) Wdown
//
// and add_rms_norm(h, delta, final_norm) after the last. Each op is its own call (as
// gemma4_layers.cpp runs Gemma 4); a few tokens as one parallel region, as team_forward.h runs
// the dense families, is a later step. The DeltaNet mixer is built for avx2 only (delta_net.h),
// so this module is too; the matmuls are the process's tier's, through the dispatcher.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "delta_net.h"
#include "dispatcher_ops.h"
#include "gated_rows.h"

namespace {

// packed_matmul's weight arguments: (packed, ggml_type, N, K, wide form or None), a weight in
// one or several row parts
using PackedMatmul = std::tuple<at::Tensor, int64_t, int64_t, int64_t, std::optional<at::Tensor>>;
using Parts = std::vector<PackedMatmul>;

using dispatcher_ops::Ops;
using dispatcher_ops::ops;

// x @ W^T for a weight of one or several row parts: ConcatWeight's torch.cat of each part's
// product, as the Python loop's bound matmul makes it.
at::Tensor matmul(const Ops& f, const at::Tensor& x, const Parts& parts) {
  auto one = [&](const PackedMatmul& w) {
    return f.matmul.call(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w),
                         std::get<4>(w));
  };
  if (parts.size() == 1) return one(parts.front());
  std::vector<at::Tensor> products;
  for (const PackedMatmul& part : parts) products.push_back(one(part));
  return at::cat(products, -1);
}

// A Gated DeltaNet layer's own weights (hybrid_layers.py's DeltaNetLayer).
struct DeltaNet {
  Parts in_proj, ba_proj, out_proj;  // [conv_dim + value_dim | 2 H | hidden] rows
  at::Tensor conv_weight, neg_exp_a, dt_bias, norm;
  int64_t linear_index;  // its place among the model's DeltaNet layers (the states' layer)
};

// A full attention layer's own weights and cache (llama.py's DecoderLayer).
struct Attention {
  Parts qkv, gate, o;  // gate empty where the layer has no output gate
  std::optional<at::Tensor> qkv_bias, q_norm, k_norm;
  at::Tensor k_cache, v_cache;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Parts gate_up, down;
  std::optional<DeltaNet> delta_net;  // else attention
  std::optional<Attention> attention;
};

// The step's tensors: the attention backend's metadata and the DeltaNet states
// (hybrid_layers.py's HybridStates).
struct Step {
  const at::Tensor &cos, &sin, &positions, &cache_index, &block_table, &context_lens;
  const at::Tensor &conv_states, &ssm_states, &slots, &query_start, &snapshots;
};

// A hybrid model's layers, weights, caches bound once; `forward` runs them all.
class HybridStack {
 public:
  HybridStack(int64_t num_heads, int64_t head_dim, double eps, at::Tensor final_norm,
              int64_t num_key_heads, int64_t num_value_heads, int64_t value_head_dim,
              bool v_heads_tiled)
      : num_heads_(num_heads), head_dim_(head_dim), eps_(eps),
        final_norm_(std::move(final_norm)), num_key_heads_(num_key_heads),
        num_value_heads_(num_value_heads), value_head_dim_(value_head_dim),
        v_heads_tiled_(v_heads_tiled) {}

  void add_delta_layer(at::Tensor input_norm, at::Tensor post_norm, Parts in_proj,
                       Parts ba_proj, Parts out_proj, Parts gate_up, Parts down,
                       at::Tensor conv_weight, at::Tensor neg_exp_a, at::Tensor dt_bias,
                       at::Tensor norm, int64_t linear_index) {
    TORCH_CHECK(!in_proj.empty() && !ba_proj.empty() && !out_proj.empty() && !gate_up.empty() &&
                    !down.empty(),
                "hybrid_layers: every matmul has at least one part");
    TORCH_CHECK(linear_index >= 0, "hybrid_layers: a negative linear layer index");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(gate_up),
                            std::move(down),
                            DeltaNet{std::move(in_proj), std::move(ba_proj), std::move(out_proj),
                                     std::move(conv_weight), std::move(neg_exp_a),
                                     std::move(dt_bias), std::move(norm), linear_index},
                            std::nullopt});
  }

  void add_attention_layer(at::Tensor input_norm, at::Tensor post_norm, Parts qkv, Parts gate,
                           Parts o, Parts gate_up, Parts down, std::optional<at::Tensor> qkv_bias,
                           std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                           at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(!qkv.empty() && !o.empty() && !gate_up.empty() && !down.empty(),
                "hybrid_layers: every matmul has at least one part");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(gate_up),
                            std::move(down), std::nullopt,
                            Attention{std::move(qkv), std::move(gate), std::move(o),
                                      std::move(qkv_bias), std::move(q_norm), std::move(k_norm),
                                      std::move(k_cache), std::move(v_cache)}});
  }

  // hidden [T, hidden_size] (the embeddings, updated in place) -> the final norm's output. The
  // attention's tensors are decode_layers.cpp's LayerStack.forward's (one KV layer group, the
  // global RoPE tables); the states, slots, query_start and snapshots are the step's
  // HybridStates (delta_net_ops.py's contract), updated in place.
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos_table, const at::Tensor& sin_table,
                     const at::Tensor& positions, const at::Tensor& cache_index,
                     const at::Tensor& block_table, const at::Tensor& context_lens,
                     const at::Tensor& conv_states, const at::Tensor& ssm_states,
                     const at::Tensor& slots, const at::Tensor& query_start,
                     const at::Tensor& snapshots) {
    TORCH_CHECK(!layers_.empty(), "hybrid_layers: a model has at least one layer");
    const Step step{cos_table, sin_table, positions, cache_index, block_table, context_lens,
                    conv_states, ssm_states, slots, query_start, snapshots};
    const Ops& f = ops();
    at::Tensor delta;
    for (const Layer& layer : layers_) {
      at::Tensor x = delta.defined() ? f.add_rms_norm.call(hidden, delta, layer.input_norm, eps_)
                                     : f.rms_norm.call(hidden, layer.input_norm, eps_);
      at::Tensor out = layer.delta_net ? mix(f, *layer.delta_net, x, step)
                                       : attend(f, *layer.attention, x, step);
      x = f.add_rms_norm.call(hidden, out, layer.post_norm, eps_);
      delta = matmul(f, f.silu_mul.call(matmul(f, x, layer.gate_up)), layer.down);
    }
    return f.add_rms_norm.call(hidden, delta, final_norm_, eps_);
  }

 private:
  // BoundDeltaNetLayer.forward's token mixer: x [T, hidden] -> out_proj's output [T, hidden].
  at::Tensor mix(const Ops& f, const DeltaNet& w, const at::Tensor& x, const Step& st) const {
    const int64_t dv = value_head_dim_, H = num_value_heads_, value_dim = H * dv;
    at::Tensor proj = matmul(f, x, w.in_proj);  // [T, conv_dim + value_dim]
    const int64_t conv_dim = proj.size(1) - value_dim;
    at::Tensor ba = matmul(f, x, w.ba_proj);  // [T, 2 H]: b, then a
    at::Tensor core;  // [T, value_dim]
    {  // the Python layer's scope, so `bench step` counts the mixer as its "state update"
      RECORD_FUNCTION("nanoserve.delta_rule", c10::ArrayRef<const c10::IValue>{});
      core = delta_net::delta_rule(proj.slice(1, 0, conv_dim).contiguous(),
                                   ba.slice(1, H).contiguous(), ba.slice(1, 0, H).contiguous(),
                                   w.conv_weight, w.neg_exp_a, w.dt_bias, st.conv_states,
                                   st.ssm_states, w.linear_index, st.slots, st.query_start,
                                   st.snapshots, num_key_heads_, v_heads_tiled_);
    }
    // the gated norm: per value head, RMSNorm with its weight, then * silu(z)
    return matmul(f, gated_rows::gated_rms_norm(core, proj.slice(1, conv_dim), w.norm, eps_),
                  w.out_proj);
  }

  // _forward_gated's attention: x [T, hidden] -> o's output [T, hidden]; k and v written to
  // the layer's cache.
  at::Tensor attend(const Ops& f, const Attention& w, const at::Tensor& x,
                    const Step& st) const {
    const int64_t tokens = x.size(0), H = num_heads_, D = head_dim_;
    at::Tensor q = f.rope_store.call(matmul(f, x, w.qkv), w.qkv_bias, w.q_norm, w.k_norm, eps_,
                                     st.cos, st.sin, st.positions, w.k_cache, w.v_cache,
                                     st.cache_index);  // [T, H, D]
    at::Tensor attn = at::empty({tokens, H, D}, x.options());
    f.attention.call(q, w.k_cache, w.v_cache, st.block_table, st.context_lens,
                     1.0 / std::sqrt(static_cast<double>(D)), attn, 0);
    at::Tensor flat = attn.view({tokens, H * D});
    if (!w.gate.empty()) flat = gated_rows::sigmoid_mul(flat, matmul(f, x, w.gate));
    return matmul(f, flat, w.o);
  }

  int64_t num_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  int64_t num_key_heads_, num_value_heads_, value_head_dim_;
  bool v_heads_tiled_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<HybridStack>(m, "HybridStack")
      .def(py::init<int64_t, int64_t, double, at::Tensor, int64_t, int64_t, int64_t, bool>(),
           py::arg("num_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("final_norm"),
           py::arg("num_key_heads"), py::arg("num_value_heads"), py::arg("value_head_dim"),
           py::arg("v_heads_tiled"))
      .def("add_delta_layer", &HybridStack::add_delta_layer,
           "a Gated DeltaNet layer: its norms, packed matmuls (each a list of row parts of "
           "(packed, ggml_type, N, K, wide)), conv weight, -exp(A_log), dt bias, gated norm "
           "weight and its index among the DeltaNet layers",
           py::arg("input_norm"), py::arg("post_norm"), py::arg("in_proj"), py::arg("ba_proj"),
           py::arg("out_proj"), py::arg("gate_up"), py::arg("down"), py::arg("conv_weight"),
           py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("norm"), py::arg("linear_index"))
      .def("add_attention_layer", &HybridStack::add_attention_layer,
           "a full attention layer: its norms, packed matmuls (gate an empty list where it has "
           "no output gate), optional qkv bias and q/k norms, and its caches",
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("gate"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("k_cache"), py::arg("v_cache"))
      .def("forward", &HybridStack::forward,
           "every layer and the final norm over hidden [T, hidden_size] (updated in place)",
           py::arg("hidden"), py::arg("cos_table"), py::arg("sin_table"), py::arg("positions"),
           py::arg("cache_index"), py::arg("block_table"), py::arg("context_lens"),
           py::arg("conv_states"), py::arg("ssm_states"), py::arg("slots"),
           py::arg("query_start"), py::arg("snapshots"),
           py::call_guard<py::gil_scoped_release>());
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule (flat)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat): the "
        "DeltaNet strips of its delta_rule");
}
