// A hybrid model's two gates as rows of our own arithmetic (Qwen3.5/3.6): the Gated DeltaNet's
// output norm, RMSNorm per value head times silu(z), and the gated attention's output,
// attention times sigmoid(gate). fused_ops.cpp's `gated_rms_norm` and `sigmoid_mul` (the
// Python layers' fused table) and hybrid_layers.cpp's stack call these same functions, so the
// two give the same bits; PyTorch's ops (the exact table) pick their vector code by CPU and
// split a row's sum by its size, so a stack that ran them could not promise that.
//
// The float order is fixed here, the same on every CPU and every thread split: a head's sum of
// squares is fused_rows.h's (two 8-lane accumulators over 16-float steps, the tail into the
// second, then their lane sum), each element's arithmetic is lane-wise, and a row never
// depends on another. float32 rows; AVX2 + FMA.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fused_rows.h"
#include "simd_exp.h"

namespace gated_rows {

using fused_rows::tail_mask;

// One value head: out [n] = ((x r) w) (z / (1 + exp(-z))), r = 1 / sqrt(mean(x^2) + eps):
// F.rms_norm(x) * F.silu(z) with both products rounded as PyTorch rounds them.
inline void gated_norm_head(const float* x, const float* z, const float* weight, float eps,
                            int64_t n, float* out) {
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(fused_rows::sum_squares(x, n) / n + eps));
  auto gated = [&](__m256 xv, __m256 wv, __m256 zv) {
    return fused_rows::silu_times(zv, _mm256_mul_ps(_mm256_mul_ps(xv, r), wv));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, gated(_mm256_loadu_ps(x + i), _mm256_loadu_ps(weight + i),
                                    _mm256_loadu_ps(z + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, gated(_mm256_maskload_ps(x + i, m),
                                          _mm256_maskload_ps(weight + i, m),
                                          _mm256_maskload_ps(z + i, m)));
  }
}

// One token: x, z, out [heads * head_dim], each head normed by itself with the shared weight.
inline void gated_norm_row(const float* x, const float* z, const float* weight, float eps,
                           int64_t heads, int64_t head_dim, float* out) {
  for (int64_t h = 0; h < heads; ++h)
    gated_norm_head(x + h * head_dim, z + h * head_dim, weight, eps, head_dim,
                    out + h * head_dim);
}

// x / (1 + exp(-g)) lane-wise: x * sigmoid(g) with sigmoid as silu_times takes it.
inline __m256 sigmoid_times(__m256 g, __m256 x) {
  const __m256 e = simd::exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(x, _mm256_div_ps(_mm256_set1_ps(1.0f),
                                        _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

// One row: out [n] = x * sigmoid(gate) (torch.sigmoid's 1 / (1 + exp(-g)), then the product).
// `out` may be `x`.
inline void sigmoid_mul_row(const float* x, const float* gate, int64_t n, float* out) {
  fused_rows::binary_row<sigmoid_times>(gate, x, n, out);
}

// ---- the calls over [T, N] tensors (fused_ops.cpp's and the hybrid stack's) ---------------

// Rows split over threads only above ~32K elements, as fused_ops.cpp splits its rows (a decode
// step's few rows stay on one thread); a row's bits never depend on the split.
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, row_elements));
}

// float32 [rows, cols] whose rows may be strided (a split's view) but whose elements are not.
inline void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a float32 [rows, features] tensor with contiguous rows");
  TORCH_CHECK(rows < 0 || (t.size(0) == rows && t.size(1) == cols), name, " is ", t.sizes(),
              ", not [", rows, ", ", cols, "]");
}

// x, z [T, H * D] -> [T, H * D]: each head of D RMS-normed with weight [D], times silu(z).
inline at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& z,
                                 const at::Tensor& weight, double eps) {
  check_rows(x, "x", -1, -1);
  const int64_t rows = x.size(0), cols = x.size(1);
  check_rows(z, "z", rows, cols);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.numel() > 0 && cols % weight.numel() == 0,
              "weight must be a contiguous float32 [head_dim] tensor whose size divides x's ",
              cols, " columns, not ", weight.sizes());
  const int64_t dim = weight.numel(), heads = cols / dim;
  at::Tensor out = at::empty({rows, cols}, x.options());
  const float *xs = x.data_ptr<float>(), *zs = z.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), z_stride = z.stride(0);
  at::parallel_for(0, rows, grain_rows(4 * cols), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      gated_norm_row(xs + r * x_stride, zs + r * z_stride, w, static_cast<float>(eps), heads,
                     dim, dst + r * cols);
  });
  return out;
}

// x, gate [T, N] -> [T, N] = x * sigmoid(gate).
inline at::Tensor sigmoid_mul(const at::Tensor& x, const at::Tensor& gate) {
  check_rows(x, "x", -1, -1);
  const int64_t rows = x.size(0), cols = x.size(1);
  check_rows(gate, "gate", rows, cols);
  at::Tensor out = at::empty({rows, cols}, x.options());
  const float *xs = x.data_ptr<float>(), *gs = gate.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), g_stride = gate.stride(0);
  at::parallel_for(0, rows, grain_rows(4 * cols), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      sigmoid_mul_row(xs + r * x_stride, gs + r * g_stride, cols, dst + r * cols);
  });
  return out;
}

}  // namespace gated_rows
