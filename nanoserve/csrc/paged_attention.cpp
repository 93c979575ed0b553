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
// One work item is (row group, KV head, partition of the context). A row group is one query row
// or several consecutive ones that read the same blocks (a request's speculative verify window,
// a prompt chunk: each query one token further into the same context). It loads each key and
// value row once and uses it, while it sits in L1, for the G = H / Hkv query heads of every row
// in the group that share it: each row's own arithmetic (its tiles, its online softmax, its
// sums, in the same order) is exactly what it would be alone, so grouping changes no bit, and
// a group of R rows reads the context once instead of R times. Measured (2 cores, 30 layers'
// float16 caches, interleaved with the per-row version): prompt chunks of 256 and 1,024 tokens
// 14-20% faster (75-97 -> 61-77 ms, 1,208-1,234 -> 1,057-1,060 ms); a verify window of 4-8 rows
// 0-10% (compute, not loads, is most of a row's cost there). The context is walked in
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

#include "attention_tiles.h"
#include "kv_int8.h"

namespace {

using namespace attention_tiles;

// Contexts longer than this are split into partitions attended in parallel (see the top).
constexpr int64_t kPartitionTokens = 512;  // a multiple of kTileTokens
// Rows per group at most: a prompt chunk still spreads over the threads, and the group's scaled
// queries stay small (16 x 9 heads x 64 floats).
constexpr int64_t kMaxGroupRows = 16;

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
  std::vector<float> q, scores, corr;  // q: [kMaxGroupRows, G, D], each row's scaled heads
  std::vector<int8_t> q8;  // q's heads as int8 rows, for an int8 cache's integer scores
  std::vector<const T*> keys, values;  // two tiles' worth: this one and the next
  explicit Scratch(int64_t group, int64_t dim)
      : q(kMaxGroupRows * group * dim), scores(group * kTileTokens), corr(group),
        q8(kMaxGroupRows * group * row_elements<int8_t>(dim)), keys(2 * kTileTokens),
        values(2 * kTileTokens) {}
};

// Consecutive rows [first, first + count) attended together (see the top).
struct RowGroup {
  int64_t first, count;
};

// Rows join the group before them while their context is no shorter than the previous row's
// and their block table agrees with it over every block the previous row reads (so the group
// can walk the last row's table): a verify window's or a prompt chunk's rows, never two
// requests' unless they read the very same blocks.
template <typename T>
std::vector<RowGroup> group_rows(const Problem<T>& pb, int64_t batch) {
  std::vector<RowGroup> groups;
  const int64_t bs = pb.block_size;
  for (int64_t b = 0; b < batch; ++b) {
    if (!groups.empty()) {
      RowGroup& last = groups.back();
      const int64_t prev = b - 1;
      const int64_t used = (static_cast<int64_t>(pb.context_lens[prev]) + bs - 1) / bs;
      if (last.count < kMaxGroupRows && pb.context_lens[b] >= pb.context_lens[prev] &&
          std::equal(pb.block_table + prev * pb.max_blocks,
                     pb.block_table + prev * pb.max_blocks + used,
                     pb.block_table + b * pb.max_blocks)) {
        ++last.count;
        continue;
      }
    }
    groups.push_back({b, 1});
  }
  return groups;
}

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

// Attention of one row group and KV head over tokens [begin, end): for each row r of the
// group, over [begin, min(end, its context)), unnormalized acc [G, D], the running max and sum
// [G], at acc + r * acc_stride, max + r * stat_stride, sum + r * stat_stride.
template <typename T>
void attend_group(const Problem<T>& pb, const RowGroup& rg, int64_t kv_head, int64_t begin,
                  int64_t end, Scratch<T>& sc, float* acc, int64_t acc_stride, float* max,
                  float* sum, int64_t stat_stride) {
  const int64_t group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t q8_row = row_elements<int8_t>(dim);
  int64_t row_end[kMaxGroupRows];
  int64_t group_end = begin;
  for (int64_t r = 0; r < rg.count; ++r) {
    const int64_t b = rg.first + r;
    row_end[r] = std::max(begin, std::min<int64_t>(end, pb.context_lens[b]));
    group_end = std::max(group_end, row_end[r]);
    const float* q = pb.q + (b * pb.num_heads + kv_head * group) * dim;
    float* qs = sc.q.data() + r * group * dim;
    for (int64_t i = 0; i < group * dim; ++i) qs[i] = q[i] * pb.scale;
    if (scores_in_int8<T>(dim))
      for (int64_t g = 0; g < group; ++g)
        kv_int8::quantize_row(qs + g * dim, sc.q8.data() + (r * group + g) * q8_row, dim);
    std::fill(acc + r * acc_stride, acc + r * acc_stride + group * dim, 0.0f);
    std::fill(max + r * stat_stride, max + r * stat_stride + group, kNegInf);
    std::fill(sum + r * stat_stride, sum + r * stat_stride + group, 0.0f);
  }
  // the last row reads the most blocks; every row's blocks are a prefix of them (group_rows)
  const int32_t* table = pb.block_table + (rg.first + rg.count - 1) * pb.max_blocks;
  const int64_t plane = kv_head * pb.num_blocks * pb.block_size;  // this head's first row
  const T** keys = sc.keys.data();  // [this tile | next tile]
  const T** values = sc.values.data();
  locate_rows(pb, table, plane, begin, std::min(kTileTokens, group_end - begin), keys, values);
  for (int64_t t0 = begin; t0 < group_end; t0 += kTileTokens) {
    const int64_t tile = std::min(kTileTokens, group_end - t0);
    // the next tile's rows load while this one computes
    const int64_t num_next = std::clamp<int64_t>(group_end - t0 - tile, 0, kTileTokens);
    locate_rows(pb, table, plane, t0 + tile, num_next, keys + kTileTokens, values + kTileTokens);
    NextRows<T> next{keys + kTileTokens, values + kTileTokens, num_next};
    for (int64_t r = 0; r < rg.count; ++r) {
      if (row_end[r] <= t0) continue;
      const int64_t n = std::min(kTileTokens, row_end[r] - t0);  // as the row alone tiles it
      const float* qs = sc.q.data() + r * group * dim;
      float *row_max = max + r * stat_stride, *row_sum = sum + r * stat_stride;
      if constexpr (std::is_same_v<T, int8_t>) {
        if (scores_in_int8<T>(dim))
          score_heads_int8(sc.q8.data() + r * group * q8_row, keys, n, dim, group, next,
                           sc.scores.data());
        else
          score_heads<T>(qs, keys, n, dim, group, next, sc.scores.data());
      } else {
        score_heads<T>(qs, keys, n, dim, group, next, sc.scores.data());
      }
      next.count = 0;  // requested once, by the first row
      softmax_tile(sc.scores.data(), n, group, row_max, row_sum, sc.corr.data());
      if constexpr (std::is_same_v<T, int8_t>) {  // each value row's scale, once per weight
        for (int64_t j = 0; j < n; ++j) {
          const float scale = row_scale(values[j], dim);
          for (int64_t g = 0; g < group; ++g) sc.scores[g * kTileTokens + j] *= scale;
        }
      }
      accumulate_heads<T>(sc.scores.data(), values, n, dim, group, sc.corr.data(),
                          acc + r * acc_stride);
    }
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
  const int64_t items = batch * pb.num_kv_heads;  // (row, KV head): the results' layout
  if (items == 0) return;
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max<int64_t>(max_len, pb.context_lens[b]);
  const std::vector<RowGroup> groups = group_rows(pb, batch);
  const int64_t units = static_cast<int64_t>(groups.size()) * pb.num_kv_heads;

  // Fixed-length partitions (an item's empty ones, past its context, are skipped in the merge;
  // one non-empty partition merges to exactly the unsplit result).
  const int64_t part_len = kPartitionTokens;
  const int64_t parts = std::max<int64_t>(1, (max_len + part_len - 1) / part_len);

  if (parts == 1) {  // each row writes its G output rows directly
    at::parallel_for(0, units, 1, [&](int64_t first, int64_t last) {
      Scratch<T> sc(group, dim);
      std::vector<float> max(kMaxGroupRows * group), sum(kMaxGroupRows * group);
      for (int64_t unit = first; unit < last; ++unit) {
        const RowGroup& rg = groups[unit / pb.num_kv_heads];
        const int64_t kv_head = unit % pb.num_kv_heads;
        float* acc = out_ptr + (rg.first * pb.num_heads + kv_head * group) * dim;
        attend_group(pb, rg, kv_head, 0, max_len, sc, acc, pb.num_heads * dim, max.data(),
                     sum.data(), group);
        for (int64_t r = 0; r < rg.count; ++r)
          for (int64_t g = 0; g < group; ++g) {
            const float s = sum[r * group + g];
            const float inv = s > 0.0f ? 1.0f / s : 0.0f;
            float* a = acc + r * pb.num_heads * dim + g * dim;
            for (int64_t d = 0; d < dim; ++d) a[d] *= inv;
          }
      }
    });
    return;
  }

  // Split contexts: partial [items, parts, G, D] results, then a log-sum-exp merge per head.
  std::vector<float> part_acc(items * parts * group * dim);
  std::vector<float> part_max(items * parts * group), part_sum(items * parts * group);
  at::parallel_for(0, units * parts, 1, [&](int64_t first, int64_t last) {
    Scratch<T> sc(group, dim);
    for (int64_t i = first; i < last; ++i) {
      const int64_t unit = i / parts, part = i % parts;
      const RowGroup& rg = groups[unit / pb.num_kv_heads];
      const int64_t kv_head = unit % pb.num_kv_heads;
      const int64_t begin = part * part_len;
      // row b's partial results at item (b, kv_head): rows of a group are num_kv_heads items
      // apart in the [items, parts] layout
      const int64_t at = (rg.first * pb.num_kv_heads + kv_head) * parts + part;
      const int64_t row_stride = pb.num_kv_heads * parts;
      attend_group(pb, rg, kv_head, begin, begin + part_len, sc,
                   part_acc.data() + at * group * dim, row_stride * group * dim,
                   part_max.data() + at * group, part_sum.data() + at * group,
                   row_stride * group);
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
