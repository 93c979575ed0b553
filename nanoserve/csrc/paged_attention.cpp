// Decode attention that reads the paged KV cache in place (no gathered copy of the keys).
// What it computes and why it is shaped this way: nanoserve/model/paged_decode.py.
//
// Cache layout (nanoserve/model/attention.py): k_cache, v_cache [Hkv, num_blocks, block_size, D]
// float32 or float16, or int8 [..., D + 4] (kv_int8.h: D values and the row's float32 scale);
// token t of request b lives in block block_table[b][t / block_size], row t % block_size, of
// each KV head's plane. A float16 row is widened to float32 as it loads (F16C), an int8 row
// too, its scale applied once per dot product (to the score of a key, to the softmax weight of
// a value); q, the scores, the softmax and the accumulators are float32 for every cache.
//
// One work item is (request, KV head, partition of the context). It loads each key and value
// row once and uses it for the G = H / Hkv query heads that share it. The context is walked in
// tiles of kTileTokens: scores for the tile (G dot products per key), one max/exp/sum per tile
// (online softmax: the running sums are rescaled once per tile, not per token), then P·V.
// Contexts longer than kPartitionTokens are split into partitions of that many tokens, attended
// in parallel and merged by log-sum-exp. The split depends only on a context's own length, never
// on the batch or the thread count, so a request's result is the same alone or batched (and a
// prompt token's, whatever chunk it was prefilled in: prefill queries come here too).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_int8.h"
#include "simd_exp.h"
#include "simd_reduce.h"

namespace {

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
constexpr int64_t kTileTokens = 32;        // keys scored per tile
constexpr int64_t kPartitionTokens = 512;  // a multiple of kTileTokens
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A cache element: float, or an IEEE half held as its 16 bits (at::Half's storage).
using Half = uint16_t;

// 8 cache elements as 8 floats: the only place the two cache types differ.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) { return kv_int8::load8(p); }

// Elements of T per cache row, and the factor a row's dot products take (1 but for int8).
template <typename T>
constexpr int64_t row_elements(int64_t dim) {
  return std::is_same_v<T, int8_t> ? dim + kv_int8::kScaleBytes : dim;
}
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

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {  // one request per 64-byte line
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = row_elements<T>(dim) * int64_t(sizeof(T));
  for (int64_t b = 0; b < size; b += 64) _mm_prefetch(bytes + b, _MM_HINT_T1);
  // an int8 row (D + 4 bytes) may end in one more line than its start implies
  if (size % 64 != 0) _mm_prefetch(bytes + size - 1, _MM_HINT_T1);
}

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
inline __m128i hsum4_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

template <int GB>
void score_tile_int8(const int8_t* q8, const int8_t* const* keys, int64_t n, int64_t dim,
                     const NextRows<int8_t>& next, float* scores) {
  constexpr int kKeys = 4;
  const int64_t row = row_elements<int8_t>(dim);
  const __m256i ones = _mm256_set1_epi16(1);
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
          // |k| * (q with k's sign): pairs sum to at most 2 * 128 * 127, within int16
          const __m256i pairs = _mm256_maddubs_epi16(k_abs, _mm256_sign_epi8(qv, kv));
          acc[g][i] = _mm256_add_epi32(acc[g][i], _mm256_madd_epi16(pairs, ones));
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

void score_heads_int8(const int8_t* q8, const int8_t* const* keys, int64_t n, int64_t dim,
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
template <typename T, int GB, int NV, int PH>
void accumulate_columns(const float* p, const T* const* values, int64_t n, int64_t dim,
                        int64_t d0, const float* corr, float* acc) {
  __m256 a[PH][GB][NV];
  for (int g = 0; g < GB; ++g) {
    const __m256 c = _mm256_set1_ps(corr[g]);
    for (int v = 0; v < NV; ++v) {
      a[0][g][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * dim + d0 + 8 * v), c);
      for (int ph = 1; ph < PH; ++ph) a[ph][g][v] = _mm256_setzero_ps();
    }
  }
  auto add_key = [&](int64_t j, __m256 (&into)[GB][NV]) {
    __m256 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load8(values[j] + d0 + 8 * v);
    for (int g = 0; g < GB; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * kTileTokens + j);
      for (int v = 0; v < NV; ++v) into[g][v] = _mm256_fmadd_ps(w, x[v], into[g][v]);
    }
  };
  int64_t j = 0;
  for (; j + PH <= n; j += PH)
    for (int ph = 0; ph < PH; ++ph) add_key(j + ph, a[ph]);
  for (; j < n; ++j) add_key(j, a[0]);
  for (int g = 0; g < GB; ++g)
    for (int v = 0; v < NV; ++v) {
      __m256 sum = a[0][g][v];
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

// Softmax bookkeeping for one tile: scores become exp(score - new max) in place; corr gets each
// head's correction factor exp(old max - new max) for what was accumulated before.
void softmax_tile(float* scores, int64_t n, int64_t group, float* max, float* sum, float* corr) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * kTileTokens;
    for (int64_t j = n; j < padded; ++j) s[j] = kNegInf;  // pad to whole vectors
    __m256 vmax = _mm256_set1_ps(kNegInf);
    for (int64_t j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    const float new_max = std::max(max[g], hmax(vmax));
    corr[g] = max[g] == kNegInf ? 0.0f : std::exp(max[g] - new_max);
    max[g] = new_max;
    const __m256 m = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      vsum = _mm256_add_ps(vsum, p);
      _mm256_storeu_ps(s + j, p);
    }
    // Padding adds exp(ln(FLT_MIN)) ~ 1e-38 per entry to a sum of at least 1 (the max's own
    // term): nothing, in float32. P·V reads only the n real entries.
    sum[g] = sum[g] * corr[g] + hsum(vsum);
  }
}

template <typename T>
struct Problem {
  const float* q;    // [B, H, D]
  const T* k_cache;  // [Hkv, num_blocks, block_size, D]
  const T* v_cache;
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* context_lens;  // [B]
  int64_t num_heads, num_kv_heads, dim, num_blocks, block_size, max_blocks;
  float scale;
};

// One thread's working memory: the scaled queries, a tile's scores and its rows' addresses.
template <typename T>
struct Scratch {
  std::vector<float> q, scores, corr;
  std::vector<int8_t> q8;  // q's heads as int8 rows, for an int8 cache's integer scores
  std::vector<const T*> keys, values;  // two tiles' worth: this one and the next
  explicit Scratch(int64_t group, int64_t dim)
      : q(group * dim), scores(group * kTileTokens), corr(group),
        q8(group * row_elements<int8_t>(dim)), keys(2 * kTileTokens), values(2 * kTileTokens) {}
};

// Whether an int8 cache's scores are taken in integers (score_tile_int8): 32 bytes per load.
template <typename T>
bool scores_in_int8(int64_t dim) {
  return std::is_same_v<T, int8_t> && dim % 32 == 0;
}

// Row pointers of tokens [t0, t0 + n).
template <typename T>
void locate_rows(const Problem<T>& pb, const int32_t* table, int64_t plane, int64_t t0,
                 int64_t n, const T** keys, const T** values) {
  const int64_t bs = pb.block_size, dim = pb.dim;
  int64_t block = t0 / bs, offset = t0 % bs;  // stepped, not divided, per token
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = plane + static_cast<int64_t>(table[block]) * bs + offset;
    keys[j] = pb.k_cache + row * row_elements<T>(dim);
    values[j] = pb.v_cache + row * row_elements<T>(dim);
    if (++offset == bs) {
      offset = 0;
      ++block;
    }
  }
}

// Attention of one (request, KV head) over tokens [begin, end): unnormalized acc [G, D], the
// running max and sum [G].
template <typename T>
void attend_range(const Problem<T>& pb, int64_t b, int64_t kv_head, int64_t begin, int64_t end,
                  Scratch<T>& sc, float* acc, float* max, float* sum) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const float* q = pb.q + (b * pb.num_heads + kv_head * group) * dim;
  for (int64_t i = 0; i < group * dim; ++i) sc.q[i] = q[i] * pb.scale;
  if (scores_in_int8<T>(dim))
    for (int64_t g = 0; g < group; ++g)
      kv_int8::quantize_row(sc.q.data() + g * dim, sc.q8.data() + g * row_elements<int8_t>(dim),
                            dim);
  std::fill(acc, acc + group * dim, 0.0f);
  std::fill(max, max + group, kNegInf);
  std::fill(sum, sum + group, 0.0f);
  const int32_t* table = pb.block_table + b * pb.max_blocks;
  const int64_t plane = kv_head * pb.num_blocks * pb.block_size;  // this head's first row
  const T** keys = sc.keys.data();  // [this tile | next tile]
  const T** values = sc.values.data();
  locate_rows(pb, table, plane, begin, std::min(kTileTokens, end - begin), keys, values);
  for (int64_t t0 = begin; t0 < end; t0 += kTileTokens) {
    const int64_t n = std::min(kTileTokens, end - t0);
    // the next tile's rows load while this one computes
    const int64_t num_next = std::clamp<int64_t>(end - t0 - n, 0, kTileTokens);
    locate_rows(pb, table, plane, t0 + n, num_next, keys + kTileTokens, values + kTileTokens);
    const NextRows<T> next{keys + kTileTokens, values + kTileTokens, num_next};
    if constexpr (std::is_same_v<T, int8_t>) {
      if (scores_in_int8<T>(dim))
        score_heads_int8(sc.q8.data(), keys, n, dim, group, next, sc.scores.data());
      else
        score_heads<T>(sc.q.data(), keys, n, dim, group, next, sc.scores.data());
    } else {
      score_heads<T>(sc.q.data(), keys, n, dim, group, next, sc.scores.data());
    }
    softmax_tile(sc.scores.data(), n, group, max, sum, sc.corr.data());
    if constexpr (std::is_same_v<T, int8_t>) {  // each value row's scale, once per weight
      for (int64_t j = 0; j < n; ++j) {
        const float scale = row_scale(values[j], dim);
        for (int64_t g = 0; g < group; ++g) sc.scores[g * kTileTokens + j] *= scale;
      }
    }
    accumulate_heads<T>(sc.scores.data(), values, n, dim, group, sc.corr.data(), acc);
    std::copy(keys + kTileTokens, keys + kTileTokens + num_next, keys);
    std::copy(values + kTileTokens, values + kTileTokens + num_next, values);
  }
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_table,
                  const torch::Tensor& context_lens, const torch::Tensor& out) {
  for (const auto* t : {&q, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "paged decode_attention takes contiguous CPU tensors");
  }
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "q and out must be float32");
  const auto type = k_cache.scalar_type();
  TORCH_CHECK((type == torch::kFloat32 || type == torch::kFloat16 || type == torch::kChar) &&
                  v_cache.scalar_type() == type,
              "the caches must both be float32, both float16 or both int8");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "expected q [B, H, D] and caches [Hkv, num_blocks, block_size, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape [B, H, D]");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t row = type == torch::kChar ? dim + kv_int8::kScaleBytes : dim;
  TORCH_CHECK(k_cache.size(3) == row && dim % 8 == 0,
              "head_dim must be a multiple of 8, and cache rows ", row, " elements (head_dim ",
              dim, type == torch::kChar ? " + a 4-byte scale)" : ")");
  TORCH_CHECK(k_cache.size(0) > 0 && heads % k_cache.size(0) == 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 &&
                  block_table.size(0) == batch && block_table.is_contiguous(),
              "block_table must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.numel() == batch &&
                  context_lens.is_contiguous(),
              "context_lens must be contiguous int32 [B]");
  // An id out of range would read outside the cache: check every block a context uses.
  const int64_t bs = k_cache.size(2), num_blocks = k_cache.size(1);
  const int64_t max_blocks = block_table.size(1);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (static_cast<int64_t>(lens[b]) + bs - 1) / bs;
    TORCH_CHECK(lens[b] >= 0 && used <= max_blocks, "context_lens[", b, "] = ", lens[b],
                " does not fit the block table's ", max_blocks, " blocks of ", bs);
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(table[b * max_blocks + i] >= 0 && table[b * max_blocks + i] < num_blocks,
                  "block_table[", b, ", ", i, "] = ", table[b * max_blocks + i],
                  " is outside the cache's ", num_blocks, " blocks");
  }
}

// The whole batch for one cache element type T (float or Half); writes out [B, H, D].
template <typename T>
void attend_batch(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_table,
                  const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  const Problem<T> pb{q.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()),
                      static_cast<const T*>(v_cache.data_ptr()), block_table.data_ptr<int32_t>(),
                      context_lens.data_ptr<int32_t>(), q.size(1), k_cache.size(0), q.size(2),
                      k_cache.size(1), k_cache.size(2), block_table.size(1),
                      static_cast<float>(scale)};
  float* out_ptr = out.data_ptr<float>();
  const int64_t batch = q.size(0), group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t items = batch * pb.num_kv_heads;
  if (items == 0) return;
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max<int64_t>(max_len, pb.context_lens[b]);

  // Fixed-length partitions (an item's empty ones, past its context, are skipped in the merge;
  // one non-empty partition merges to exactly the unsplit result).
  const int64_t part_len = kPartitionTokens;
  const int64_t parts = std::max<int64_t>(1, (max_len + part_len - 1) / part_len);

  if (parts == 1) {  // each item writes its G output rows directly
    at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
      Scratch<T> sc(group, dim);
      std::vector<float> max(group), sum(group);
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
        float* acc = out_ptr + (b * pb.num_heads + kv_head * group) * dim;
        attend_range(pb, b, kv_head, 0, pb.context_lens[b], sc, acc, max.data(), sum.data());
        for (int64_t g = 0; g < group; ++g) {
          const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
          for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= inv;
        }
      }
    });
    return;
  }

  // Split contexts: partial [items, parts, G, D] results, then a log-sum-exp merge per head.
  std::vector<float> part_acc(items * parts * group * dim);
  std::vector<float> part_max(items * parts * group), part_sum(items * parts * group);
  at::parallel_for(0, items * parts, 1, [&](int64_t first, int64_t last) {
    Scratch<T> sc(group, dim);
    for (int64_t i = first; i < last; ++i) {
      const int64_t item = i / parts, part = i % parts;
      const int64_t b = item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
      const int64_t begin = part * part_len;
      const int64_t end = std::min<int64_t>(begin + part_len, pb.context_lens[b]);
      attend_range(pb, b, kv_head, begin, std::max(begin, end), sc,
                   part_acc.data() + i * group * dim, part_max.data() + i * group,
                   part_sum.data() + i * group);
    }
  });
  at::parallel_for(0, items * group, 1, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {  // row = (item, g) = (b, query head)
      const int64_t item = row / group, g = row % group;
      float global_max = kNegInf;
      for (int64_t p = 0; p < parts; ++p)
        global_max = std::max(global_max, part_max[(item * parts + p) * group + g]);
      float* o = out_ptr + row * dim;  // items * group rows are exactly [B, H] in order
      std::fill(o, o + dim, 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at = (item * parts + p) * group + g;
        if (part_sum[at] == 0.0f) continue;  // an empty partition (context ended before it)
        const float w = std::exp(part_max[at] - global_max);
        total += part_sum[at] * w;
        const float* a = part_acc.data() + at * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] += w * a[d];
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
    }
  });
}

}  // namespace

// out [B, H, D] = softmax(q · K^T * scale) · V per request, over its context_lens[b] cached
// tokens, for a float32, float16 or int8 cache. Writes `out` and returns it.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor context_lens,
                               double scale, torch::Tensor out) {
  check_inputs(q, k_cache, v_cache, block_table, context_lens, out);
  if (k_cache.scalar_type() == torch::kFloat16)
    attend_batch<Half>(q, k_cache, v_cache, block_table, context_lens, scale, out);
  else if (k_cache.scalar_type() == torch::kChar)
    attend_batch<int8_t>(q, k_cache, v_cache, block_table, context_lens, scale, out);
  else
    attend_batch<float>(q, k_cache, v_cache, block_table, context_lens, scale, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Decode attention over a paged float32, float16 or int8 KV cache, read in place "
        "(CPU, AVX2)");
}
