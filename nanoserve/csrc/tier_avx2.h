// The avx2 tier's block dot products (every tier's reference and fallback: AVX2 + FMA + F16C).
// tier.h includes this header or tier_avx512.h, by the one macro native.py sets per build; the
// kernels (matmul_tiles.h, attention_tiles.h) call only `tier::`, so no hot loop carries an
// `#if` of its own. Every tier's functions give the same exact int32 sums.
//
// `maddubs` sums its product pairs in int16: every caller keeps within it (gguf_blocks.h's
// bounds: 8 pairs of 4-bit values, 4 of 5-bit or 6-bit ones, one pair of int8 ones, 8 of
// MXFP4's values, |q| <= 12).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace tier {

using gguf_blocks::Layout;

// acc + the four products u8 x s8 of each 32-bit lane, summed (an int8 KV row's scores).
inline __m256i add_dots(__m256i acc, __m256i u8, __m256i s8) {
  const __m256i pairs = _mm256_maddubs_epi16(u8, s8);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// A 4- or 5-bit block's sums for one activation row: lane i, the sum over the 32 inputs of
// wq[j] lane i's bytes (output i's inputs 4j..4j+3) times the row's bytes a[4j..4j+3]. Two
// chains of four, so that the adds do not wait on each other; 5-bit values widen the chains
// apart (four of them fill int16).
template <bool IsU5>
inline __m256i u4_sums(const __m256i* wq, const int8_t* a) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_maddubs_epi16(wq[0], _mm256_set1_epi32(gguf_blocks::load_i32(a)));
  __m256i s1 = _mm256_maddubs_epi16(wq[1], _mm256_set1_epi32(gguf_blocks::load_i32(a + 4)));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(
                                  wq[j], _mm256_set1_epi32(gguf_blocks::load_i32(a + 4 * j))));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wq[j + 1], _mm256_set1_epi32(
                                                                  gguf_blocks::load_i32(
                                                                      a + 4 * j + 4))));
  }
  if constexpr (IsU5)
    return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
}

// Whether Q8_0's and MXFP4's blocks take the unsigned-weight form (matmul_tiles.h's
// s8_group): not here, where `maddubs`'s int16 pairs cannot hold (q + 128) * a (2 * 255 * 127).
constexpr bool kUnsignedWeightDots = false;
inline __m256i add_unsigned_dots(__m256i acc, __m256i, __m256i) { return acc; }  // (unused)

// A signed block's sums for one activation row, chunk by chunk (t = 0..7: inputs 4t..4t+3),
// |q| times a with q's sign: Q8_0's whole block (each pair widened at once: two could fill
// int16), or Q6_K's two halves apart (PerHalf: |q| <= 32 lets four pairs sum in int16).
template <bool PerHalf>
struct S8Sums {
  __m256i part[2];

  inline void add(int t, __m256i q_abs, __m256i signed_a) {
    const __m256i p = _mm256_maddubs_epi16(q_abs, signed_a);
    if constexpr (PerHalf) {
      part[t / 4] = t % 4 == 0 ? p : _mm256_add_epi16(part[t / 4], p);
    } else {
      const __m256i p32 = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
      part[0] = t == 0 ? p32 : _mm256_add_epi32(part[0], p32);
    }
  }

  // int32 sums: the whole block's (half 0 without PerHalf), or one half's
  inline __m256i sums(int half) const {
    if constexpr (PerHalf) return _mm256_madd_epi16(part[half], _mm256_set1_epi16(1));
    return part[0];
  }
};

// An MXFP4 block's sums (|q| <= 12): all eight chunks' pairs in int16, 8*2*12*127 = 24384,
// widened once.
struct L4Sums {
  __m256i part;

  inline void add(int t, __m256i q_abs, __m256i signed_a) {
    const __m256i p = _mm256_maddubs_epi16(q_abs, signed_a);
    part = t == 0 ? p : _mm256_add_epi16(part, p);
  }

  inline __m256i sums(int) const { return _mm256_madd_epi16(part, _mm256_set1_epi16(1)); }
};

// A tier with other kernels for a range of groups runs them here (and says so); avx2 has none.
template <Layout L, bool Wide, bool Stream>
inline bool other_kernel(const uint8_t*, const int8_t*, const float*, const float*, int64_t,
                         int64_t, int64_t, float*, int64_t, int64_t) {
  return false;
}

}  // namespace tier
