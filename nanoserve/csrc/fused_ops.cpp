// The decoder layer's element-wise work on the quantized CPU path, in three kinds of call:
// RMSNorm (with the residual add folded in), RoPE with the KV cache write, and the gate
// (SiLU-and-mul, or Gemma's GELU-tanh-and-mul).
// What each computes, the PyTorch ops it replaces and the measured figures that chose it:
// nanoserve/model/fused_ops.py. float32 activations; AVX2 + FMA + F16C.
//
// Rows are split over threads only above kParallelElements (a batch-1 decode stays on one
// thread: OpenMP's fork and join would cost more than its few hundred floats).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "fused_rows.h"
#include "gated_rows.h"

namespace {

using namespace fused_rows;

// Measured on 2 cores, min of 10 (us, 1 thread -> 2): add_rms_norm of 64 rows of 576
// 9.5 -> 5.5, of 32 rows 5.0 -> 5.5 (a split there does not pay); silu_mul of 8 rows of
// 1,536 5.9 -> 4.3. SiLU counts 4 per element (an exp and a division), norms and RoPE 1.
constexpr int64_t kParallelElements = 1 << 15;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), name,
              " must be a contiguous float32 [rows, features] tensor");
}

void check_weight(const torch::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.numel() == n &&
                  w.is_contiguous(),
              name, " must be a contiguous float32 [", n, "] tensor");
}

}  // namespace

// normed [T, N] = RMSNorm(x) * weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, "weight");
  auto out = torch::empty_like(x);
  const float *src = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      norm_row(src + r * n, w, static_cast<float>(eps), n, dst + r * n);
  });
  return out;
}

// hidden += delta (in place: the residual stream), then normed [T, N] = RMSNorm(hidden) * weight.
torch::Tensor add_rms_norm(torch::Tensor hidden, torch::Tensor delta, torch::Tensor weight,
                           double eps) {
  check_rows(hidden, "hidden");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == hidden.sizes(), "delta ", delta.sizes(), " must match hidden ",
              hidden.sizes());
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  check_weight(weight, n, "weight");
  auto out = torch::empty_like(hidden);
  float* h = hidden.data_ptr<float>();
  const float *d = delta.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      add_row(h + r * n, d + r * n, n);
      norm_row(h + r * n, w, static_cast<float>(eps), n, dst + r * n);
    }
  });
  return out;
}

// gate_up [T, 2I] (gate, then up) -> [T, I] = gate's activation times up, each row by `row`.
template <void (*row)(const float*, int64_t, float*)>
torch::Tensor gated_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(4 * n), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) row(src + r * 2 * n, n, dst + r * n);
  });
  return out;
}

// silu(gate) * up, silu(x) = x / (1 + exp(-x)).
torch::Tensor silu_mul(torch::Tensor gate_up) { return gated_mul<silu_mul_row>(gate_up); }

// gelu_tanh(gate) * up (Gemma's gate; gelu_tanh_times says how).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  return gated_mul<gelu_tanh_mul_row>(gate_up);
}

// The attention block's element-wise work between the qkv matmul and attention, per token:
// add the qkv bias (Qwen2), RMSNorm each q and k head (Qwen3), rotate q and k by the cos/sin
// table rows of the token's position, and write k and v into the paged caches
// [Hkv, num_blocks, block_size, D] (float32 or float16; int8 rows are D + 4, kv_int8.h) at
// flat row `cache_index`. Returns q [T, H, D]; qkv's k and v columns are left holding exactly
// what was stored (before rounding to the cache's type), for prefill chunks that attend to
// their own keys.
torch::Tensor rope_store(torch::Tensor qkv, std::optional<torch::Tensor> bias,
                         std::optional<torch::Tensor> q_norm,
                         std::optional<torch::Tensor> k_norm, double eps,
                         torch::Tensor cos_table, torch::Tensor sin_table,
                         torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor cache_index) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [Hkv, num_blocks, block_size, D] tensors "
              "of one shape and dtype");
  const bool is_int8 = k_cache.scalar_type() == torch::kChar;
  const int64_t tokens = qkv.size(0), num_kv_heads = k_cache.size(0);
  const int64_t dim = k_cache.size(3) - (is_int8 ? kv_int8::kScaleBytes : 0);
  TORCH_CHECK(!is_int8 || (dim > 0 && dim % 8 == 0),
              "an int8 cache's head_dim must be a multiple of 8, not ", dim);
  const int64_t plane = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) % dim == 0 && qkv.size(1) / dim > 2 * num_kv_heads,
              "qkv's ", qkv.size(1), " columns are not (H + 2 * ", num_kv_heads, ") heads of ",
              dim);
  const int64_t num_heads = qkv.size(1) / dim - 2 * num_kv_heads;
  check_rows(cos_table, "cos_table");
  check_rows(sin_table, "sin_table");
  TORCH_CHECK(cos_table.sizes() == sin_table.sizes() && cos_table.size(1) == dim,
              "cos_table and sin_table must both be [max_positions, ", dim, "]");
  for (const auto* index : {&positions, &cache_index})
    TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->dim() == 1 &&
                    index->numel() == tokens && index->is_contiguous(),
                "positions and cache_index must be contiguous int64 [", tokens, "]");
  if (bias) check_weight(*bias, qkv.size(1), "bias");
  if (q_norm) check_weight(*q_norm, dim, "q_norm");
  if (k_norm) check_weight(*k_norm, dim, "k_norm");
  // An index out of range would read or write outside the tables or the cache.
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = cache_index.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_table.size(0), "positions[", t, "] = ", pos[t],
                " is outside the RoPE table's ", cos_table.size(0), " positions");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < plane, "cache_index[", t, "] = ", slots[t],
                " is outside the cache's ", plane, " rows");
  }
  auto q = torch::empty({tokens, num_heads, dim}, qkv.options());
  const RopeProblem p{qkv.data_ptr<float>(),
                      bias ? bias->data_ptr<float>() : nullptr,
                      q_norm ? q_norm->data_ptr<float>() : nullptr,
                      k_norm ? k_norm->data_ptr<float>() : nullptr,
                      static_cast<float>(eps),
                      cos_table.data_ptr<float>(),
                      sin_table.data_ptr<float>(),
                      pos,
                      slots,
                      num_heads,
                      num_kv_heads,
                      dim,
                      plane,
                      q.data_ptr<float>()};
  const int64_t grain = grain_rows(qkv.size(1));
  if (k_cache.scalar_type() == torch::kFloat32) {
    float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
    at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
      rope_store_rows(p, kc, vc, first, last);
    });
  } else if (is_int8) {
    int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
    at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
      rope_store_rows(p, kc, vc, first, last);
    });
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kFloat16,
                "the KV cache must be float32, float16 or int8, not ", k_cache.scalar_type());
    c10::Half *kc = k_cache.data_ptr<c10::Half>(), *vc = v_cache.data_ptr<c10::Half>();
    at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
      rope_store_rows(p, kc, vc, first, last);
    });
  }
  return q;
}

// The same calls as dispatcher ops, for native code that chains the kernels (decode_layers.cpp).
TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor? bias, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor cos_table, Tensor sin_table, Tensor positions, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor cache_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("rope_store", &rope_store);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row of x (float32)");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta in place, then RMSNorm of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up [T, 2I] -> [T, I]");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up for gate_up [T, 2I] -> [T, I]");
  m.def("rope_store", &rope_store,
        "qkv bias, q/k norm, RoPE of q and k, k/v written to the paged cache; returns q");
  // a hybrid's gates (gated_rows.h, which hybrid_layers.cpp's stack runs too)
  m.def("gated_rms_norm", &gated_rows::gated_rms_norm,
        "RMSNorm of each head of x [T, H * D] with weight [D], times silu(z) [T, H * D]");
  m.def("sigmoid_mul", &gated_rows::sigmoid_mul, "x * sigmoid(gate), both [T, N]");
}
