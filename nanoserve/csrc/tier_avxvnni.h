// The avxvnni tier's block dot products (AVX2 + FMA + F16C + AVX-VNNI: the VEX-encoded 256-bit
// `vpdpbusd` of Intel's client cores from Alder Lake and of AMD's Zen 5, CPUs without AVX-512
// or with it turned off): tier_avx2.h's functions with each four u8 x s8 products summed
// straight into an int32 lane. The sums are the same exact integers (`vpdpbusd` does not
// saturate; `maddubs` never does within the bounds tier_avx2.h keeps), so the same bits; one
// instruction where avx2 takes maddubs, an int16 add and a share of madd, and Q8_0's blocks no
// longer widen each product pair. No kernels of its own: matmul_tiles.h's loops run as they are.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_blocks.h"

namespace tier {

using gguf_blocks::Layout;

inline __m256i add_dots(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
}

template <bool IsU5>
inline __m256i u4_sums(const __m256i* wq, const int8_t* a) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i s0 =
      _mm256_dpbusd_avx_epi32(zero, wq[0], _mm256_set1_epi32(gguf_blocks::load_i32(a)));
  __m256i s1 =
      _mm256_dpbusd_avx_epi32(zero, wq[1], _mm256_set1_epi32(gguf_blocks::load_i32(a + 4)));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm256_dpbusd_avx_epi32(s0, wq[j],
                                 _mm256_set1_epi32(gguf_blocks::load_i32(a + 4 * j)));
    s1 = _mm256_dpbusd_avx_epi32(s1, wq[j + 1],
                                 _mm256_set1_epi32(gguf_blocks::load_i32(a + 4 * j + 4)));
  }
  return _mm256_add_epi32(s0, s1);
}

// Q8_0's and MXFP4's blocks in the unsigned-weight form (matmul_tiles.h's s8_group): each weight
// byte with its sign bit flipped is q + 128, unsigned, against the signed activations as they
// are: acc + the four products (q + 128) * a of each lane. One instruction a row and chunk
// where the sign form takes two.
constexpr bool kUnsignedWeightDots = true;
inline __m256i add_unsigned_dots(__m256i acc, __m256i q_flipped, __m256i a) {
  return _mm256_dpbusd_avx_epi32(acc, q_flipped, a);
}

// int32 sums from the start: Q8_0's in one, Q6_K's a half each
template <bool PerHalf>
struct S8Sums {
  __m256i part[2];

  inline void add(int t, __m256i q_abs, __m256i signed_a) {
    const int h = PerHalf ? t / 4 : 0;
    const bool first = PerHalf ? t % 4 == 0 : t == 0;
    part[h] = _mm256_dpbusd_avx_epi32(first ? _mm256_setzero_si256() : part[h], q_abs,
                                      signed_a);
  }

  inline __m256i sums(int half) const { return part[PerHalf ? half : 0]; }
};

// MXFP4's block sums: Q8_0's (vpdpbusd needs no int16 bound)
using L4Sums = S8Sums<false>;

// No kernels of its own for a range of groups.
template <Layout L, bool Wide, bool Stream>
inline bool other_kernel(const uint8_t*, const int8_t*, const float*, const float*, int64_t,
                         int64_t, int64_t, float*, int64_t, int64_t) {
  return false;
}

}  // namespace tier
