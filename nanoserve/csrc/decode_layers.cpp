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
//   q = rope_store(qkv_matmul(x))                 (k and v go into the cache)
//   attn = decode_attention(q, cache)
//   x = add_rms_norm(hidden, o_matmul(attn), post_norm)
//   delta = down_matmul(silu_mul(gate_up_matmul(x)))
//
// and after the last layer, add_rms_norm(hidden, delta, final_norm).
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

#include "team_forward.h"

#define NANOSERVE_STR(x) #x
#define NANOSERVE_TIER_NAME(x) NANOSERVE_STR(x)

namespace {

using team_forward::PackedMatmul;

// The kernels' own C++ signatures (a typed handle must name them exactly): quant_matmul.cpp
// takes references, fused_ops.cpp and paged_attention.cpp take tensors by value.
using T = at::Tensor;
using OptT = std::optional<at::Tensor>;
using MatmulFn = T(const T&, const T&, int64_t, int64_t, int64_t, const OptT&);
using RmsNormFn = T(T, T, double);
using AddRmsNormFn = T(T, T, T, double);
using SiluMulFn = T(T);
using RopeStoreFn = T(T, OptT, OptT, OptT, double, T, T, T, T, T, T);
using AttentionFn = void(T, T, T, T, T, double, T, int64_t);  // ..., out, window

struct Ops {
  c10::TypedOperatorHandle<MatmulFn> matmul;
  c10::TypedOperatorHandle<RmsNormFn> rms_norm;
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul;
  c10::TypedOperatorHandle<RopeStoreFn> rope_store;
  c10::TypedOperatorHandle<AttentionFn> attention;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const Ops& ops() {  // found once: the kernels' extensions are loaded before the first stack
  static const Ops found{op<MatmulFn>("nanoserve::packed_matmul"),
                         op<RmsNormFn>("nanoserve::rms_norm"),
                         op<AddRmsNormFn>("nanoserve::add_rms_norm"),
                         op<SiluMulFn>("nanoserve::silu_mul"),
                         op<RopeStoreFn>("nanoserve::rope_store"),
                         op<AttentionFn>("nanoserve::decode_attention")};
  return found;
}

using team_forward::Layer;

at::Tensor matmul(const Ops& f, const at::Tensor& x, const PackedMatmul& w) {
  return f.matmul.call(x, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w),
                       std::get<4>(w));
}

// A model's layers, weights and caches bound once; `forward` runs them all.
class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : num_heads_(num_heads), head_dim_(head_dim), eps_(eps),
        final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, PackedMatmul qkv, PackedMatmul o,
                 PackedMatmul gate_up, PackedMatmul down, std::optional<at::Tensor> qkv_bias,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 at::Tensor k_cache, at::Tensor v_cache) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qkv),
                            std::move(o), std::move(gate_up), std::move(down),
                            std::move(qkv_bias), std::move(q_norm), std::move(k_norm),
                            std::move(k_cache), std::move(v_cache)});
  }

  // hidden [T, hidden_size] (the embeddings, updated in place) -> the final norm's output.
  // The step's tensors are rope_store's and decode_attention's (the attention backend's
  // metadata): positions and cache_index int64 [T], block_table int32 [T, max_blocks],
  // context_lens int32 [T].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos_table, const at::Tensor& sin_table,
                     const at::Tensor& positions, const at::Tensor& cache_index,
                     const at::Tensor& block_table, const at::Tensor& context_lens) {
    TORCH_CHECK(!layers_.empty(), "decode_layers: a model has at least one layer");
    const int64_t tokens = hidden.size(0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    if (tokens > 0 && tokens <= team_forward::kTeamMaxTokens) {
      const team_forward::Step step{cos_table, sin_table, positions, cache_index, block_table,
                                    context_lens, num_heads_, head_dim_, eps_, scale};
      return team_forward::forward(layers_, final_norm_, hidden, step);
    }
    const Ops& f = ops();
    at::Tensor delta;
    for (Layer& layer : layers_) {
      at::Tensor x = delta.defined() ? f.add_rms_norm.call(hidden, delta, layer.input_norm, eps_)
                                     : f.rms_norm.call(hidden, layer.input_norm, eps_);
      at::Tensor qkv = matmul(f, x, layer.qkv);
      at::Tensor q = f.rope_store.call(qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, eps_,
                                       cos_table, sin_table, positions, layer.k_cache,
                                       layer.v_cache, cache_index);
      at::Tensor attn = at::empty({tokens, num_heads_, head_dim_}, hidden.options());
      f.attention.call(q, layer.k_cache, layer.v_cache, block_table, context_lens, scale, attn,
                       0);
      x = f.add_rms_norm.call(hidden, matmul(f, attn.view({tokens, num_heads_ * head_dim_}),
                                             layer.o),
                              layer.post_norm, eps_);
      delta = matmul(f, f.silu_mul.call(matmul(f, x, layer.gate_up)), layer.down);
    }
    return f.add_rms_norm.call(hidden, delta, final_norm_, eps_);
  }

 private:
  int64_t num_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("final_norm"))
      .def("add_layer", &LayerStack::add_layer,
           "a layer's norms, packed matmuls (packed, ggml_type, N, K, wide), optional qkv "
           "bias and q/k norms, and its caches")
      .def("forward", &LayerStack::forward,
           "every layer and the final norm over hidden [T, hidden_size] (updated in place)",
           nogil);
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule, flat (schedule.h)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat)");
  m.attr("cpu_tier") = NANOSERVE_TIER_NAME(NANOSERVE_CPU_TIER);  // the tier it was built for
}
