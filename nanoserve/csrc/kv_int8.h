// One int8 KV cache row (AVX2): a key or value head of D floats as D int8 values followed by
// its float32 scale in the row's last 4 bytes, so a row is D + 4 bytes and the cache tensor is
// int8 [Hkv, num_blocks, block_size, D + 4]. Written by fused_ops.cpp's rope_store, read by
// paged_attention.cpp; attention.py's `quantize_kv_rows` is the same arithmetic in PyTorch,
// and tests hold the two equal bit for bit.
//
// Symmetric, per row: scale = amax / 127, q = round-half-even(x * (127 / amax)), value = q *
// scale (llama.cpp's Q8_0 cache type quantizes the same way, per block of 32 instead of 64).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd_reduce.h"

namespace kv_int8 {

constexpr int64_t kScaleBytes = 4;

// Elements of T in one cache row of a head of `dim` (float, half or int8): the D values, and
// for int8 the scale after them.
template <typename T>
constexpr int64_t row_elements(int64_t dim) {
  return std::is_same_v<T, int8_t> ? dim + kScaleBytes : dim;
}

inline float row_scale(const int8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof(float));
  return s;
}

// src [dim] floats (dim a multiple of 8) -> dst [dim + 4] bytes.
inline void quantize_row(const float* src, int8_t* dst, int64_t dim) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(src + i), abs_mask));
  const float amax = simd::hmax(vmax);
  const float scale = amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  for (int64_t i = 0; i < dim; i += 8) {
    // cvtps rounds half to even (the default MXCSR mode), as torch.round does
    const __m256i q32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i), inv));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32),
                                        _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(q16, q16));
  }
  std::memcpy(dst + dim, &scale, sizeof(float));
}

// 8 int8 values as 8 floats, unscaled (callers apply the row's scale once per dot product).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

}  // namespace kv_int8
