// The avx512 tier's block dot products (AVX-512 BW/VL/DQ + VNNI), and the amx tiers' (the same,
// with tiles from the schedule's amx_min_rows rows): tier_avx2.h's functions with `vpdpbusd`,
// four products summed straight into each int32 lane (the same exact sums), and the kernels
// this tier adds for a range of groups (`other_kernel`): matmul_pairs_avx512.h's pairs of
// groups in 512-bit registers, and in the amx tiers matmul_amx.h's tiles.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gguf_blocks.h"
#include "matmul_pairs_avx512.h"
#include "schedule.h"
#ifdef NANOSERVE_TIER_AMX
#include "matmul_amx.h"
#endif

namespace tier {

using gguf_blocks::Layout;

inline __m256i add_dots(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_dpbusd_epi32(acc, u8, s8);
}

template <bool IsU5>
inline __m256i u4_sums(const __m256i* wq, const int8_t* a) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i s0 = _mm256_dpbusd_epi32(zero, wq[0], _mm256_set1_epi32(gguf_blocks::load_i32(a)));
  __m256i s1 =
      _mm256_dpbusd_epi32(zero, wq[1], _mm256_set1_epi32(gguf_blocks::load_i32(a + 4)));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm256_dpbusd_epi32(s0, wq[j], _mm256_set1_epi32(gguf_blocks::load_i32(a + 4 * j)));
    s1 = _mm256_dpbusd_epi32(s1, wq[j + 1],
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
  return _mm256_dpbusd_epi32(acc, q_flipped, a);
}

// int32 sums from the start: Q8_0's in one, Q6_K's a half each
template <bool PerHalf>
struct S8Sums {
  __m256i part[2];

  inline void add(int t, __m256i q_abs, __m256i signed_a) {
    const int h = PerHalf ? t / 4 : 0;
    const bool first = PerHalf ? t % 4 == 0 : t == 0;
    part[h] = _mm256_dpbusd_epi32(first ? _mm256_setzero_si256() : part[h], q_abs, signed_a);
  }

  inline __m256i sums(int half) const { return part[PerHalf ? half : 0]; }
};

// MXFP4's block sums: Q8_0's (vpdpbusd needs no int16 bound)
using L4Sums = S8Sums<false>;

// Where the kernel is bound by arithmetic, the pairs; where it waits on memory (few rows), one
// group at a time (matmul_tiles.h's loop, with vpdpbusd) unless the schedule runs the pairs
// from fewer rows (pairs_min_rows): on a Zen 4 the pairs' two interleaved streams read DRAM at
// ~0.7x the rate of one (one row over 96 MB of Q4_1 weights: 20 against 28 GB/s), on a Zen 5
// they beat it from 4 rows (docs/benchmarks.md). In the amx tiers, tiles first, from
// amx_min_rows rows.
template <Layout L, bool Wide, bool Stream>
inline bool other_kernel(const uint8_t* packed, const int8_t* q, const float* d, const float* s,
                         int64_t M, int64_t N, int64_t K, float* y, int64_t g0, int64_t g1) {
  const schedule::Schedule& plan = schedule::current();
#ifdef NANOSERVE_TIER_AMX
  if (M >= plan.amx_min_rows) {
    matmul_amx::matmul_groups<L, Wide>(packed, q, d, s, M, N, K, y, g0, g1);
    return true;
  }
#endif
  if (!Stream || M >= plan.pairs_min_rows) {
    matmul_pairs_avx512::matmul_groups<L, Wide, Stream>(packed, q, d, s, M, N, K, y, g0, g1);
    return true;
  }
  return false;
}

}  // namespace tier
