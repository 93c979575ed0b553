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
// tiles of kTileTokens: scores for the tile (a float cache's as a small matrix product,
// flash_tiles.h; an int8 cache's in integers), one max/exp/sum per tile (online softmax: the
// running sums are rescaled once per tile, not per token), then P·V.
// Contexts longer than kPartitionTokens are split into partitions of that many tokens, attended
// in parallel and merged by log-sum-exp. The split depends only on a context's own length, never
// on the batch or the thread count, so a request's result is the same alone or batched (and a
// prompt token's, whatever chunk it was prefilled in: prefill queries come here too). A prefill
// chunk's rows, which share their keys, are attended in blocks of rows (run_attend.h), each row
// to the same bits (on an int8 cache too, where its scores are integers).
// Attention sinks (gpt-oss; optional, `sinks` [H] float32 logits): each joins its query head's
// softmax denominator once, with no value, where the row is normalized: at the end of an
// unsplit walk or in the log-sum-exp merge (paged_attend.h's normalizer), never per partition,
// so the contracts above hold with them; without them the bits are those of a kernel without.
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
#include "paged_attend.h"
#include "run_attend.h"

namespace {

using namespace paged_attend;

// The whole batch for one cache element type T (float or Half); writes out [B, H, D].
template <typename T>
void attend_batch(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_table,
                  const torch::Tensor& context_lens, double scale, int64_t window,
                  torch::Tensor& out, const int32_t* window_ends, const float* sinks) {
  const Problem<T> pb{q.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()),
                      static_cast<const T*>(v_cache.data_ptr()), block_table.data_ptr<int32_t>(),
                      context_lens.data_ptr<int32_t>(), q.size(1), k_cache.size(0), q.size(2),
                      k_cache.size(1), k_cache.size(2), block_table.size(1),
                      static_cast<float>(scale), window, window_ends, sinks};
  float* out_ptr = out.data_ptr<float>();
  const int64_t batch = q.size(0), group = pb.num_heads / pb.num_kv_heads, dim = pb.dim;
  const int64_t items = batch * pb.num_kv_heads;
  if (items == 0) return;
  // a prefill chunk's rows share their keys (an int8 cache's where its scores are integers)
  const auto blocks = run_attend::row_blocks(pb.block_table, pb.context_lens, batch,
                                             pb.max_blocks, pb.block_size);
  if (run_attend::attends_by_blocks<T>(blocks, dim))
    return run_attend::attend_blocks(pb, blocks, out_ptr);
  // Fixed-length partitions (an item's empty ones, past its context, are skipped in the merge;
  // one non-empty partition merges to exactly the unsplit result).
  const int64_t parts = num_parts(pb.context_lens, batch);
  if (parts == 1) {  // each item writes its G output rows directly
    at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
      Scratch<T> sc(group, dim);
      std::vector<float> max(group), sum(group);
      attend_items(pb, first, last, sc, max.data(), sum.data(), out_ptr);
    });
    return;
  }
  // Split contexts: partial [items, parts, G, D] results, then a log-sum-exp merge per head.
  std::vector<float> part_acc(items * parts * group * dim);
  std::vector<float> part_max(items * parts * group), part_sum(items * parts * group);
  at::parallel_for(0, items * parts, 1, [&](int64_t first, int64_t last) {
    Scratch<T> sc(group, dim);
    attend_parts(pb, parts, first, last, sc, part_acc.data(), part_max.data(), part_sum.data());
  });
  at::parallel_for(0, items * group, 1, [&](int64_t first, int64_t last) {
    merge_parts(parts, group, dim, part_acc.data(), part_max.data(), part_sum.data(), first,
                last, out_ptr, pb.sinks, pb.num_heads);
  });
}

}  // namespace

// out [B, H, D] = softmax(q · K^T * scale) · V per request, over its context_lens[b] cached
// tokens (the last `window` of them where window > 0: a sliding-window layer, the window
// ending at window_ends[b] where given, else at the context's end), for a float32, float16
// or int8 cache; with `sinks` [H], head h's softmax denominator also holds exp(sinks[h]).
// Writes `out` and returns it.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor context_lens,
                               double scale, torch::Tensor out, int64_t window,
                               std::optional<torch::Tensor> window_ends = std::nullopt,
                               std::optional<torch::Tensor> sinks = std::nullopt) {
  check_inputs(q, k_cache, v_cache, block_table, context_lens, out, window);
  const int32_t* ends = nullptr;
  if (window_ends.has_value()) {
    TORCH_CHECK(window_ends->scalar_type() == torch::kInt32 && window_ends->is_contiguous() &&
                    window_ends->numel() == q.size(0),
                "window_ends must be contiguous int32 [B]");
    ends = window_ends->data_ptr<int32_t>();
  }
  const float* sink_logits = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == torch::kFloat32 &&
                    sinks->is_contiguous() && sinks->numel() == q.size(1),
                "sinks must be contiguous CPU float32 [H] (one logit per query head), got ",
                sinks->scalar_type(), " of ", sinks->numel(), " elements for ", q.size(1),
                " heads");
    sink_logits = sinks->data_ptr<float>();
  }
  if (k_cache.scalar_type() == torch::kFloat16)
    attend_batch<Half>(q, k_cache, v_cache, block_table, context_lens, scale, window, out, ends,
                       sink_logits);
  else if (k_cache.scalar_type() == torch::kChar)
    attend_batch<int8_t>(q, k_cache, v_cache, block_table, context_lens, scale, window, out,
                         ends, sink_logits);
  else
    attend_batch<float>(q, k_cache, v_cache, block_table, context_lens, scale, window, out,
                        ends, sink_logits);
  return out;
}

// The same call as a dispatcher op, for native code that chains the kernels (decode_layers.cpp)
// and for torch.compile (bench/compiled.py). It returns nothing: functionalization, which
// torch.compile runs, rejects a custom op whose output aliases an input (`out`). It takes no
// sinks: no model the native layer stacks run has them.
TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, float scale, Tensor(a!) out, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("decode_attention", [](torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, torch::Tensor context_lens,
                                double scale, torch::Tensor out, int64_t window) {
    decode_attention(q, k_cache, v_cache, block_table, context_lens, scale, out, window);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("context_lens"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0, py::arg("window_ends") = py::none(),
        py::arg("sinks") = py::none(),
        "Decode attention over a paged float32, float16 or int8 KV cache, read in place, "
        "with optional per-head attention sinks (CPU, AVX2)");
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule, flat (schedule.h)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat)");
}
