// A prefill chunk's rows attended together (paged_attention.cpp takes this path when a batch
// holds them): the rows of one request's run share their keys, so a block of up to kBlockRows
// consecutive tokens walks the context once, tile by tile: each tile's keys transposed and its
// values widened to float32 once for the block, then its tokens' query heads run
// flash_tiles.h's steps together, as a decode's heads do. A row's bits are those it gets alone
// (flash_tiles.h says why), so a token's result still does not depend on the chunk it came in.
// An int8 cache's rows run the same tiles where its decode scores in integers (head_dim a
// multiple of 32), with the decode's softmax and P·V per row, to the decode's bits
// (int8_tile_steps says how); a 512-row chunk at a 6,144-token context took 0.65x the time of
// the per-row walk it replaced (docs/benchmarks.md, "An int8 cache's prompt in tiles").
//
// Work items are (block, KV head), handed out largest first from a shared counter: a chunk's
// later rows see more keys, and in-order halves of a first chunk's rows give one thread a
// quarter of its keys. A block's partitions are merged where it ends, from its own partials;
// attention sinks join there, once per row, as they join a decode's (paged_attend.h).
// Figures: docs/benchmarks.md, "Prefill attention as tiled matrix products".
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "paged_attend.h"

namespace run_attend {

using namespace paged_attend;

// Tokens attended together (rows: tokens x query heads of a KV head). The last 512-row chunk
// of a 6,144-token context, one layer, float16 cache, 2 threads, Zen 4: 16 tokens 50-57 ms,
// 32 tokens 58-67 ms.
constexpr int64_t kBlockRows = 16;

// Rows [first, last) of the batch: one request's consecutive tokens, the last row's table
// covering every row's keys.
struct Block {
  int64_t first, last;
};

// The batch's rows cut into blocks: row b + 1 continues row b's run when its context is one
// longer and its table agrees on every block row b reads (a prefill chunk's rows carry copies
// of their request's table); runs are cut every kBlockRows rows.
inline std::vector<Block> row_blocks(const int32_t* table, const int32_t* lens, int64_t batch,
                                     int64_t max_blocks, int64_t block_size) {
  std::vector<Block> blocks;
  for (int64_t b = 0; b < batch; ++b) {
    const bool continues =
        !blocks.empty() && blocks.back().last == b && b - blocks.back().first < kBlockRows &&
        lens[b] == lens[b - 1] + 1 &&
        std::memcmp(table + (b - 1) * max_blocks, table + b * max_blocks,
                    sizeof(int32_t) * ((lens[b - 1] + block_size - 1) / block_size)) == 0;
    if (continues) ++blocks.back().last;
    else blocks.push_back({b, b + 1});
  }
  return blocks;
}

// Whether any block holds more than one row (else the per-row path is all there is to do).
inline bool has_runs(const std::vector<Block>& blocks) {
  return std::any_of(blocks.begin(), blocks.end(),
                     [](const Block& blk) { return blk.last - blk.first > 1; });
}

// One thread's working memory for a block, its rows being (token, query head) pairs in the
// output's order: their scaled queries; one tile's keys transposed and values widened; the
// tile's scores; the running sums of the partition being walked; and every row's partials
// [tokens, parts, G, D] until the merge.
template <typename T>
struct BlockScratch {
  std::vector<float> q, kt, values, scores, corr, acc, max, sum;
  std::vector<float> part_acc, part_max, part_sum, merged;
  std::vector<float> q_scale, key_scale, value_scale;  // an int8 cache's row scales
  std::vector<int8_t> q8;  // a row's query as an int8 row, as the decode rounds it
  std::vector<const float*> value_rows;
  std::vector<const T*> cache_keys, cache_values;  // a tile's rows in the cache
  BlockScratch(int64_t group, int64_t dim)
      : q(kBlockRows * group * dim), kt(kTileTokens * dim), values(kTileTokens * dim),
        scores(kBlockRows * group * kTileTokens), corr(kBlockRows * group),
        acc(kBlockRows * group * dim), max(kBlockRows * group), sum(kBlockRows * group),
        q_scale(kInt8 ? kBlockRows * group : 0), key_scale(kInt8 ? kTileTokens : 0),
        value_scale(kInt8 ? kTileTokens : 0), q8(kInt8 ? row_elements<int8_t>(dim) : 0),
        value_rows(kTileTokens), cache_keys(kTileTokens), cache_values(kTileTokens) {}
  static constexpr bool kInt8 = std::is_same_v<T, int8_t>;
};

// Rows of a tile as float32 rows: float rows are used where they lie, half rows widened.
template <typename T>
void widen_tile(const T* const* cache_rows, int64_t n, int64_t dim, float* into,
                const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      rows[j] = cache_rows[j];
    } else {
      for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(into + j * dim + d,
                                                            load8(cache_rows[j] + d));
      rows[j] = into + j * dim;
    }
  }
}

// An int8 cache's steps after a tile's scores, for rows [row0, row0 + rows) (rows of tokens
// first, first + 1, ...), giving each row the bits the decode's walk (paged_attend.h's
// attend_range) gives it. The scores came from float FMAs over int8 values held as floats:
// every product and partial sum is an integer below 2^24 (64 x 127 x 127 for D = 64; 2^24 is
// passed only past D = 1,040, kExactInt8Dim, where blocks are not used), so float sums are
// exact whatever their order and equal the decode's int32 sums, then scaled as the decode
// scales them: (sum x q's scale) x k's scale.
// The softmax is the decode's (attention_tiles.h's softmax_tile, one row at a time); a row's
// keys past its context get weight exactly 0, so P·V over the tile's n_max keys adds exactly
// nothing for them (the decode's loop over n keys pairs even and odd keys the same way); the
// weights take the value rows' scales, then P·V runs the decode's accumulate_heads, per token,
// on the values widened to float (exactly the values the decode widens as it loads them).
template <typename T>
void int8_tile_steps(BlockScratch<T>& sc, const int64_t* starts, const int64_t* ends,
                     int64_t t0, int64_t n_max, int64_t first, int64_t rows, int64_t group,
                     int64_t dim) {
  const int64_t row0 = first * group;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = first + i / group;
    const int64_t n = std::min(kTileTokens, ends[r] - t0);
    const int64_t lo = std::clamp<int64_t>(starts[r] - t0, 0, n);
    float* s = sc.scores.data() + i * kTileTokens;
    const float q_scale = sc.q_scale[row0 + i];
    for (int64_t j = 0; j < n; ++j) s[j] = s[j] * q_scale * sc.key_scale[j];
    softmax_tile(s, lo, n, 1, &sc.max[row0 + i], &sc.sum[row0 + i], &sc.corr[i]);
    std::fill(s + n, s + n_max, 0.0f);
    scale_weights(s, sc.value_scale.data(), n, 1);
  }
  for (int64_t i = 0; i < rows; i += group)
    accumulate_heads<float>(sc.scores.data() + i * kTileTokens, sc.value_rows.data(), n_max,
                            dim, group, sc.corr.data() + i, sc.acc.data() + (row0 + i) * dim);
}

// Partition `part` of every row of `blk` for one KV head, tile by tile: each tile's keys are
// transposed and its values widened once for the whole block, then the rows whose context
// reaches the tile (the block's later tokens: contexts grow by one a token) run
// flash_tiles.h's steps as a decode's heads do. Token r's partial goes to the scratch's
// [r, part] slot (an empty one where its context ends before the partition).
template <typename T>
void attend_partition(const Problem<T>& pb, const Block& blk, int64_t kv_head, int64_t part,
                      int64_t parts, BlockScratch<T>& sc) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t tokens = blk.last - blk.first, begin = part * kPartitionTokens;
  int64_t starts[kBlockRows], ends[kBlockRows];  // each row's keys [start, end) here
  for (int64_t r = 0; r < tokens; ++r) {
    starts[r] = window_start(pb, blk.first + r);
    ends[r] = std::clamp<int64_t>(pb.context_lens[blk.first + r], begin,
                                  begin + kPartitionTokens);
  }
  const int64_t max_end = ends[tokens - 1];  // contexts (and windows) grow along the block
  const int64_t walk = first_tile(begin, starts[0]);
  std::fill_n(sc.acc.data(), tokens * group * dim, 0.0f);
  std::fill_n(sc.max.data(), tokens * group, kNegInf);
  std::fill_n(sc.sum.data(), tokens * group, 0.0f);
  const int32_t* table = pb.block_table + (blk.last - 1) * pb.max_blocks;  // covers every row
  const int64_t plane = kv_head * pb.num_blocks * pb.block_size;
  const T** keys = sc.cache_keys.data();
  const T** values = sc.cache_values.data();
  if (walk < max_end)
    locate_rows(pb, table, plane, walk, std::min(kTileTokens, max_end - walk), keys, values);
  int64_t first = 0, last = 0;  // the tokens [first, last) whose keys reach into the tile
  for (int64_t t0 = walk; t0 < max_end; t0 += kTileTokens) {
    const int64_t n_max = std::min(kTileTokens, max_end - t0);
    flash_tiles::transpose_keys(keys, n_max, dim, sc.kt.data(), NextRows<T>{nullptr, nullptr, 0});
    widen_tile(values, n_max, dim, sc.values.data(), sc.value_rows.data());
    if constexpr (std::is_same_v<T, int8_t>) {
      for (int64_t j = 0; j < n_max; ++j) {
        sc.key_scale[j] = kv_int8::row_scale(keys[j], dim);
        sc.value_scale[j] = kv_int8::row_scale(values[j], dim);
      }
    }
    const int64_t num_next = std::clamp<int64_t>(max_end - t0 - n_max, 0, kTileTokens);
    locate_rows(pb, table, plane, t0 + n_max, num_next, keys, values);  // read: done with these
    for (int64_t j = 0; j < num_next; ++j) {  // the next tile loads while this one computes
      prefetch_row(keys[j], dim);
      prefetch_row(values[j], dim);
    }
    while (ends[first] <= t0) ++first;
    while (last < tokens && starts[last] < t0 + kTileTokens) ++last;
    const int64_t row0 = first * group, rows = (last - first) * group;
    flash_tiles::score_rows(sc.q.data() + row0 * dim, dim, rows, sc.kt.data(), dim,
                            sc.scores.data());
    if constexpr (std::is_same_v<T, int8_t>) {
      int8_tile_steps(sc, starts, ends, t0, n_max, first, rows, group, dim);
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = first + i / group;
        const int64_t n = std::min(kTileTokens, ends[r] - t0);
        const int64_t lo = std::clamp<int64_t>(starts[r] - t0, 0, n);
        flash_tiles::softmax_row(sc.scores.data() + i * kTileTokens, lo, n, sc.max[row0 + i],
                                 sc.sum[row0 + i], sc.corr[i]);
      }
      flash_tiles::accumulate_rows(sc.scores.data(), sc.value_rows.data(), n_max, rows, dim,
                                   sc.corr.data(), sc.acc.data() + row0 * dim);
    }
  }
  for (int64_t r = 0; r < tokens; ++r) {  // token r's heads, into its [r, part] slot
    const int64_t slot = r * parts + part;
    std::copy_n(sc.acc.data() + r * group * dim, group * dim,
                sc.part_acc.data() + slot * group * dim);
    std::copy_n(sc.max.data() + r * group, group, sc.part_max.data() + slot * group);
    std::copy_n(sc.sum.data() + r * group, group, sc.part_sum.data() + slot * group);
  }
}

// Every row of `blk` for one KV head, normalized into out [B, H, D].
template <typename T>
void attend_block(const Problem<T>& pb, const Block& blk, int64_t kv_head, BlockScratch<T>& sc,
                  float* out) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t rows = blk.last - blk.first;
  int32_t longest = 0;
  for (int64_t b = blk.first; b < blk.last; ++b) longest = std::max(longest, pb.context_lens[b]);
  const int64_t parts = std::max<int64_t>(1, (longest + kPartitionTokens - 1) / kPartitionTokens);
  sc.part_acc.resize(rows * parts * group * dim);
  sc.part_max.resize(rows * parts * group);
  sc.part_sum.resize(rows * parts * group);
  sc.merged.resize(rows * group * dim);
  for (int64_t r = 0; r < rows; ++r) {  // the queries, scaled as attend_range scales them
    const float* q = pb.q + ((blk.first + r) * pb.num_heads + kv_head * group) * dim;
    float* scaled = sc.q.data() + r * group * dim;
    for (int64_t i = 0; i < group * dim; ++i) scaled[i] = q[i] * pb.scale;
    if constexpr (std::is_same_v<T, int8_t>) {  // rounded per head as the decode rounds them
      for (int64_t g = 0; g < group; ++g) {
        float* head = scaled + g * dim;
        kv_int8::quantize_row(head, sc.q8.data(), dim);
        sc.q_scale[r * group + g] = kv_int8::row_scale(sc.q8.data(), dim);
        for (int64_t d = 0; d < dim; ++d) head[d] = float(sc.q8[d]);
      }
    }
  }
  for (int64_t p = 0; p < parts; ++p) attend_partition(pb, blk, kv_head, p, parts, sc);
  // One non-empty partition merges to exactly what an unsplit walk normalizes (weight
  // exp(0) = 1), so this is the per-row path's result whether or not it split the batch.
  merge_parts(parts, group, dim, sc.part_acc.data(), sc.part_max.data(), sc.part_sum.data(), 0,
              rows * group, sc.merged.data(),
              pb.sinks ? pb.sinks + kv_head * group : nullptr, group);
  for (int64_t r = 0; r < rows; ++r)
    std::copy_n(sc.merged.data() + r * group * dim, group * dim,
                out + ((blk.first + r) * pb.num_heads + kv_head * group) * dim);
}

// The (block, KV head) items (item = block * Hkv + KV head), largest first: the order threads
// take them in from a shared counter.
inline std::vector<int64_t> largest_first(const std::vector<Block>& blocks, const int32_t* lens,
                                          int64_t num_kv_heads) {
  std::vector<int64_t> work(blocks.size());  // keys a block's rows read in all
  for (size_t i = 0; i < blocks.size(); ++i)
    for (int64_t b = blocks[i].first; b < blocks[i].last; ++b) work[i] += lens[b];
  std::vector<int64_t> order(static_cast<int64_t>(blocks.size()) * num_kv_heads);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return work[a / num_kv_heads] > work[b / num_kv_heads];
  });
  return order;
}

// The longest int8 head whose float sums of products stay exact integers (|sum| <= D x 127 x
// 127 <= 2^24): every head size in use is far below it.
constexpr int64_t kExactInt8Dim = (int64_t{1} << 24) / (127 * 127);  // 1,040

// Whether a batch's runs are attended by blocks: it has one, and the cache's rows are scored
// the same way in a block as alone (an int8 cache's where its scores are integers, within the
// exact float range).
template <typename T>
inline bool attends_by_blocks(const std::vector<Block>& blocks, int64_t dim) {
  return has_runs(blocks) &&
         (!std::is_same_v<T, int8_t> || (scores_in_int8<T>(dim) && dim <= kExactInt8Dim));
}

// The whole batch by blocks, (block, KV head) items handed out largest first.
template <typename T>
void attend_blocks(const Problem<T>& pb, const std::vector<Block>& blocks, float* out) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t items = static_cast<int64_t>(blocks.size()) * pb.num_kv_heads;
  const std::vector<int64_t> order = largest_first(blocks, pb.context_lens, pb.num_kv_heads);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    BlockScratch<T> sc(group, dim);
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t item = order[i];
      attend_block(pb, blocks[item / pb.num_kv_heads], item % pb.num_kv_heads, sc, out);
    }
  });
}

}  // namespace run_attend
