// The amx tiers' tile kernel (tier_avx512.h includes it in a module built for `amx` or
// `amx-emu`; amx_shim.h's `amx_tiles` is the real instructions or the emulator): from the
// schedule's amx_min_rows rows, the int8 block products of a pair of 8-row groups (16 outputs)
// as tile dot products, 16 activation rows a tile.
//
// Per 32-input block: A = the activations' int8 rows (up to 16 rows x 32 bytes, loaded from the
// quantized rows with their own stride), B = the pair's weights as 8 rows x 64 bytes in the
// dot products' layout (row k: each output's inputs 4k..4k+3, matmul_pairs_avx512's
// `unpack_pair` vectors stored as rows; a weight whose blocks already hold such rows, a 4- or
// 5-bit weight's wide form or Q8_0's packed bytes, is read as it is, a dot product of 8 outputs
// per group: `is_direct`), C = rows x 16 int32, the exact integer sum of each
// output's block: TDPBSUD for the unsigned 4- and 5-bit layouts (activations signed, weights
// unsigned), TDPBSSD for Q8_0, MXFP4 (its codes looked up into int8 B rows) and Q6_K, whose
// two 16-input halves keep their sums apart (two dot products of K = 16). Each block's integer
// sums are the same as every other tier's, and the float epilogue is matmul_pairs_avx512's to
// the operation (fma(dot, dw * da, acc), then the offset term; Q6_K's halves lo then hi), so
// the outputs are the avx2 tier's bit for bit.
//
// Blocks go in batches: the tile phase stores a batch's int32 tiles (16 KB), then the AVX-512
// phase applies their scales (on a Sapphire Rapids core tile operations and AVX-512 work do
// not overlap, and AVX-512 runs at half rate for a while after a tile operation: the
// prototype's measurements in docs/benchmarks.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_shim.h"
#include "gguf_blocks.h"
#include "matmul_pairs_avx512.h"

namespace matmul_amx {

using namespace gguf_blocks;
using amx_tile_config::TileConfig;
using matmul_pairs_avx512::load_pair;
using matmul_pairs_avx512::PAIR_N;
using matmul_pairs_avx512::pair_scales;

constexpr int kTileRows = 16;  // activation rows a tile
constexpr int kBatch = 16;     // blocks a phase
constexpr int kBTileBytes = 8 * 64;

// Where a block's B rows lie in memory as they are (a 4- or 5-bit weight's wide form, Q8_0's
// packed bytes: row k of a group is its 32 bytes at 32 k), each group of the pair is its own
// 8-output dot product straight from the weight: nothing is unpacked per call.
template <Layout L, bool Wide>
constexpr bool is_direct() { return (is_unsigned(L) && Wide) || L == Layout::S8H; }

enum class Shape { kPair, kDirect, kHalves };

// Tiles: C 0, A 1, B 2, and where a block takes two dot products C 3, A 4, B 5: the second
// group's (direct, each C rows x 8 int32) or Q6_K's second half.
inline TileConfig config(int rows, Shape shape) {
  TileConfig cfg;
  if (shape == Shape::kDirect) {
    for (int t = 0; t < 6; t += 3) {
      cfg.set(t, rows, 32);      // C: rows x 8 int32
      cfg.set(t + 1, rows, 32);  // A: rows x 32 int8
      cfg.set(t + 2, 8, 32);     // B: 8 x (8 outputs x 4 bytes)
    }
  } else if (shape == Shape::kHalves) {
    for (int t = 0; t < 6; t += 3) {
      cfg.set(t, rows, 64);      // C: rows x 16 int32
      cfg.set(t + 1, rows, 16);  // A: rows x 16 int8 (one half of the block)
      cfg.set(t + 2, 4, 64);     // B: 4 x (16 outputs x 4 bytes)
    }
  } else {
    cfg.set(0, rows, 64);
    cfg.set(1, rows, 32);
    cfg.set(2, 8, 64);
  }
  return cfg;
}

// A pair's block as the B tile: row k = each output's inputs 4k..4k+3.
template <Layout L, bool Wide>
inline void b_tile(const uint8_t* ba, const uint8_t* bb, uint8_t* tile) {
  __m512i rows[8];
  if constexpr (is_unsigned(L)) {
    matmul_pairs_avx512::unpack_pair<L, Wide>(ba, bb, rows);
  } else {  // signed bytes as they are packed (MXFP4's looked up): chunk t is inputs 4t..4t+3
    for (int t = 0; t < 8; ++t)
      rows[t] = matmul_pairs_avx512::signed_pair_chunk<L>(ba + qs_offset(L),
                                                          bb + qs_offset(L), t);
  }
  for (int t = 0; t < 8; ++t) _mm512_store_si512(tile + 64 * t, rows[t]);
}

// One row tile (`rows` <= 16 activation rows from q, d, s) times one pair of groups: 16 outputs
// a row, `outputs` of them stored to out[r] (fewer at the end of the weight).
template <Layout L, bool Wide>
void row_tile(const uint8_t* wa, const uint8_t* wb, int64_t KB, const int8_t* q, const float* d,
              const float* s, int64_t K, int rows, float* const* out, int outputs) {
  constexpr int64_t BPB = block_bytes<L, Wide>();
  constexpr bool kHalves = L == Layout::S8F2;
  constexpr bool kDirect = is_direct<L, Wide>();
  alignas(64) uint8_t b_tiles[kDirect ? 1 : kBatch][kBTileBytes];
  alignas(64) int32_t sums[kBatch][kTileRows][16];
  alignas(64) int32_t high_sums[kHalves ? kBatch : 1][kTileRows][16];
  __m512 acc[kTileRows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < KB; b0 += kBatch) {
    const int count = int(std::min<int64_t>(kBatch, KB - b0));
    if constexpr (!kDirect)
      for (int i = 0; i < count; ++i)
        b_tile<L, Wide>(wa + (b0 + i) * BPB, wb + (b0 + i) * BPB, b_tiles[i]);
    // the tile phase
    for (int i = 0; i < count; ++i) {
      const int8_t* a = q + (b0 + i) * QK;
      amx_tiles::zero<0>();
      if constexpr (kDirect) {  // the two groups' dot products, into one row of 16 sums
        amx_tiles::zero<3>();
        amx_tiles::load<1>(a, K);
        amx_tiles::load<4>(a, K);
        amx_tiles::load<2>(wa + (b0 + i) * BPB + qs_offset(L), 32);
        amx_tiles::load<5>(wb + (b0 + i) * BPB + qs_offset(L), 32);
        if constexpr (is_unsigned(L)) {
          amx_tiles::dot_signed_unsigned<0, 1, 2>();
          amx_tiles::dot_signed_unsigned<3, 4, 5>();
        } else {
          amx_tiles::dot_signed_signed<0, 1, 2>();
          amx_tiles::dot_signed_signed<3, 4, 5>();
        }
        amx_tiles::store<3>(reinterpret_cast<uint8_t*>(sums[i]) + 32, 64);
      } else if constexpr (kHalves) {
        amx_tiles::zero<3>();
        amx_tiles::load<1>(a, K);
        amx_tiles::load<4>(a + 16, K);
        amx_tiles::load<2>(b_tiles[i], 64);
        amx_tiles::load<5>(b_tiles[i] + 4 * 64, 64);
        amx_tiles::dot_signed_signed<0, 1, 2>();
        amx_tiles::dot_signed_signed<3, 4, 5>();
        amx_tiles::store<3>(high_sums[i], 64);
      } else {
        amx_tiles::load<1>(a, K);
        amx_tiles::load<2>(b_tiles[i], 64);
        if constexpr (is_unsigned(L)) amx_tiles::dot_signed_unsigned<0, 1, 2>();
        else amx_tiles::dot_signed_signed<0, 1, 2>();
      }
      amx_tiles::store<0>(sums[i], 64);
    }
    // the AVX-512 phase: each block's scales, in the pairs kernel's order
    for (int i = 0; i < count; ++i) {
      const int64_t b = b0 + i;
      __m512 first, second;
      pair_scales<L>(wa + b * BPB, wb + b * BPB, first, second);
      for (int r = 0; r < rows; ++r) {
        const __m512 da = _mm512_set1_ps(d[r * KB + b]);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(sums[i][r]));
        if constexpr (is_unsigned(L)) {
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(first, da), acc[r]);
          acc[r] = _mm512_fmadd_ps(second, _mm512_set1_ps(s[r * KB + b]), acc[r]);
        } else if constexpr (kHalves) {
          const __m512 high = _mm512_cvtepi32_ps(_mm512_load_si512(high_sums[i][r]));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(first, da), acc[r]);
          acc[r] = _mm512_fmadd_ps(high, _mm512_mul_ps(second, da), acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(first, da), acc[r]);
        }
      }
    }
  }
  const __mmask16 kept = outputs >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << outputs) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out[r], kept, acc[r]);
}

// matmul_tiles::matmul_groups's contract: groups [g0, g1) of the packed weight against all M
// activation rows, y [M, N]. Row tiles outside, pairs of groups inside (one tile
// configuration per row tile); the tiles released at the end.
template <Layout L, bool Wide>
void matmul_groups(const uint8_t* packed, const int8_t* q, const float* d, const float* s,
                   int64_t M, int64_t N, int64_t K, float* y, int64_t g0, int64_t g1) {
  const int64_t KB = K / QK, group_bytes = KB * block_bytes<L, Wide>();
  int configured_rows = 0;
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int rows = int(std::min<int64_t>(kTileRows, M - m0));
    if (rows != configured_rows) {
      amx_tiles::load_config(config(rows, is_direct<L, Wide>() ? Shape::kDirect
                                          : L == Layout::S8F2 ? Shape::kHalves
                                                              : Shape::kPair));
      configured_rows = rows;
    }
    for (int64_t g = g0; g < g1; g += 2) {
      const bool is_pair = g + 1 < g1;
      const int outputs = int(std::min<int64_t>(N - g * TILE_N, is_pair ? PAIR_N : TILE_N));
      const uint8_t* wa = packed + g * group_bytes;
      const uint8_t* wb = is_pair ? wa + group_bytes : wa;  // an odd last group: itself again
      float* out[kTileRows];
      for (int r = 0; r < rows; ++r) out[r] = y + (m0 + r) * N + g * TILE_N;
      row_tile<L, Wide>(wa, wb, KB, q + m0 * K, d + m0 * KB, s + m0 * KB, K, rows, out,
                        outputs);
    }
  }
  if (configured_rows) amx_tiles::release();
}

}  // namespace matmul_amx
