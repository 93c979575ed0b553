// Attention over a tile of keys as two small matrix products (flash attention's inner step, on
// the CPU): a tile's keys transposed once, then the scores of a set of query rows against all
// of them, S = Q · Kᵀ, one vector of 8 keys per FMA; the online softmax per row; then P · V,
// one vector of 8 output columns per FMA. A decode's rows are the query heads that share one
// KV head; a prefill block's rows are its tokens' query heads, all against the same tile. A
// decode's few rows take their scores with the keys transposed in registers (score_keys), a
// prefill block's many share one transposed tile (transpose_keys, score_rows): the same FMAs.
//
// The bits of a row's result do not depend on which rows it is computed with or on the vector
// width. Every score is one FMA chain over the head's elements in order (d = 0, 1, ...), every
// output element one chain over the tile's keys in order, starting from the corrected running
// sum; the tile's max, exp and sum are per row, in one fixed order over the tile's 32 lanes
// (keys past a row's context count as -inf and weigh exactly 0). So the same row gets the same
// bits in a decode of one request, in a batch, and in a prefill block of any size, which keeps
// a token's result independent of its chunk and its batch, and a speculative verify's rows
// equal to the decodes they stand for.
//
// Why this shape: the per-row walk it replaced summed each key's score across the lanes of a
// register (three horizontal sums a key for the default model's three query heads a KV head),
// ~90 cycles per (row, key, KV head) against 48 for its FMAs on a Zen 1; here the scores need
// no horizontal sums, and a prefill block shares each tile's transpose and widened values across
// all its rows. Figures: docs/benchmarks.md, "Prefill attention as tiled matrix products".
// Not kept: int16 products (`vpmaddwd`), 0.88x a prefill chunk's time but 1.95x a decode's,
// which must round a float16 cache's rows to int16 at every read as prefill does. Figures:
// docs/benchmarks.md, "Prefill attention in integers, measured and not kept".
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_tiles.h"
#include "simd_exp.h"
#include "simd_reduce.h"

namespace flash_tiles {

using attention_tiles::Half;
using attention_tiles::kNegInf;
using attention_tiles::kTileTokens;
using attention_tiles::load8;

constexpr int kVectors = kTileTokens / 8;  // vectors of 8 keys a tile
static_assert(kTileTokens % 8 == 0, "a tile is whole vectors of keys");

#define NANOSERVE_FLASH_UNROLL _Pragma("GCC unroll 16")

// Eight rows of 8 floats transposed in registers: r[i][j] -> r[j][i].
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// kt[d * kTileTokens + j] = key j's element d, as float32, for the tile's n keys; keys n..31
// are zeros (their scores are masked, never used). The next tile's rows are requested eight
// at a time as this one's are read, spread out rather than in one burst.
template <typename T>
void transpose_keys(const T* const* keys, int64_t n, int64_t dim, float* kt,
                    const attention_tiles::NextRows<T>& next) {
  for (int64_t j0 = 0; j0 < kTileTokens; j0 += 8) {
    for (int64_t j = j0; j < std::min(j0 + 8, next.count); ++j) {
      attention_tiles::prefetch_row(next.keys[j], dim);
      attention_tiles::prefetch_row(next.values[j], dim);
    }
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i)
        r[i] = j0 + i < n ? load8(keys[j0 + i] + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * kTileTokens + j0, r[i]);
    }
  }
}

// s[r * kTileTokens + j] = q_r · key j for R rows (q rows `q_stride` floats apart, already
// scaled): per d, each row's element broadcast against the tile's key vectors.
template <int R>
inline void score_rows_r(const float* q, int64_t q_stride, const float* kt, int64_t dim,
                         float* s) {
  __m256 acc[R][kVectors];
  NANOSERVE_FLASH_UNROLL
  for (int r = 0; r < R; ++r)
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const float* k = kt + d * kTileTokens;
    __m256 kv[kVectors];
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < kVectors; ++v) kv[v] = _mm256_loadu_ps(k + 8 * v);
    NANOSERVE_FLASH_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(q + r * q_stride + d);
      NANOSERVE_FLASH_UNROLL
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_fmadd_ps(b, kv[v], acc[r][v]);
    }
  }
  NANOSERVE_FLASH_UNROLL
  for (int r = 0; r < R; ++r)
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_ps(s + r * kTileTokens + 8 * v, acc[r][v]);
}

// Rows [0, rows) of q against the tile, three at a time (12 accumulators and the tile's four
// key vectors fill the 16 registers).
inline void score_rows(const float* q, int64_t q_stride, int64_t rows, const float* kt,
                       int64_t dim, float* s) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3)
    score_rows_r<3>(q + r * q_stride, q_stride, kt, dim, s + r * kTileTokens);
  if (rows - r == 2) score_rows_r<2>(q + r * q_stride, q_stride, kt, dim, s + r * kTileTokens);
  else if (rows - r == 1) score_rows_r<1>(q + r * q_stride, q_stride, kt, dim, s + r * kTileTokens);
}

// A decode's scores of the tile, for its few rows (the query heads of one KV head): exactly
// what transpose_keys then score_rows give (each score the same FMA chain over d = 0, 1, ...
// from zero, so the same bits), with each 8 keys x 8 elements transposed in registers and used
// at once. No transposed tile is written and read back (at head_dim 256 it is 32 KB, all of a
// Zen 4's L1, and score_rows read it once per three rows); V vectors of 8 keys a pass, so that
// R x V chains keep both FMA pipes busy. Scores of keys n..31 are left unwritten (the softmax
// masks them); the next tile's rows are requested a few lines a step (SpreadRequests).
template <typename T, int R, int V>
inline void score_keys_r(const float* q, int64_t dim, const T* const* keys, int64_t n, float* s,
                         const attention_tiles::NextRows<T>& next) {
  attention_tiles::SpreadRequests<T> requests(next, dim);
  const int64_t steps = (n + 8 * V - 1) / (8 * V) * (dim / 8);  // of the loop below
  const int64_t per_step = steps > 0 ? (requests.lines() + steps - 1) / steps : 0;
  for (int64_t j0 = 0; j0 < n; j0 += 8 * V) {
    __m256 acc[R][V];
    NANOSERVE_FLASH_UNROLL
    for (int r = 0; r < R; ++r)
      NANOSERVE_FLASH_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
      requests.request(per_step);
      NANOSERVE_FLASH_UNROLL
      for (int v = 0; v < V; ++v) {
        __m256 k[8];
        NANOSERVE_FLASH_UNROLL
        for (int i = 0; i < 8; ++i) {
          const int64_t j = j0 + 8 * v + i;
          k[i] = j < n ? load8(keys[j] + d0) : _mm256_setzero_ps();
        }
        transpose8(k);  // k[i]: element d0 + i of the 8 keys
        NANOSERVE_FLASH_UNROLL
        for (int i = 0; i < 8; ++i)
          NANOSERVE_FLASH_UNROLL
          for (int r = 0; r < R; ++r)
            acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * dim + d0 + i), k[i],
                                        acc[r][v]);
      }
    }
    NANOSERVE_FLASH_UNROLL
    for (int r = 0; r < R; ++r)
      NANOSERVE_FLASH_UNROLL
      for (int v = 0; v < V; ++v)
        if (j0 + 8 * v < n) _mm256_storeu_ps(s + r * kTileTokens + j0 + 8 * v, acc[r][v]);
  }
  requests.finish();
}

// score_keys_r for rows [0, rows) of q ([rows, dim], scaled), four at a time: the scores
// transpose_keys + score_rows give, s [rows, 32].
template <typename T>
void score_keys(const float* q, int64_t rows, int64_t dim, const T* const* keys, int64_t n,
                float* s, const attention_tiles::NextRows<T>& next) {
  int64_t r = 0;
  attention_tiles::NextRows<T> request = next;  // the next tile's rows, requested once
  for (; r + 4 <= rows; r += 4, request.count = 0)
    score_keys_r<T, 4, 2>(q + r * dim, dim, keys, n, s + r * kTileTokens, request);
  switch (rows - r) {
    case 3: score_keys_r<T, 3, 2>(q + r * dim, dim, keys, n, s + r * kTileTokens, request); break;
    case 2: score_keys_r<T, 2, 2>(q + r * dim, dim, keys, n, s + r * kTileTokens, request); break;
    case 1: score_keys_r<T, 1, 4>(q + r * dim, dim, keys, n, s + r * kTileTokens, request); break;
    default: break;
  }
}

// One row's softmax bookkeeping for the tile, its keys [lo, n) real (0 <= lo, n <= 32; keys
// before lo lie outside a sliding window): s becomes exp(s - new max), 0 outside [lo, n);
// corr = exp(old max - new max) for what was accumulated before; sum = sum * corr + the
// tile's sum, rounded once. A row with no real key yet keeps max -inf, sum 0 and adds 0.
inline void softmax_row(float* s, int64_t lo, int64_t n, float& max, float& sum, float& corr) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 p[kVectors], real[kVectors];
  __m256 vmax = _mm256_set1_ps(kNegInf);
  NANOSERVE_FLASH_UNROLL
  for (int v = 0; v < kVectors; ++v) {
    const __m256i index = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v));
    const __m256i below_end = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n)), index);
    const __m256i from_lo = _mm256_cmpgt_epi32(index, _mm256_set1_epi32(int32_t(lo) - 1));
    real[v] = _mm256_castsi256_ps(_mm256_and_si256(below_end, from_lo));
    p[v] = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + 8 * v), real[v]);
    vmax = _mm256_max_ps(vmax, p[v]);
  }
  const float new_max = std::max(max, simd::hmax(vmax));
  corr = max == kNegInf ? 0.0f : std::exp(max - new_max);
  max = new_max;
  // every key masked and nothing before: exp(-inf - -inf) is NaN, masked to 0 below
  const __m256 m = _mm256_set1_ps(new_max);
  NANOSERVE_FLASH_UNROLL
  for (int v = 0; v < kVectors; ++v) {
    p[v] = _mm256_and_ps(simd::exp256(_mm256_sub_ps(p[v], m)), real[v]);
    _mm256_storeu_ps(s + 8 * v, p[v]);
  }
  static_assert(kVectors == 4, "the tile's sum is written for four vectors");
  const __m256 total = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
  sum = std::fma(sum, corr, simd::hsum(total));  // one rounding in every inlined copy
}

// R rows' P · V over every column, four vectors of columns at a time: acc[r] = acc[r] *
// corr[r] + sum_j p[r][j] * value j, one FMA chain per output element over the keys in order
// (attention_tiles.h's accumulate_columns with one accumulator set). Rows whose context ends
// before key j have p = 0 there, which adds exactly nothing.
template <typename T, int R>
inline void accumulate_rows_columns(const float* p, const T* const* values, int64_t n,
                                    int64_t dim, const float* corr, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 32 <= dim; d0 += 32)
    attention_tiles::accumulate_columns<T, R, 4, 1>(p, values, n, dim, d0, corr, acc);
  for (; d0 < dim; d0 += 8)
    attention_tiles::accumulate_columns<T, R, 1, 1>(p, values, n, dim, d0, corr, acc);
}

// G rows' P · V over 8 V columns [d0, d0 + 8 V): accumulate_columns<T, G, V, 1>'s arithmetic
// (the same FMA chains in the same order) with each value vector widened once and used at once
// for all G rows, so that G x V accumulators, the G weights and one value fill the 16
// registers: 3 x 4 for a decode's three query heads of a KV head (the default model), 4 x 2 for
// four (Gemma 3, Qwen3.5). 12 or 8 independent chains keep both FMA pipes busy, and a key's
// values are widened once for the G rows, not once per pair and again alone.
template <typename T, int G, int V>
inline void accumulate_block(const float* p, const T* const* values, int64_t n, int64_t dim,
                             int64_t d0, const float* corr, float* acc) {
  __m256 a[G][V];
  NANOSERVE_FLASH_UNROLL
  for (int g = 0; g < G; ++g) {
    const __m256 c = _mm256_set1_ps(corr[g]);
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < V; ++v)
      a[g][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * dim + d0 + 8 * v), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 w[G];
    NANOSERVE_FLASH_UNROLL
    for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(p + g * kTileTokens + j);
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < V; ++v) {
      const __m256 x = load8(values[j] + d0 + 8 * v);
      NANOSERVE_FLASH_UNROLL
      for (int g = 0; g < G; ++g) a[g][v] = _mm256_fmadd_ps(w[g], x, a[g][v]);
    }
  }
  NANOSERVE_FLASH_UNROLL
  for (int g = 0; g < G; ++g)
    NANOSERVE_FLASH_UNROLL
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + g * dim + d0 + 8 * v, a[g][v]);
}

// Rows [0, rows): p [rows, 32], corr [rows], acc [rows, dim]; values are the tile's n rows
// (n: the longest row's real keys): four rows together over 16 columns, else three rows at a
// time over 32 columns where they fit (accumulate_block), then two (8 accumulators, 4 values,
// 2 weights), then one.
template <typename T>
void accumulate_rows(const float* p, const T* const* values, int64_t n, int64_t rows,
                     int64_t dim, const float* corr, float* acc) {
  int64_t r = 0;
  if (rows == 4 && dim % 16 == 0) {
    for (int64_t d0 = 0; d0 < dim; d0 += 16)
      accumulate_block<T, 4, 2>(p, values, n, dim, d0, corr, acc);
    return;
  }
  if (dim % 32 == 0) {
    for (; r + 3 <= rows; r += 3)
      for (int64_t d0 = 0; d0 < dim; d0 += 32)
        accumulate_block<T, 3, 4>(p + r * kTileTokens, values, n, dim, d0, corr + r,
                                  acc + r * dim);
  }
  for (; r + 2 <= rows; r += 2)
    accumulate_rows_columns<T, 2>(p + r * kTileTokens, values, n, dim, corr + r, acc + r * dim);
  if (r < rows)
    accumulate_rows_columns<T, 1>(p + r * kTileTokens, values, n, dim, corr + r, acc + r * dim);
}

}  // namespace flash_tiles
