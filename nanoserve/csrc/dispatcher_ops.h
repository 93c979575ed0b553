// The fused kernels as the native layer stacks call them (decode_layers.cpp, gemma4_layers.cpp,
// hybrid_layers.cpp): typed handles on the dispatcher's ops, which the kernels' own extensions
// register (quant_matmul.cpp, fused_ops.cpp, paged_attention.cpp) and which the process's tier
// serves, so a stack built once for avx2 runs every tier's matmul.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace dispatcher_ops {

// The kernels' own C++ signatures (a typed handle must name them exactly): quant_matmul.cpp
// takes references, fused_ops.cpp and paged_attention.cpp take tensors by value.
using T = at::Tensor;
using OptT = std::optional<at::Tensor>;
using MatmulFn = T(const T&, const T&, int64_t, int64_t, int64_t, const OptT&);
using RmsNormFn = T(T, T, double);
using AddRmsNormFn = T(T, T, T, double);
using GateFn = T(T);  // silu_mul and gelu_tanh_mul
using RopeStoreFn = T(T, OptT, OptT, OptT, double, T, T, T, T, T, T);
using AttentionFn = void(T, T, T, T, T, double, T, int64_t);  // ..., out, window

struct Ops {
  c10::TypedOperatorHandle<MatmulFn> matmul;
  c10::TypedOperatorHandle<RmsNormFn> rms_norm;
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm;
  c10::TypedOperatorHandle<GateFn> silu_mul, gelu_tanh_mul;
  c10::TypedOperatorHandle<RopeStoreFn> rope_store;
  c10::TypedOperatorHandle<AttentionFn> attention;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline const Ops& ops() {  // found once: the kernels' extensions load before the first stack
  static const Ops found{op<MatmulFn>("nanoserve::packed_matmul"),
                         op<RmsNormFn>("nanoserve::rms_norm"),
                         op<AddRmsNormFn>("nanoserve::add_rms_norm"),
                         op<GateFn>("nanoserve::silu_mul"),
                         op<GateFn>("nanoserve::gelu_tanh_mul"),
                         op<RopeStoreFn>("nanoserve::rope_store"),
                         op<AttentionFn>("nanoserve::decode_attention")};
  return found;
}

}  // namespace dispatcher_ops
