// The decoder layer's element-wise rows (fused_ops.cpp's calls are built from them): RMSNorm
// with the residual add, SiLU-and-mul (GELU-tanh-and-mul for Gemma), and RoPE with the KV
// cache write. decode_layers.cpp's
// one-region forward calls the same functions, so both give the same bits. float32 rows; AVX2 +
// FMA + F16C.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_int8.h"
#include "simd_exp.h"
#include "simd_reduce.h"

namespace fused_rows {

using simd::exp256;
using simd::hsum;

// A lane mask for the last n < 8 elements of a row (masked loads and stores: no scalar tails).
inline __m256i tail_mask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// silu(g) * u, silu(g) = g / (1 + exp(-g)) as PyTorch's CPU kernel computes it.
inline __m256 silu_times(__m256 g, __m256 u) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// gelu_tanh(g) * u. PyTorch's 0.5 g (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi), is
// g * sigmoid(2 c (g + 0.044715 g^3)): computed so, as silu_times computes its sigmoid, which
// keeps the relative error small where 1 + tanh cancels (g below ~-3).
inline __m256 gelu_tanh_times(__m256 g, __m256 u) {
  const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), g),
                                       _mm256_set1_ps(0.044715f), g);
  const __m256 e = exp256(_mm256_mul_ps(inner, _mm256_set1_ps(-1.5957691216057308f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// One row of a gated MLP's product: gate_up [2n] (gate, then up) -> out [n] = Times(gate, up),
// 8 lanes at a time and a masked tail (silu_mul_row: Llama's gate; gelu_tanh_mul_row: Gemma's).
// out [n] = Times(a, b), 8 lanes at a time and a masked tail (`out` may be `a` or `b`).
template <__m256 (*Times)(__m256, __m256)>
inline void binary_row(const float* a, const float* b, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, Times(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, Times(_mm256_maskload_ps(a + i, m),
                                          _mm256_maskload_ps(b + i, m)));
  }
}

template <__m256 (*Times)(__m256, __m256)>
inline void gated_mul_row(const float* gate_up, int64_t n, float* out) {
  binary_row<Times>(gate_up, gate_up + n, n, out);
}

inline void silu_mul_row(const float* gate_up, int64_t n, float* out) {
  gated_mul_row<silu_times>(gate_up, n, out);
}

inline void gelu_tanh_mul_row(const float* gate_up, int64_t n, float* out) {
  gated_mul_row<gelu_tanh_times>(gate_up, n, out);
}

// ---- RMSNorm -------------------------------------------------------------------------------

inline float sum_squares(const float* x, int64_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    even = _mm256_fmadd_ps(a, a, even);
  }
  if (i < n) {
    const __m256 a = _mm256_maskload_ps(x + i, tail_mask(n - i));
    odd = _mm256_fmadd_ps(a, a, odd);
  }
  return hsum(_mm256_add_ps(even, odd));
}

// out = x / sqrt(mean(x^2) + eps) * weight, rounded as F.rms_norm does: (x * r) * w.
// `out` may be `x` (the per-head q/k norm works in place).
inline void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(sum_squares(x, n) / n + eps));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r),
                                            _mm256_loadu_ps(weight + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), r),
                                                  _mm256_maskload_ps(weight + i, m)));
  }
}

// hidden += delta, in place (the residual stream), before the norm reads it.
inline void add_row(float* hidden, const float* delta, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(hidden + i,
                     _mm256_add_ps(_mm256_loadu_ps(hidden + i), _mm256_loadu_ps(delta + i)));
  if (i < n) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(hidden + i, m, _mm256_add_ps(_mm256_maskload_ps(hidden + i, m),
                                                     _mm256_maskload_ps(delta + i, m)));
  }
}

// ---- RoPE and the KV cache write -----------------------------------------------------------

// Rotate pairs (i, i + half) of one head: the rotate-half convention of transformers' Llama,
// x * cos + rotate_half(x) * sin, with cos and sin the first half of a table row.
inline void rotate_8(float* x, const float* cos, const float* sin, int64_t half, int64_t i,
                     __m256i m) {
  const __m256 a = _mm256_maskload_ps(x + i, m), b = _mm256_maskload_ps(x + half + i, m);
  const __m256 c = _mm256_maskload_ps(cos + i, m), s = _mm256_maskload_ps(sin + i, m);
  _mm256_maskstore_ps(x + i, m, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
  _mm256_maskstore_ps(x + half + i, m, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
}

inline void rotate_head(float* x, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
    _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
  }
  if (i < half) rotate_8(x, cos, sin, half, i, tail_mask(half - i));
}

template <typename T>
void store_row(const float* src, T* dst, int64_t n);

template <>
inline void store_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float16 by F16C, rounded to nearest even, as `tensor.to(torch.float16)` rounds.
template <>
inline void store_row<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

// int8: the row's values and its scale (kv_int8.h), D + 4 bytes.
template <>
inline void store_row<int8_t>(const float* src, int8_t* dst, int64_t n) {
  kv_int8::quantize_row(src, dst, n);
}

struct RopeProblem {
  float* qkv;  // [T, (H + 2 Hkv) * D], updated in place: bias added, k normed and rotated
  const float* bias;  // [(H + 2 Hkv) * D] or null
  const float* q_norm;  // [D] or null
  const float* k_norm;  // [D] or null
  float eps;
  const float* cos;  // [max_positions, D]
  const float* sin;
  const int64_t* positions;  // [T]
  const int64_t* cache_index;  // [T]
  int64_t num_heads, num_kv_heads, dim, plane;  // plane: num_blocks * block_size
  float* q_out;  // [T, H, D]
};

template <typename T>
void rope_store_rows(const RopeProblem& p, T* k_cache, T* v_cache, int64_t first, int64_t last) {
  const int64_t dim = p.dim, half = dim / 2;
  const int64_t q_size = p.num_heads * dim, kv_size = p.num_kv_heads * dim;
  const int64_t row_size = q_size + 2 * kv_size;
  for (int64_t t = first; t < last; ++t) {
    float* row = p.qkv + t * row_size;
    if (p.bias != nullptr) add_row(row, p.bias, row_size);
    const float* cos = p.cos + p.positions[t] * dim;
    const float* sin = p.sin + p.positions[t] * dim;
    for (int64_t h = 0; h < p.num_heads; ++h) {
      float* q = p.q_out + (t * p.num_heads + h) * dim;
      if (p.q_norm != nullptr) norm_row(row + h * dim, p.q_norm, p.eps, dim, q);
      else std::memcpy(q, row + h * dim, dim * sizeof(float));
      rotate_head(q, cos, sin, half);
    }
    const int64_t slot = p.cache_index[t];
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      float* k = row + q_size + h * dim;
      if (p.k_norm != nullptr) norm_row(k, p.k_norm, p.eps, dim, k);
      rotate_head(k, cos, sin, half);
      const int64_t at = (h * p.plane + slot) * kv_int8::row_elements<T>(dim);
      store_row(k, k_cache + at, dim);
      store_row(row + q_size + kv_size + h * dim, v_cache + at, dim);
    }
  }
}

}  // namespace fused_rows
