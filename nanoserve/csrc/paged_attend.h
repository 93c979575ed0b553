// Decode attention over the paged KV cache, one work item at a time (paged_attention.cpp's
// design is at its top): an item is (request, KV head), or (request, KV head, partition) where
// a context is split, and split results merge by log-sum-exp. paged_attention.cpp hands items
// to at::parallel_for; decode_layers.cpp's one-region forward hands each thread its share. One
// definition for both, so the two give the same bits.
// Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, with
// no value) join once per (query, head), where a row is normalized (`normalizer`: the unsplit
// walk's end and merge_parts), never per tile or partition.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "flash_tiles.h"
#include "kv_int8.h"
#include "schedule.h"

namespace paged_attend {

using namespace attention_tiles;

// Contexts longer than this are split into partitions attended in parallel (see the top).
constexpr int64_t kPartitionTokens = 512;  // a multiple of every walk step (kMaxBlockTiles)

template <typename T>
struct Problem {
  const float* q;    // [B, H, D]
  const T* k_cache;  // [Hkv, num_blocks, block_size, D]
  const T* v_cache;
  const int32_t* block_table;  // [B, max_blocks]
  const int32_t* context_lens;  // [B]
  int64_t num_heads, num_kv_heads, dim, num_blocks, block_size, max_blocks;
  float scale;
  int64_t window = 0;  // a sliding window's keys (0: the whole context)
  // [B] where a row's window ends elsewhere than its context (an image's placeholder, which
  // attends its whole image but windows from its own position); null: at its context's end
  const int32_t* window_ends = nullptr;
  const float* sinks = nullptr;  // [H] each query head's sink logit (gpt-oss); null: none
};

// The factor that turns a row's unnormalized acc (taken against its running max, sum its
// weights) into its output: 1 / sum; with a sink logit, exp(max - top) / (sum * exp(max - top)
// + exp(sink - top)), top = max(max, sink), the sink joining the denominator once. Both
// normalizations call this with the same (max, sum) for a row, so a row's bits do not depend
// on whether its context was split. A row with no keys (sum 0) gets 0 either way.
inline float normalizer(float max, float sum, const float* sink) {
  if (sink == nullptr) return sum > 0.0f ? 1.0f / sum : 0.0f;
  if (sum == 0.0f) return 0.0f;  // (max is -inf: exp(max - top) would be NaN with sink -inf)
  const float top = std::max(max, *sink);
  const float keep = std::exp(max - top);
  return keep / std::fma(sum, keep, std::exp(*sink - top));  // one rounding in every copy
}

// The first key row b attends: the whole context's first, or its sliding window's (the last
// `window` keys, as transformers' sliding masks keep them).
template <typename T>
inline int64_t window_start(const Problem<T>& pb, int64_t b) {
  if (pb.window <= 0) return 0;
  const int64_t end = pb.window_ends != nullptr ? pb.window_ends[b] : pb.context_lens[b];
  return std::max<int64_t>(0, end - pb.window);
}

// The tile a walk over keys [begin, ...) starts at when the row's first key is `start`: tiles
// stay on multiples of kTileTokens (begin is one), so a row's tiles, and its bits, are the
// same in every path and batch.
inline int64_t first_tile(int64_t begin, int64_t start) {
  return std::max(begin, start / kTileTokens * kTileTokens);
}

// The keys a walk step reads (schedule.h's attention_block_tokens): 1, 2 or 4 tiles. A step
// scores its tiles' keys (each key's score is its own dot product), then runs each tile's
// online softmax and P·V in order, exactly as a walk of one tile a step does: the tile (32
// keys, where the running sums are rescaled) decides a row's bits and never changes; the step
// decides only how far ahead rows are requested and whether keys and values stream in runs of
// one tile or of several. Candidates, as the tuner times them on the user's CPU.
constexpr int64_t kMaxBlockTiles = 4;
static_assert(kPartitionTokens % (kMaxBlockTiles * kTileTokens) == 0,
              "a partition is whole steps of every size");

// One thread's working memory: the scaled queries, a step's scores (tile by tile) and its rows'
// addresses.
template <typename T>
struct Scratch {
  std::vector<float> q, scores, corr;
  std::vector<int8_t> q8;  // q's heads as int8 rows, for an int8 cache's integer scores
  std::vector<const T*> keys, values;  // two steps' worth: this one and the next
  explicit Scratch(int64_t group, int64_t dim)
      : q(group * dim), scores(kMaxBlockTiles * group * kTileTokens),
        corr(group), q8(group * row_elements<int8_t>(dim)),
        keys(2 * kMaxBlockTiles * kTileTokens), values(2 * kMaxBlockTiles * kTileTokens) {}
};

// Whether an int8 cache's scores are taken in integers (score_tile_int8): 32 bytes per load.
template <typename T>
inline bool scores_in_int8(int64_t dim) {
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

// The walk of attend_range from tile-aligned `walk` to `end`, K tiles a step (see
// kMaxBlockTiles): q, acc, max and sum set up by attend_range.
template <typename T, int K>
void walk_tiles(const Problem<T>& pb, const int32_t* table, int64_t plane, int64_t start,
                int64_t walk, int64_t end, int64_t group, Scratch<T>& sc, float* acc,
                float* max, float* sum) {
  constexpr int64_t kStep = K * kTileTokens;
  const int64_t dim = pb.dim;
  const T** keys = sc.keys.data();  // [this step | next step]
  const T** values = sc.values.data();
  if (walk < end) locate_rows(pb, table, plane, walk, std::min(kStep, end - walk), keys, values);
  for (int64_t s0 = walk; s0 < end; s0 += kStep) {
    const int64_t in_step = std::min(kStep, end - s0);
    // the next step's rows load while this one computes
    const int64_t num_next = std::clamp<int64_t>(end - s0 - in_step, 0, kStep);
    locate_rows(pb, table, plane, s0 + in_step, num_next, keys + kStep, values + kStep);
    // 1) every tile's scores; tile i requests the next step's tile i
    for (int64_t j0 = 0; j0 < in_step; j0 += kTileTokens) {
      const int64_t n = std::min(kTileTokens, in_step - j0);
      const NextRows<T> next{keys + kStep + j0, values + kStep + j0,
                             std::clamp<int64_t>(num_next - j0, 0, kTileTokens)};
      float* scores = sc.scores.data() + j0 / kTileTokens * group * kTileTokens;
      if constexpr (std::is_same_v<T, int8_t>) {
        if (scores_in_int8<T>(dim))
          score_heads_int8(sc.q8.data(), keys + j0, n, dim, group, next, scores);
        else
          score_heads<T>(sc.q.data(), keys + j0, n, dim, group, next, scores);
      } else {
        flash_tiles::score_keys(sc.q.data(), group, dim, keys + j0, n, scores, next);
      }
    }
    // 2) each tile's online softmax and P·V, in the walk's order
    for (int64_t j0 = 0; j0 < in_step; j0 += kTileTokens) {
      const int64_t n = std::min(kTileTokens, in_step - j0);
      const int64_t lo = std::clamp<int64_t>(start - (s0 + j0), 0, n);  // keys before: outside
      float* scores = sc.scores.data() + j0 / kTileTokens * group * kTileTokens;
      if constexpr (std::is_same_v<T, int8_t>) {
        softmax_tile(scores, lo, n, group, max, sum, sc.corr.data());
        float value_scale[kTileTokens];  // each value row's scale, once per weight
        for (int64_t j = 0; j < n; ++j) value_scale[j] = row_scale(values[j0 + j], dim);
        scale_weights(scores, value_scale, n, group);
        accumulate_heads<T>(scores, values + j0, n, dim, group, sc.corr.data(), acc);
      } else {
        for (int64_t g = 0; g < group; ++g)
          flash_tiles::softmax_row(scores + g * kTileTokens, lo, n, max[g], sum[g], sc.corr[g]);
        flash_tiles::accumulate_rows(scores, values + j0, n, group, dim, sc.corr.data(), acc);
      }
    }
    std::copy(keys + kStep, keys + kStep + num_next, keys);
    std::copy(values + kStep, values + kStep + num_next, values);
  }
}

// Attention of one (request, KV head) over tokens [begin, end): unnormalized acc [G, D], the
// running max and sum [G], for the group's query heads [h0, h1) (all G by default; then G is
// h1 - h0). A float or float16 cache runs flash_tiles.h, where a head's bits do not depend on
// the other heads it runs with; an int8 cache scores in integers (score_heads_int8) and takes
// heads in fours (accumulate_heads), so its heads split exactly only in groups under four.
// The schedule's walk step (kMaxBlockTiles) changes no bit.
template <typename T>
void attend_range(const Problem<T>& pb, int64_t b, int64_t kv_head, int64_t begin, int64_t end,
                  Scratch<T>& sc, float* acc, float* max, float* sum, int64_t h0 = 0,
                  int64_t h1 = -1) {
  const int64_t dim = pb.dim, whole = pb.num_heads / pb.num_kv_heads;
  const int64_t group = (h1 < 0 ? whole : h1) - h0;  // the query heads [h0, h1) of the group
  const float* q = pb.q + (b * pb.num_heads + kv_head * whole + h0) * dim;
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
  const int64_t start = window_start(pb, b), walk = first_tile(begin, start);
  switch (schedule::current().attention_block_tokens / kTileTokens) {
    case 4: return walk_tiles<T, 4>(pb, table, plane, start, walk, end, group, sc, acc, max, sum);
    case 2: return walk_tiles<T, 2>(pb, table, plane, start, walk, end, group, sc, acc, max, sum);
    default: return walk_tiles<T, 1>(pb, table, plane, start, walk, end, group, sc, acc, max, sum);
  }
}

// How many fixed-length partitions a batch's longest context needs (1: no split).
inline int64_t num_parts(const int32_t* context_lens, int64_t batch) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max<int64_t>(max_len, context_lens[b]);
  return std::max<int64_t>(1, (max_len + kPartitionTokens - 1) / kPartitionTokens);
}

// Whether splitting a group's query heads keeps every head's bits: always on a float or float16
// cache (flash_tiles.h); an int8 cache's subset must run the tile variants the whole group
// runs, and the group runs one variant for all its heads only when it has fewer than four
// (accumulate_tile's PH differs for four).
template <typename T>
inline bool heads_split_exactly(int64_t group) {
  return !std::is_same_v<T, int8_t> || group < 4;
}

// Units [first, last) of an unsplit batch, a unit being one query head of one item (unit = item
// * G + g), each normalized into out [B, H, D]; an item's heads are divided where the range cuts
// it. Balances work where items are few (batch 1, 3 KV heads, 2 threads: 1.5 items each, not 1
// and 2).
template <typename T>
void attend_heads(const Problem<T>& pb, int64_t first, int64_t last, Scratch<T>& sc, float* max,
                  float* sum, float* out) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  for (int64_t unit = first; unit < last;) {
    const int64_t item = unit / group, h0 = unit % group;
    const int64_t h1 = std::min(group, h0 + (last - unit));
    const int64_t b = item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
    float* acc = out + (b * pb.num_heads + kv_head * group + h0) * dim;
    attend_range(pb, b, kv_head, 0, pb.context_lens[b], sc, acc, max, sum, h0, h1);
    const float* sinks = pb.sinks ? pb.sinks + kv_head * group + h0 : nullptr;
    for (int64_t g = 0; g < h1 - h0; ++g) {
      const float inv = normalizer(max[g], sum[g], sinks ? sinks + g : nullptr);
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= inv;
    }
    unit += h1 - h0;
  }
}

// Items [first, last) of an unsplit batch (item = request * Hkv + KV head): each writes its G
// output rows of out [B, H, D] directly. max and sum: G floats of the caller's.
template <typename T>
void attend_items(const Problem<T>& pb, int64_t first, int64_t last, Scratch<T>& sc, float* max,
                  float* sum, float* out) {
  const int64_t group = pb.num_heads / pb.num_kv_heads;
  attend_heads(pb, first * group, last * group, sc, max, sum, out);  // whole groups
}

// A split batch's partial results: work items [first, last) of items * parts, each (item,
// partition) into part_acc [items, parts, G, D], part_max and part_sum [items, parts, G].
template <typename T>
void attend_parts(const Problem<T>& pb, int64_t parts, int64_t first, int64_t last,
                  Scratch<T>& sc, float* part_acc, float* part_max, float* part_sum) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  for (int64_t i = first; i < last; ++i) {
    const int64_t item = i / parts, part = i % parts;
    const int64_t b = item / pb.num_kv_heads, kv_head = item % pb.num_kv_heads;
    const int64_t begin = part * kPartitionTokens;
    const int64_t end = std::min<int64_t>(begin + kPartitionTokens, pb.context_lens[b]);
    attend_range(pb, b, kv_head, begin, std::max(begin, end), sc, part_acc + i * group * dim,
                 part_max + i * group, part_sum + i * group);
  }
}

// The log-sum-exp merge of a split batch's partials for output rows [first, last) of
// items * G (row = (item, g) = (request, query head): exactly out [B, H, D]'s rows in order).
// Row r's sink logit is sinks[r % sink_heads] (sinks null: none): H for out's rows, G for one
// KV head's rows from sinks + kv_head * G.
inline void merge_parts(int64_t parts, int64_t group, int64_t dim, const float* part_acc,
                        const float* part_max, const float* part_sum, int64_t first,
                        int64_t last, float* out, const float* sinks = nullptr,
                        int64_t sink_heads = 1) {
  for (int64_t row = first; row < last; ++row) {
    const int64_t item = row / group, g = row % group;
    float global_max = kNegInf;
    for (int64_t p = 0; p < parts; ++p)
      global_max = std::max(global_max, part_max[(item * parts + p) * group + g]);
    float* o = out + row * dim;
    std::fill(o, o + dim, 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t at = (item * parts + p) * group + g;
      if (part_sum[at] == 0.0f) continue;  // an empty partition (context ended before it)
      const float w = std::exp(part_max[at] - global_max);
      total = std::fma(part_sum[at], w, total);  // one rounding in every inlined copy
      const float* a = part_acc + at * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = std::fma(w, a[d], o[d]);
    }
    // one non-empty partition: (global_max, total, o) are exactly its (max, sum, acc)
    const float inv = normalizer(global_max, total, sinks ? sinks + row % sink_heads : nullptr);
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

// The contract of decode_attention's tensors; every block a context uses is checked, since an
// id out of range would read outside the cache.
inline void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_table,
                  const torch::Tensor& context_lens, const torch::Tensor& out,
                  int64_t window = 0) {
  TORCH_CHECK(window >= 0, "window must be 0 (the whole context) or a positive key count, got ",
              window);
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

}  // namespace paged_attend
