// The 4-, 5- and 8-bit matmul's inner kernels (quant_matmul.cpp's design is at its top): the
// activations' int8 quantization, the tile kernels over one packed 8-row group, and a range of
// groups against all activation rows. quant_matmul.cpp splits the groups with at::parallel_for;
// decode_layers.cpp's one-region forward hands each thread its share. One definition for both,
// so the two give the same bits. The block dots are the tier's (tier.h: maddubs chains in the
// avx2 build, vpdpbusd in the avx512 and amx builds), and a tier with kernels of its own runs
// them for the rows they serve (tier_avx512.h: the pairs, and in the amx tiers the tiles): the
// same bits again.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "schedule.h"
#include "simd_reduce.h"
#include "tier.h"
#include "tile_rows.h"

namespace matmul_tiles {

using tile_rows::RowPtrs;
using tile_rows::TILE_M;

// Below the schedule's wide_min_rows activation rows (schedule.h) the kernel waits on memory: a
// batch-1 step streams ~66 MB of the default model's layer weights from DRAM, a few hundred KB
// per call, and the hardware prefetcher alone left the core idle between its demand misses.
// Each block then asks for the lines the schedule's distance ahead of it (past a group's end
// that is the next group of the same thread's range), with its hint. Where many rows share
// each block the kernel is bound by arithmetic and asks for nothing. The bytes and the
// arithmetic are unchanged: every output is the same whatever the hint and distance.
//
// Which hint and distance is a property of the CPU: on the 2-core EPYC (Zen 1 and 3)
// non-temporal requests 1 KB ahead were the best (they also keep the step's Python warm in
// L2/L3), on an Intel Xeon (Sapphire Rapids) T1 at 8 KB was 3x faster than that. The tuner
// measures them on the CPU it runs on (nanoserve/kernel_tuning/); the figures are in
// docs/benchmarks.md.
template <bool Stream, int64_t BPB>
inline void prefetch_ahead(const uint8_t* blk, const schedule::Prefetch& pf) {
  if constexpr (Stream) {
    if (pf.hint == schedule::kNone) return;
    for (int64_t o = 0; o < BPB; o += 64) schedule::prefetch(blk + pf.bytes + o, pf.hint);
  }
}

using namespace gguf_blocks;

// ---- activations --------------------------------------------------------------------------------

// One row of x into int8 blocks of 32: q = round(x * 127 / amax), d = amax / 127, s = d * sum(q).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask)));
    const float max_abs = simd::hmax(amax);
    const float scale = max_abs / 127.f;
    const __m256 inv = _mm256_set1_ps(max_abs != 0.f ? 127.f / max_abs : 0.f);
    // cvtps rounds to nearest even under the default MXCSR mode
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d[b] = scale;
    s[b] = scale * float(_mm_cvtsi128_si32(s4));
    // 32 x int32 -> 32 x int8 in order (packs interleave the 128-bit lanes; the permute undoes it)
    const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), bytes);
  }
}

// ---- the tile kernels ---------------------------------------------------------------------------

// R activation rows (RowPtrs: pointers to their quantized row, 8 outputs each) times one
// packed 8-row group.
template <Layout L>
inline void load_scales(const uint8_t* blk, __m256& a, __m256& b) {
  if constexpr (L == Layout::U4H || L == Layout::U5H) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
  } else if constexpr (L == Layout::S8H) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    b = a;
  } else if constexpr (L == Layout::L4F) {
    a = _mm256_loadu_ps(reinterpret_cast<const float*>(blk));
    b = a;
  } else {
    a = _mm256_loadu_ps(reinterpret_cast<const float*>(blk));
    b = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 32));
  }
}

// A 5-bit layout's 5th bits into the 8 value vectors: wq[t] lane byte i*4 + c (row i's input
// 4t+c) gets bit t of the 5th-bit byte i*4 + c at its bit 4. A 16-bit shift moves both bytes
// of a lane alike, and the mask keeps only bit 4 of each.
inline void or_high_bits(const uint8_t* high, __m256i* wq) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high));
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  wq[0] = _mm256_or_si256(wq[0], _mm256_and_si256(_mm256_slli_epi16(bits, 4), bit4));
  wq[1] = _mm256_or_si256(wq[1], _mm256_and_si256(_mm256_slli_epi16(bits, 3), bit4));
  wq[2] = _mm256_or_si256(wq[2], _mm256_and_si256(_mm256_slli_epi16(bits, 2), bit4));
  wq[3] = _mm256_or_si256(wq[3], _mm256_and_si256(_mm256_slli_epi16(bits, 1), bit4));
  wq[4] = _mm256_or_si256(wq[4], _mm256_and_si256(bits, bit4));
  wq[5] = _mm256_or_si256(wq[5], _mm256_and_si256(_mm256_srli_epi16(bits, 1), bit4));
  wq[6] = _mm256_or_si256(wq[6], _mm256_and_si256(_mm256_srli_epi16(bits, 2), bit4));
  wq[7] = _mm256_or_si256(wq[7], _mm256_and_si256(_mm256_srli_epi16(bits, 3), bit4));
}

// w = d*q + m with unsigned q, 4 or 5 bits (nibbles, plus 5th bits for U5H / U5F): the
// tier's u4_sums (AVX2's int16 chains stay within int16: eight of 4-bit q, 8 * 2 * 15 * 127 =
// 30480, four of 5-bit q, 4 * 2 * 31 * 127 = 31496). The 8 unpacked weight vectors stay in registers while the R activation rows pass over them
// (measured 8% faster than unpacking per row pair: fewer spills).
template <Layout L, int R, bool Wide, bool Stream>
void u4_group(const uint8_t* w, int64_t KB, const RowPtrs& rows,
              const schedule::Prefetch& pf) {
  constexpr int64_t BPB = block_bytes<L, Wide>();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R] = {};  // zeroed
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BPB;
    prefetch_ahead<Stream, BPB>(blk, pf);
    const uint8_t* qs = blk + qs_offset(L);
    __m256i wq[8];  // wq[j] lane i: row i's inputs 4j..4j+3
    if constexpr (Wide) {
      for (int t = 0; t < 8; ++t)
        wq[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
    } else {
      for (int t = 0; t < 4; ++t) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
        wq[t] = _mm256_and_si256(raw, nibble);
        wq[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      }
      if constexpr (is_u5(L)) or_high_bits(blk + high_bits_offset(L), wq);
    }
    __m256 dw, mw;
    load_scales<L>(blk, dw, mw);
    for (int r = 0; r < R; ++r) {
      const int8_t* a = rows.q[r] + b * QK;
      const __m256 dot = _mm256_cvtepi32_ps(tier::u4_sums<is_u5(L)>(wq, a));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(rows.d[r][b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(rows.s[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(rows.y[r], acc[r]);
}

// A signed block's int8 values of inputs 4t..4t+3, lane i row i's: S8H's and S8F2's bytes as
// they are, L4F's codes (low nibbles of its byte row t, high ones of row t - 4) looked up in
// kMxfp4Values, 16 bytes a 128-bit lane.
template <Layout L>
inline __m256i signed_chunk(const uint8_t* qs, int t) {
  if constexpr (L == Layout::L4F) {
    const __m256i values = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (t % 4)));
    const __m256i codes = _mm256_and_si256(t < 4 ? raw : _mm256_srli_epi16(raw, 4),
                                           _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(values, codes);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * t));
  }
}

// Whether this tier runs a layout in the unsigned-weight form (s8_group, below).
template <Layout L>
constexpr bool kUnsignedForm = has_unsigned_form(L) && tier::kUnsignedWeightDots;

// w = d*q with signed q: the tier's sums of |q| times a with q's sign (AVX2: Q8_0 widens each
// product pair to int32 at once, two could overflow int16; Q6_K's |q| <= 32 lets four sum in
// int16, 4*2*32*127 = 32512; MXFP4's |q| <= 12 all eight, 8*2*12*127 = 24384). Q8_0 and MXFP4
// where the tier has `vpdpbusd` (kUnsignedForm) in the unsigned-weight form: a weight byte
// with its sign bit flipped is q + 128, unsigned, so it multiplies the row's signed bytes as
// they are, and a chain that starts from -128 times the row's block sum of a
// (RowPtrs::offset) ends at the sign form's exact integers, so its bits: one instruction a row
// and chunk, not two (`vpsignb`, then `vpdpbusd`). One chain a row: the rows' chains are
// independent, and the offset as its start leaves no add or subtract after it (one chain and
// the start measured 1.0-1.04x two chains and a subtract, in L2 on a Zen 4).
template <Layout L, int R, bool Stream>
void s8_group(const uint8_t* w, int64_t KB, const RowPtrs& rows,
              const schedule::Prefetch& pf) {
  constexpr int64_t BPB = packed_block_bytes(L);
  constexpr bool kPerHalf = L == Layout::S8F2;
  using Sums = std::conditional_t<L == Layout::L4F, tier::L4Sums, tier::S8Sums<kPerHalf>>;
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  __m256 acc[R] = {};  // zeroed
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = w + b * BPB;
    prefetch_ahead<Stream, BPB>(blk, pf);
    const uint8_t* qs = blk + qs_offset(L);
    Sums sum[R];
    __m256i dot[R];  // (the unsigned form's: one chain a row, from the row's block offset)
    if constexpr (kUnsignedForm<L>)
      for (int r = 0; r < R; ++r) dot[r] = _mm256_set1_epi32(rows.offset[r][b]);
    for (int t = 0; t < 8; ++t) {
      const __m256i q = signed_chunk<L>(qs, t);
      if constexpr (kUnsignedForm<L>) {
        const __m256i q_plus_128 = _mm256_xor_si256(q, flip);
        for (int r = 0; r < R; ++r) {
          const __m256i a = _mm256_set1_epi32(load_i32(rows.q[r] + b * QK + 4 * t));
          dot[r] = tier::add_unsigned_dots(dot[r], q_plus_128, a);
        }
      } else {
        const __m256i q_abs = _mm256_abs_epi8(q);
        for (int r = 0; r < R; ++r) {
          const __m256i a = _mm256_set1_epi32(load_i32(rows.q[r] + b * QK + 4 * t));
          sum[r].add(t, q_abs, _mm256_sign_epi8(a, q));
        }
      }
    }
    __m256 d0, d1;
    load_scales<L>(blk, d0, d1);
    for (int r = 0; r < R; ++r) {
      const __m256 da = _mm256_set1_ps(rows.d[r][b]);
      if constexpr (kPerHalf) {
        const __m256 lo = _mm256_cvtepi32_ps(sum[r].sums(0));
        const __m256 hi = _mm256_cvtepi32_ps(sum[r].sums(1));
        acc[r] = _mm256_fmadd_ps(lo, _mm256_mul_ps(d0, da), acc[r]);
        acc[r] = _mm256_fmadd_ps(hi, _mm256_mul_ps(d1, da), acc[r]);
      } else {
        const __m256i exact = kUnsignedForm<L> ? dot[r] : sum[r].sums(0);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(d0, da), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(rows.y[r], acc[r]);
}

template <Layout L, int R, bool Wide, bool Stream>
inline void group_kernel(const uint8_t* w, int64_t KB, const RowPtrs& rows,
                         const schedule::Prefetch& pf) {
  if constexpr (is_unsigned(L)) u4_group<L, R, Wide, Stream>(w, KB, rows, pf);
  else s8_group<L, R, Stream>(w, KB, rows, pf);
}

// Groups [g0, g1) of the packed weight against all M activation rows: q [M, K] int8, d and s
// [M, K / 32] (quantize_row's), y [M, N].
template <Layout L, bool Wide, bool Stream>
void matmul_groups(const uint8_t* packed, const int8_t* q, const float* d, const float* s,
                   int64_t M, int64_t N, int64_t K, float* y, int64_t g0, int64_t g1) {
  // the tier's own kernels for this range, where it has them (tier_avx512.h: the pairs, tiles)
  if (tier::other_kernel<L, Wide, Stream>(packed, q, d, s, M, N, K, y, g0, g1)) return;
  const int64_t KB = K / QK, group_bytes = KB * block_bytes<L, Wide>();
  const schedule::Prefetch pf = schedule::weights(schedule_slot(L), M);
  const std::vector<int32_t> offsets =  // for s8_group's unsigned form
      kUnsignedForm<L> ? tile_rows::block_offsets(q, M, K) : std::vector<int32_t>();
  // a few groups stay in L1/L2 while every tile of activation rows passes over them
  constexpr int64_t kGroupsPerChunk = 8;
  // the second pass over a chunk asks for the next one (schedule::next_chunk); an AVX2 CPU's
  // L2 may hold only 512 KB (a Zen 3's)
  const int64_t chunk_bytes = kGroupsPerChunk * group_bytes;
  const bool fill_next = Stream && M > TILE_M && chunk_bytes <= 128 * 1024;
  const schedule::Prefetch next_chunk = schedule::next_chunk(chunk_bytes);
  alignas(32) float tail[TILE_M][TILE_N];
  for (int64_t gc = g0; gc < g1; gc += kGroupsPerChunk) {
    const int64_t gc_end = std::min(g1, gc + kGroupsPerChunk);
    for (int64_t r0 = 0; r0 < M; r0 += TILE_M) {
      const int R = int(std::min<int64_t>(TILE_M, M - r0));
      const bool filling = fill_next && r0 == TILE_M && gc_end < g1;
      const schedule::Prefetch& ahead = filling ? next_chunk : pf;
      for (int64_t g = gc; g < gc_end; ++g) {
        const bool is_full = (g + 1) * TILE_N <= N;
        const RowPtrs rows = tile_rows::rows_at(q, d, s, K, r0, R, [&](int r) {
          return is_full ? y + (r0 + r) * N + g * TILE_N : tail[r];
        }, offsets.empty() ? nullptr : offsets.data());
        const uint8_t* w = packed + g * group_bytes;
        switch (R) {
          case 4: group_kernel<L, 4, Wide, Stream>(w, KB, rows, ahead); break;
          case 3: group_kernel<L, 3, Wide, Stream>(w, KB, rows, ahead); break;
          case 2: group_kernel<L, 2, Wide, Stream>(w, KB, rows, ahead); break;
          default: group_kernel<L, 1, Wide, Stream>(w, KB, rows, ahead); break;
        }
        if (!is_full) {
          for (int r = 0; r < R; ++r)
            std::memcpy(y + (r0 + r) * N + g * TILE_N, tail[r], (N - g * TILE_N) * sizeof(float));
        }
      }
    }
  }
}

}  // namespace matmul_tiles
