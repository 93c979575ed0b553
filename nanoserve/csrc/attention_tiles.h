// One tile of decode attention (paged_attention.cpp walks a context tile by tile): the scores
// of a tile's keys for the query heads that share them, in float or, for an int8 cache, in
// integers; the online softmax's bookkeeping for the tile; and P·V into register-held
// accumulators. Rows are given as pointers (the paged cache's blocks are scattered), and the
// next tile's rows are requested while this one computes.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kv_int8.h"
#include "schedule.h"
#include "simd_exp.h"
#include "tier.h"
#include "simd_reduce.h"

namespace attention_tiles {

using simd::exp256;
using simd::hmax;
using simd::hsum;

// Measured on a 2-core AVX2 machine, one thread, batch 16 x 1,024 tokens over 30 layers' caches
// (so from DRAM, as in a real step): asking for the next tile's rows while this one computes
// takes the time per (token, KV head) from 66 to ~38 ns (17 ns when the cache sits in L3);
// tiles of 16, 32, 64 keys: 38, 37, 42 ns from DRAM and 19, 16, 15.5 ns from L3. Splitting one
// request's context over both threads takes 7-15% off batch 1. A float16 cache halves the bytes
// per row for one F16C widening per 8 elements: ~1.9x less time per step at batch 16-64 from
// DRAM, one thread (figures in paged_decode.py).
// The tile is arithmetic: the online softmax rescales its running sums once a tile, so the
// tile decides a row's bits and is the same on every CPU; how many tiles a walk step reads
// is the schedule's (paged_attend.h's kMaxBlockTiles), which changes no bit.
constexpr int64_t kTileTokens = 32;        // keys scored per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A cache element: float, or an IEEE half held as its 16 bits (at::Half's storage).
using Half = uint16_t;

// 8 cache elements as 8 floats: the only place the two cache types differ.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) { return kv_int8::load8(p); }

using kv_int8::row_elements;

// The factor a cache row's dot products take (1 but for int8).
template <typename T>
inline float row_scale(const T* row, int64_t dim) {
  if constexpr (std::is_same_v<T, int8_t>) return kv_int8::row_scale(row, dim);
  else return 1.0f;
}

// The rows of the next tile, to request into L2 while this one computes: the blocks are
// scattered pages, where the hardware prefetcher does not follow.
template <typename T>
struct NextRows {
  const T* const* keys;
  const T* const* values;
  int64_t count;  // 0: none, or already requested
};

// One request per 64-byte line, with the schedule's hint (schedule.h: T1 unless tuned).
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const int32_t hint = schedule::current().attention_hint;
  if (hint == schedule::kNone) return;
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = row_elements<T>(dim) * int64_t(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) schedule::prefetch(bytes + b, hint);
  // an int8 row (D + 4 bytes) may end in one more line than its start implies
  if (size % 64 != 0) schedule::prefetch(bytes + size - 1, hint);
}

// The next tile's rows requested a few lines at a time over a pass of many steps (a decode's
// scores at head_dim 256: the 64 rows' 512 lines in one burst filled the core's miss buffers,
// and the prefetch instructions themselves stalled it for ~30% of the scores' time). Keys
// first, then values; `request(k)` issues the next k lines, `finish()` the rest. Every line is
// requested: one line of each 128-byte pair left the other to a demand miss, 1.7-2x slower.
template <typename T>
struct SpreadRequests {
  const NextRows<T>& next;
  int64_t row_bytes, row = 0, offset = 0;  // row: 0..2*count (keys, then values)
  int32_t hint = schedule::current().attention_hint;

  SpreadRequests(const NextRows<T>& rows, int64_t dim)
      : next(rows), row_bytes(row_elements<T>(dim) * int64_t(sizeof(T))) {}

  int64_t lines() const {  // in all (an upper bound where a row starts mid-line)
    return 2 * next.count * ((row_bytes + 63) / 64 + (row_bytes % 64 != 0));
  }

  inline void request(int64_t k) {
    if (hint == schedule::kNone) return;
    for (; k > 0 && row < 2 * next.count; --k) {
      const char* bytes = reinterpret_cast<const char*>(
          row < next.count ? next.keys[row] : next.values[row - next.count]);
      schedule::prefetch(bytes + std::min(offset, row_bytes - 1), hint);
      offset += 64;
      if (offset >= row_bytes + (row_bytes % 64 != 0 ? 64 : 0)) {
        offset = 0;
        ++row;
      }
    }
  }

  void finish() { request(lines()); }
};

// scores[g * kTileTokens + j] = q[g] · key[j] for GB query heads (q already scaled). Row j of
// the next tile is requested at key j: spread out, not in one burst (measured: ~20% faster).
template <typename T, int GB>
void score_tile(const float* q, const T* const* keys, int64_t n, int64_t dim,
                const NextRows<T>& next, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    if (j < next.count) {
      prefetch_row(next.keys[j], dim);
      prefetch_row(next.values[j], dim);
    }
    const T* k = keys[j];
    // two accumulators per head: half the chain of dependent FMAs
    __m256 even[GB], odd[GB];
    for (int g = 0; g < GB; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
      const __m256 k0 = load8(k + d), k1 = load8(k + d + 8);
      for (int g = 0; g < GB; ++g) {
        even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d + 8), k1, odd[g]);
      }
    }
    if (d < dim) {
      const __m256 k0 = load8(k + d);
      for (int g = 0; g < GB; ++g)
        even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), k0, even[g]);
    }
    const float scale = row_scale(k, dim);
    for (int g = 0; g < GB; ++g)
      scores[g * kTileTokens + j] = hsum(_mm256_add_ps(even[g], odd[g])) * scale;
  }
}

// An int8 cache's scores in integers (head_dim a multiple of 32), as llama.cpp scores a Q8_0
// cache: q is quantized per head like a cache row (kv_int8.h), and q8 · k8 is summed exactly
// in int32 by `maddubs(|k|, sign(q, k))`, then scaled once by q's and k's scales. Four keys at
// a time (3 heads x 4 keys of int32 accumulators fit in the registers), reduced to one vector
// per head by hadds; a tile's last keys reuse its last key to fill the four, so every score
// comes from the same arithmetic wherever its key falls. Measured against float dot products
// over the same int8 rows (batch 64 x 192 tokens, 3 KV heads of 3 queries, D = 64, 2 threads):
// 21.0 -> 18.2 ns per (token, KV head) and thread with one layer's cache in L3, 27.1 -> 26.1
// from DRAM. (The same four-key scheme in float, for float16 rows, measured slower than the
// per-key sums: 17.6 -> 18.8-20.1 ns; there the FMAs, not the sums, are the bound.)
// The avx512 tier's build (decode_layers_avx512) takes each 32-byte product and sum in one
// `vpdpbusd`: the same exact sums, so the same bits; a 6,000-token context's decode attention
// over 30 layers, one request, 2 threads, Zen 4: 5.5-5.6 -> 5.2-5.3 ms.
inline __m128i hsum4_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

template <int GB>
void score_tile_int8(const int8_t* q8, const int8_t* const* keys, int64_t n, int64_t dim,
                     const NextRows<int8_t>& next, float* scores) {
  constexpr int kKeys = 4;
  const int64_t row = row_elements<int8_t>(dim);
  __m128 q_scale[GB];
  for (int g = 0; g < GB; ++g) q_scale[g] = _mm_set1_ps(kv_int8::row_scale(q8 + g * row, dim));
  alignas(16) float tail[GB][kKeys];
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int8_t* k[kKeys];
    for (int i = 0; i < kKeys; ++i) {
      k[i] = keys[std::min(j0 + i, n - 1)];
      if (j0 + i < next.count) {
        prefetch_row(next.keys[j0 + i], dim);
        prefetch_row(next.values[j0 + i], dim);
      }
    }
    __m256i acc[GB][kKeys];
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < kKeys; ++i) acc[g][i] = _mm256_setzero_si256();
    for (int64_t d = 0; d < dim; d += 32) {
      for (int i = 0; i < kKeys; ++i) {
        const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[i] + d));
        const __m256i k_abs = _mm256_abs_epi8(kv);
        for (int g = 0; g < GB; ++g) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + g * row + d));
          // |k| * (q with k's sign), exact int32 sums in every tier (AVX2's pairs: at most
          // 2 * 128 * 127, within int16)
          acc[g][i] = tier::add_dots(acc[g][i], k_abs, _mm256_sign_epi8(qv, kv));
        }
      }
    }
    using kv_int8::row_scale;
    const __m128 k_scale = _mm_setr_ps(row_scale(k[0], dim), row_scale(k[1], dim),
                                       row_scale(k[2], dim), row_scale(k[3], dim));
    const bool is_full = j0 + kKeys <= n;
    for (int g = 0; g < GB; ++g) {
      const __m128 dots = _mm_cvtepi32_ps(hsum4_epi32(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
      _mm_storeu_ps(is_full ? scores + g * kTileTokens + j0 : tail[g],
                    _mm_mul_ps(_mm_mul_ps(dots, q_scale[g]), k_scale));
    }
    if (!is_full)
      for (int g = 0; g < GB; ++g)
        for (int64_t j = j0; j < n; ++j) scores[g * kTileTokens + j] = tail[g][j - j0];
  }
}

inline void score_heads_int8(const int8_t* q8, const int8_t* const* keys, int64_t n, int64_t dim,
                      int64_t group, NextRows<int8_t> next, float* scores) {
  const int64_t row = row_elements<int8_t>(dim);
  for (int64_t g0 = 0; g0 < group; g0 += 3, next.count = 0) {
    const int8_t* qg = q8 + g0 * row;
    float* sg = scores + g0 * kTileTokens;
    switch (std::min<int64_t>(3, group - g0)) {
      case 1: score_tile_int8<1>(qg, keys, n, dim, next, sg); break;
      case 2: score_tile_int8<2>(qg, keys, n, dim, next, sg); break;
      default: score_tile_int8<3>(qg, keys, n, dim, next, sg); break;
    }
  }
}

// acc[g] = acc[g] * corr[g] + sum_j p[g][j] * value[j] for GB heads, NV * 8 columns at a time:
// the accumulators stay in registers while the tile's values stream past. With PH = 2, even and
// odd keys go to two sets of accumulators, added at the end: twice the independent FMA chains
// (a key's FMA no longer waits on the previous key's; int8 rows in L3, shapes as above: 18.2
// -> 17.0 ns). `p` already holds an int8 row's scale.
// Every loop over ph, g and v is unrolled by pragma: GCC 12 unrolls them anyway at -O3, but
// after its store motion, so the accumulators stayed in registers and were also stored to the
// stack at every key (12 ymm stores a key pair for GB = 3; `perf annotate`: ~30% of this
// function's samples). The arithmetic is the same, in the same order.
#define NANOSERVE_UNROLL _Pragma("GCC unroll 16")
template <typename T, int GB, int NV, int PH>
void accumulate_columns(const float* p, const T* const* values, int64_t n, int64_t dim,
                        int64_t d0, const float* corr, float* acc) {
  __m256 a[PH][GB][NV];
  NANOSERVE_UNROLL
  for (int g = 0; g < GB; ++g) {
    const __m256 c = _mm256_set1_ps(corr[g]);
    NANOSERVE_UNROLL
    for (int v = 0; v < NV; ++v) {
      a[0][g][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * dim + d0 + 8 * v), c);
      NANOSERVE_UNROLL
      for (int ph = 1; ph < PH; ++ph) a[ph][g][v] = _mm256_setzero_ps();
    }
  }
  auto add_key = [&](int64_t j, __m256 (&into)[GB][NV]) {
    __m256 x[NV];
    NANOSERVE_UNROLL
    for (int v = 0; v < NV; ++v) x[v] = load8(values[j] + d0 + 8 * v);
    NANOSERVE_UNROLL
    for (int g = 0; g < GB; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * kTileTokens + j);
      NANOSERVE_UNROLL
      for (int v = 0; v < NV; ++v) into[g][v] = _mm256_fmadd_ps(w, x[v], into[g][v]);
    }
  };
  int64_t j = 0;
  for (; j + PH <= n; j += PH) {
    NANOSERVE_UNROLL
    for (int ph = 0; ph < PH; ++ph) add_key(j + ph, a[ph]);
  }
  for (; j < n; ++j) add_key(j, a[0]);
  NANOSERVE_UNROLL
  for (int g = 0; g < GB; ++g)
    NANOSERVE_UNROLL
    for (int v = 0; v < NV; ++v) {
      __m256 sum = a[0][g][v];
      NANOSERVE_UNROLL
      for (int ph = 1; ph < PH; ++ph) sum = _mm256_add_ps(sum, a[ph][g][v]);
      _mm256_storeu_ps(acc + g * dim + d0 + 8 * v, sum);
    }
}

template <typename T, int GB>
void accumulate_tile(const float* p, const T* const* values, int64_t n, int64_t dim,
                     const float* corr, float* acc) {
  // At least 8 independent FMA chains (FMA latency 4 x 2 pipes), at most 12 accumulators (the
  // rest of the 16 registers hold a key's values and the weight): PH x GB x NV.
  constexpr int NV = GB == 1 ? 4 : 2;
  constexpr int PH = GB == 4 ? 1 : 2;
  int64_t d0 = 0;
  for (; d0 + 8 * NV <= dim; d0 += 8 * NV)
    accumulate_columns<T, GB, NV, PH>(p, values, n, dim, d0, corr, acc);
  for (; d0 < dim; d0 += 8) accumulate_columns<T, GB, 1, 2>(p, values, n, dim, d0, corr, acc);
}

// Query heads are taken four at a time, so each pass's accumulators fit in the 16 registers.
template <typename T>
void score_heads(const float* q, const T* const* keys, int64_t n, int64_t dim,
                 int64_t group, NextRows<T> next, float* scores) {
  for (int64_t g0 = 0; g0 < group; g0 += 4, next.count = 0) {
    const float* qg = q + g0 * dim;
    float* sg = scores + g0 * kTileTokens;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: score_tile<T, 1>(qg, keys, n, dim, next, sg); break;
      case 2: score_tile<T, 2>(qg, keys, n, dim, next, sg); break;
      case 3: score_tile<T, 3>(qg, keys, n, dim, next, sg); break;
      default: score_tile<T, 4>(qg, keys, n, dim, next, sg); break;
    }
  }
}

template <typename T>
void accumulate_heads(const float* p, const T* const* values, int64_t n, int64_t dim,
                      int64_t group, const float* corr, float* acc) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const float* pg = p + g0 * kTileTokens;
    float* ag = acc + g0 * dim;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: accumulate_tile<T, 1>(pg, values, n, dim, corr + g0, ag); break;
      case 2: accumulate_tile<T, 2>(pg, values, n, dim, corr + g0, ag); break;
      case 3: accumulate_tile<T, 3>(pg, values, n, dim, corr + g0, ag); break;
      default: accumulate_tile<T, 4>(pg, values, n, dim, corr + g0, ag); break;
    }
  }
}

// An int8 cache's softmax weights times their value rows' scales, for `group` rows of weights
// (kTileTokens apart) over the tile's n keys: P·V then multiplies the unscaled int8 values.
inline void scale_weights(float* p, const float* value_scale, int64_t n, int64_t group) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) p[g * kTileTokens + j] *= value_scale[j];
}

// Softmax bookkeeping for one tile, its keys [lo, n) real (keys before lo lie outside a
// sliding window): scores become exp(score - new max) in place, 0 outside; corr gets each
// head's correction factor exp(old max - new max) for what was accumulated before.
inline void softmax_tile(float* scores, int64_t lo, int64_t n, int64_t group, float* max,
                         float* sum, float* corr) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * kTileTokens;
    for (int64_t j = 0; j < lo; ++j) s[j] = kNegInf;  // outside the window
    for (int64_t j = n; j < padded; ++j) s[j] = kNegInf;  // pad to whole vectors
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (int64_t j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    const float new_max = std::max(max[g], hmax(vmax));
    corr[g] = max[g] == kNegInf ? 0.0f : std::exp(max[g] - new_max);
    max[g] = new_max;
    // the window's first tile always holds a real key (lo < n), so new_max is finite
    const __m256 m = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      vsum = _mm256_add_ps(vsum, p);
      _mm256_storeu_ps(s + j, p);
    }
    // Padding adds exp(ln(FLT_MIN)) ~ 1e-38 per entry to a sum of at least 1 (the max's own
    // term): nothing, in float32. P·V reads only the n real entries. One rounding, written
    // out: GCC contracts `sum * corr + x` into an FMA in some inlined copies and not in others
    // (measured: a copy inlined into run_attend.h's walk kept the two roundings), and every
    // copy must give the same bits.
    sum[g] = std::fma(sum[g], corr[g], hsum(vsum));
    std::fill(s, s + lo, 0.0f);  // keys outside the window weigh exactly nothing in P·V
  }
}

}  // namespace attention_tiles
