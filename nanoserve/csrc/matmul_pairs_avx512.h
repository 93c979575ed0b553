// The avx512 tier's tile kernels (matmul_tiles.h includes this only in a module built with
// AVX-512 BW/VL/DQ + VNNI, which native.py loads only on a CPU that has them).
//
// Two packed 8-row groups side by side in one 512-bit register (lanes 0-7 the first group,
// 8-15 the second), so every vector op serves 16 outputs, and `vpdpbusd` (u8 x s8, four
// products summed straight into each int32 lane) in place of AVX2's maddubs + add + madd.
// The packed layout is the AVX2 tier's, unchanged: a weight packed once runs on either tier.
// Used from the schedule's wide_min_rows activation rows on, where the kernel is bound by arithmetic; below,
// matmul_tiles.h's one-group loop runs with vpdpbusd (why: its matmul_groups). Four rows a
// tile: eight measured 0.96x the AVX2 kernel on Q8_0 and Q6_K (spills), four 1.35-1.6x.
//
// The same bits as the AVX2 kernels. Each block's integer dot is the exact sum in both
// (AVX2's int16 partial sums never saturate: gguf_blocks.h's bounds), and each output's float
// chain is the same IEEE operations in the same order, lane by lane: fma(float(dot), dw * da,
// acc), then fma(mw, s, acc) for the 4-bit layouts; Q6_K's two halves as lo then hi. Nothing
// splits K. A second group that does not exist (an odd group at the end of a range) repeats
// the first, and its lanes are not stored.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "schedule.h"
#include "tile_rows.h"

namespace matmul_pairs_avx512 {

using namespace gguf_blocks;

constexpr int PAIR_N = 2 * TILE_N;  // outputs of one pair of groups

using tile_rows::RowPtrs;  // 16 outputs a row here
using tile_rows::TILE_M;

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// The lines the schedule's distance ahead of a block, in both groups' streams.
template <bool Stream, int64_t BPB>
inline void stream_ahead(const uint8_t* a, const uint8_t* b, const schedule::Prefetch& pf) {
  if constexpr (Stream) {
    if (pf.hint == schedule::kNone) return;
    for (int64_t o = 0; o < BPB; o += 64) {
      schedule::prefetch(a + pf.bytes + o, pf.hint);
      schedule::prefetch(b + pf.bytes + o, pf.hint);
    }
  }
}

// The two groups' scales as matmul_tiles::load_scales reads one group's.
template <Layout L>
inline void pair_scales(const uint8_t* a, const uint8_t* b, __m512& first, __m512& second) {
  auto half = [](const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  auto full = [](const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); };
  if constexpr (L == Layout::U4H || L == Layout::U5H) {
    first = join(half(a), half(b));
    second = join(half(a + 16), half(b + 16));
  } else if constexpr (L == Layout::S8H) {
    first = join(half(a), half(b));
    second = first;
  } else if constexpr (L == Layout::L4F) {
    first = join(full(a), full(b));
    second = first;
  } else {
    first = join(full(a), full(b));
    second = join(full(a + 32), full(b + 32));
  }
}

inline __m512i bcast(const int8_t* a) { return _mm512_set1_epi32(load_i32(a)); }

// matmul_tiles::signed_chunk for a pair of groups: their int8 values of inputs 4t..4t+3 (L4F's
// codes looked up in kMxfp4Values, 16 bytes a 128-bit lane).
template <Layout L>
inline __m512i signed_pair_chunk(const uint8_t* qa, const uint8_t* qb, int t) {
  if constexpr (L == Layout::L4F) {
    const __m512i values = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    const __m512i raw = load_pair(qa + 32 * (t % 4), qb + 32 * (t % 4));
    const __m512i codes = _mm512_and_si512(t < 4 ? raw : _mm512_srli_epi16(raw, 4),
                                           _mm512_set1_epi8(0x0F));
    return _mm512_shuffle_epi8(values, codes);
  } else {
    return load_pair(qa + 32 * t, qb + 32 * t);
  }
}

// matmul_tiles::or_high_bits for a pair of groups: bit t of byte i*4 + c to bit 4 of wq[t]'s.
inline void or_high_bits(const uint8_t* high_a, const uint8_t* high_b, __m512i* wq) {
  const __m512i bits = load_pair(high_a, high_b), bit4 = _mm512_set1_epi8(0x10);
  for (int t = 0; t < 8; ++t) {
    const __m512i at4 = t < 4 ? _mm512_slli_epi16(bits, 4 - t) : _mm512_srli_epi16(bits, t - 4);
    // wq | (at4 & bit4) in one instruction (vpternlogd's 0xF8 is a | (b & c))
    wq[t] = _mm512_ternarylogic_epi32(wq[t], at4, bit4, 0xF8);
  }
}

// Two groups' blocks of a 4- or 5-bit layout as 8 vectors of u8 values: wq[j] lane i (a dword)
// holds output i's inputs 4j..4j+3 (lanes 0-7 the first group's outputs, 8-15 the second's).
template <Layout L, bool Wide>
inline void unpack_pair(const uint8_t* ba, const uint8_t* bb, __m512i* wq) {
  const uint8_t *qa = ba + qs_offset(L), *qb = bb + qs_offset(L);
  if constexpr (Wide) {
    for (int t = 0; t < 8; ++t) wq[t] = load_pair(qa + 32 * t, qb + 32 * t);
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i raw = load_pair(qa + 32 * t, qb + 32 * t);
      wq[t] = _mm512_and_si512(raw, nibble);
      wq[t + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
    if constexpr (is_u5(L)) or_high_bits(ba + high_bits_offset(L), bb + high_bits_offset(L), wq);
  }
}

// w = d*q + m with unsigned q, 4 or 5 bits (u8 0..31 straight into vpdpbusd: int32 sums).
template <Layout L, int R, bool Wide, bool Stream>
void u4_pair(const uint8_t* wa, const uint8_t* wb, int64_t KB, const RowPtrs& rows,
             const schedule::Prefetch& pf) {
  constexpr int64_t BPB = block_bytes<L, Wide>();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *ba = wa + b * BPB, *bb = wb + b * BPB;
    stream_ahead<Stream, BPB>(ba, bb, pf);
    __m512i wq[8];  // wq[j] lane i: output i's inputs 4j..4j+3
    unpack_pair<L, Wide>(ba, bb, wq);
    __m512 dw, mw;
    pair_scales<L>(ba, bb, dw, mw);
    for (int r = 0; r < R; ++r) {
      const int8_t* a = rows.q[r] + b * QK;
      // two chains, so that each dpbusd does not wait on the one before (integer: exact)
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], bcast(a));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[1], bcast(a + 4));
      for (int j = 2; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wq[j], bcast(a + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, wq[j + 1], bcast(a + 4 * j + 4));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(rows.d[r][b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(rows.s[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(rows.y[r], acc[r]);
}

// w = d*q with signed q. Q8_0 (S8H) and MXFP4 (L4F) in the unsigned-weight form, as
// matmul_tiles.h's s8_group: each weight byte with its sign bit flipped is q + 128, unsigned,
// against a as it is, the chain started from the row's block offset. Q6_K (its two
// halves' sums apart): vpdpbusd(|q|, a negated where q < 0), AVX2's maddubs(|q|, sign(a, q))
// (where q is 0 the product is 0 either way).
template <Layout L, int R, bool Stream>
void s8_pair(const uint8_t* wa, const uint8_t* wb, int64_t KB, const RowPtrs& rows,
             const schedule::Prefetch& pf) {
  constexpr int64_t BPB = packed_block_bytes(L);
  constexpr bool kPerHalf = L == Layout::S8F2, kUnsigned = has_unsigned_form(L);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *ba = wa + b * BPB, *bb = wb + b * BPB;
    stream_ahead<Stream, BPB>(ba, bb, pf);
    const uint8_t *qa = ba + qs_offset(L), *qb = bb + qs_offset(L);
    __m512i sum[R][2];  // the unsigned form: one chain a row, from the row's block offset
    for (int r = 0; r < R; ++r) {
      sum[r][0] = kUnsigned ? _mm512_set1_epi32(rows.offset[r][b]) : _mm512_setzero_si512();
      sum[r][1] = _mm512_setzero_si512();
    }
    for (int t = 0; t < 8; ++t) {
      const __m512i q = signed_pair_chunk<L>(qa, qb, t);
      const int half = kPerHalf ? t / 4 : 0;  // (Q6_K's halves; every other layout one chain)
      if constexpr (kUnsigned) {
        const __m512i q_plus_128 = _mm512_xor_si512(q, flip);
        for (int r = 0; r < R; ++r)
          sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], q_plus_128,
                                          bcast(rows.q[r] + b * QK + 4 * t));
      } else {
        const __m512i q_abs = _mm512_abs_epi8(q);
        const __mmask64 negative = _mm512_movepi8_mask(q);
        for (int r = 0; r < R; ++r) {
          const __m512i a = bcast(rows.q[r] + b * QK + 4 * t);
          const __m512i signed_a = _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a);
          sum[r][half] = _mm512_dpbusd_epi32(sum[r][half], q_abs, signed_a);
        }
      }
    }
    __m512 d0, d1;
    pair_scales<L>(ba, bb, d0, d1);
    for (int r = 0; r < R; ++r) {
      const __m512 da = _mm512_set1_ps(rows.d[r][b]);
      if constexpr (kPerHalf) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(d0, da), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), _mm512_mul_ps(d1, da), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(d0, da), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(rows.y[r], acc[r]);
}

template <Layout L, int R, bool Wide, bool Stream>
inline void pair_kernel(const uint8_t* wa, const uint8_t* wb, int64_t KB, const RowPtrs& rows,
                        const schedule::Prefetch& pf) {
  if constexpr (is_unsigned(L)) u4_pair<L, R, Wide, Stream>(wa, wb, KB, rows, pf);
  else s8_pair<L, R, Stream>(wa, wb, KB, rows, pf);
}

// matmul_tiles::matmul_groups's contract: groups [g0, g1) of the packed weight against all M
// activation rows, y [M, N]. `Stream`: below the wide threshold, where the schedule runs pairs
// from few rows (pairs_min_rows), each block asks for the lines ahead in both groups' streams.
template <Layout L, bool Wide, bool Stream>
void matmul_groups(const uint8_t* packed, const int8_t* q, const float* d, const float* s,
                   int64_t M, int64_t N, int64_t K, float* y, int64_t g0, int64_t g1) {
  const int64_t KB = K / QK, group_bytes = KB * block_bytes<L, Wide>();
  const schedule::Prefetch pf = schedule::weights(schedule_slot(L), M);
  constexpr int64_t kGroupsPerChunk = 8;  // even: pairs never straddle a chunk
  // the second pass over a chunk asks for the next one (schedule::next_chunk); the L2 of an
  // AVX-512 CPU holds 1 MB or more
  const int64_t chunk_bytes = kGroupsPerChunk * group_bytes;
  const bool fill_next = Stream && M > TILE_M && chunk_bytes <= 256 * 1024;
  const schedule::Prefetch next_chunk = schedule::next_chunk(chunk_bytes);
  alignas(64) float tail[TILE_M][PAIR_N];
  const std::vector<int32_t> offsets =  // for s8_pair's unsigned form
      has_unsigned_form(L) ? tile_rows::block_offsets(q, M, K) : std::vector<int32_t>();
  for (int64_t gc = g0; gc < g1; gc += kGroupsPerChunk) {
    const int64_t gc_end = std::min(g1, gc + kGroupsPerChunk);
    for (int64_t r0 = 0; r0 < M; r0 += TILE_M) {
      const int R = int(std::min<int64_t>(TILE_M, M - r0));
      const bool filling = fill_next && r0 == TILE_M && gc_end < g1;
      const schedule::Prefetch& ahead = filling ? next_chunk : pf;
      for (int64_t g = gc; g < gc_end; g += 2) {
        const bool is_pair = g + 1 < gc_end;
        const int64_t outputs = std::min<int64_t>(N - g * TILE_N, is_pair ? PAIR_N : TILE_N);
        const bool is_full = outputs == PAIR_N;
        const RowPtrs rows = tile_rows::rows_at(q, d, s, K, r0, R, [&](int r) {
          return is_full ? y + (r0 + r) * N + g * TILE_N : tail[r];
        }, offsets.empty() ? nullptr : offsets.data());
        const uint8_t* wa = packed + g * group_bytes;
        const uint8_t* wb = is_pair ? wa + group_bytes : wa;
        switch (R) {
          case 4: pair_kernel<L, 4, Wide, Stream>(wa, wb, KB, rows, ahead); break;
          case 3: pair_kernel<L, 3, Wide, Stream>(wa, wb, KB, rows, ahead); break;
          case 2: pair_kernel<L, 2, Wide, Stream>(wa, wb, KB, rows, ahead); break;
          default: pair_kernel<L, 1, Wide, Stream>(wa, wb, KB, rows, ahead); break;
        }
        if (!is_full) {
          for (int r = 0; r < R; ++r)
            std::memcpy(y + (r0 + r) * N + g * TILE_N, tail[r], outputs * sizeof(float));
        }
      }
    }
  }
}

}  // namespace matmul_pairs_avx512
