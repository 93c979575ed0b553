// Vector helpers of sampling.cpp: noise.py's counter-based noise, and the exp and log it needs.
// AVX2 + FMA, 8 floats or int32 at a time.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

#include "simd_exp.h"
#include "simd_reduce.h"

namespace sampling {

using simd::exp256;

constexpr float kUniformMax = 1.0f - 0x1p-24f;  // noise.py's clamp: u stays below 1

// noise.py's row_keys: splitmix64 of (seed, position), folded to 32 bits
inline uint32_t row_key(int64_t seed, int64_t position) {
  uint64_t x = static_cast<uint64_t>(seed) + static_cast<uint64_t>(position) * 0x632BE59BD9B4E019ull;
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x ^ (x >> 32));
}

// noise.py's token_hashes: murmur3's finalizer of (token id * stride) ^ row key
inline __m256i hash8(__m256i token_ids, uint32_t key) {
  __m256i h = _mm256_xor_si256(_mm256_mullo_epi32(token_ids, _mm256_set1_epi32(0x9E3779B9)),
                               _mm256_set1_epi32(static_cast<int32_t>(key)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x85EBCA6B));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0xC2B2AE35));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// log of 8 positive normal floats: Cephes' logf (range reduction to [sqrt(1/2), sqrt(2)) and a
// degree-8 polynomial), ~1 ulp.
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 exponent = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  const __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  exponent = _mm256_sub_ps(exponent, _mm256_and_ps(small, _mm256_set1_ps(1.0f)));
  const __m256 f = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), _mm256_set1_ps(1.0f));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                        -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(c));
  y = _mm256_mul_ps(_mm256_mul_ps(y, f), z);
  y = _mm256_fmadd_ps(exponent, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(exponent, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}

// noise.py's gumbel_from_hashes: -log(-log(u)), u = (top 24 bits + 0.5) / 2^24 (bit for bit
// noise.py's u, clamped below 1). Within one ulp of PyTorch's value for every u.
inline __m256 gumbel8(__m256i hashes) {
  __m256 u = _mm256_cvtepi32_ps(_mm256_srli_epi32(hashes, 8));
  u = _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(0.5f)), _mm256_set1_ps(0x1p-24f));
  u = _mm256_min_ps(u, _mm256_set1_ps(kUniformMax));
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_sub_ps(zero, log8(_mm256_sub_ps(zero, log8(u))));
}

// An upper bound of gumbel8(hashes) in a few integer operations: -log(-log u) <= -log(1 - u),
// and 1 - u >= max(m, 1) / 2^24 with m = 2^24 - 1 - (top 24 bits), so the noise is at most
// ln 2 * (24 - floor(log2(max(m, 1)))) (+ 1e-3 for rounding).
inline __m256 gumbel_bound8(__m256i hashes) {
  const __m256i m = _mm256_max_epi32(
      _mm256_sub_epi32(_mm256_set1_epi32(0xFFFFFF), _mm256_srli_epi32(hashes, 8)),
      _mm256_set1_epi32(1));
  const __m256i log2_m = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(m)), 23), _mm256_set1_epi32(127));
  const __m256 bits_left = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_set1_epi32(24), log2_m));
  return _mm256_fmadd_ps(bits_left, _mm256_set1_ps(0.693147181f), _mm256_set1_ps(1e-3f));
}

}  // namespace sampling
