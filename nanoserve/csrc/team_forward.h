// decode_layers.cpp's forward for a few tokens, in one parallel region.
//
// Each thread holds its own copy of what every thread needs whole and is cheap to make: the
// normed rows, their int8 quantization, the gate's output, and (all but thread 0, which updates
// the caller's tensor) the residual stream. It computes those itself, the same rows in the
// same order, so nothing waits on them. What is split is what costs: each matmul's output
// groups (thread t takes groups [G t / n, G (t + 1) / n)), RoPE's tokens and the cache write,
// and attention's work (query heads where a group can be divided exactly, else items); a
// barrier follows each, since the next step reads all of it.
// Per layer:
//
//   x = add_rms_norm(residual, down)          every thread, its own x (rms_norm at layer 0)
//   qkv = x @ W_qkv                           split by output groups (of each part) | barrier
//   q, cache = rope_store(qkv) (q *= q_scale) split by tokens (parts joined first) | barrier
//   attn = attention(q, cache)                split by heads or items (+ merge),  | barrier
//                                             or by blocks where a run of rows shares its keys
//   o = attn @ W_o                            split                               | barrier
//   x = add_rms_norm(residual, o); gu = x @ W_gate_up                 split       | barrier
//   h = silu_mul(gu); down = h @ W_down                               split       | barrier
//
// Every dense family's layer is this one with a few switches (nanoserve/model/
// layer_features.py): Gemma 3's sandwich norms take o and down through a norm of their own
// (each thread, its own copy) before the residual add, its gate is GELU-tanh, its q is scaled
// before attention; a layer may attend a sliding window, read the step's local RoPE table, and
// find its cache rows through its KV layer group's block table and cache index.
//
// Below the schedule's wide_min_rows rows (never below 16) packed_matmul takes the narrow form
// with prefetching, and so does this: the same tile kernels as the dispatcher path's for every
// output.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fused_rows.h"
#include "gguf_blocks.h"
#include "matmul_tiles.h"
#include "paged_attend.h"
#include "run_attend.h"
#include "schedule.h"
#include "spin_barrier.h"

namespace team_forward {

// (packed weight, ggml type, N, K, wide form or None): what packed_matmul takes after x
using PackedMatmul = std::tuple<at::Tensor, int64_t, int64_t, int64_t, std::optional<at::Tensor>>;

struct Layer {
  at::Tensor input_norm, post_norm;
  // qkv's row parts side by side: one, or a GGUF file's q, k, v runs of different types
  std::vector<PackedMatmul> qkv;
  PackedMatmul o, gate_up, down;
  std::optional<at::Tensor> qkv_bias, q_norm, k_norm;
  at::Tensor k_cache, v_cache;
  // Gemma 3's sandwich: the attention's and the MLP's outputs normed before the residual add
  std::optional<at::Tensor> attn_output_norm, mlp_output_norm;
  int64_t window = 0;  // the keys it attends (0: the whole context)
  bool uses_local_rope = false;  // the step's local cos/sin tables, not its global ones
  int64_t kv_group = 0;  // the step's block table and cache index it reads (0 past the last)
};

// What every layer of a model shares.
struct Shape {
  int64_t num_heads, head_dim;
  double eps;
  bool is_gelu_tanh;  // the gate: gelu_tanh(gate) * up, else silu(gate) * up
  double q_scale;  // q is multiplied by this before attention where it is not 1
};

// Up to this many tokens a forward is one region: below the matmul's wide-form threshold, which
// no schedule puts below 16, so every matmul is the narrow, prefetching kernel on both paths.
constexpr int64_t kTeamMaxTokens = schedule::kMinWideRows - 1;

// The step's tensors (the attention backend's metadata; per KV layer group, its cache index
// and block table) and the model's shape.
struct Step {
  const at::Tensor &cos_table, &sin_table, &local_cos, &local_sin, &positions;
  const std::vector<at::Tensor>&cache_index, &block_table;  // per KV layer group
  const at::Tensor& context_lens;
  int64_t num_heads, head_dim;
  double eps, scale, q_scale;
  bool is_gelu_tanh;

  // A layer's KV group in this step: a step given one group's metadata uses it for every layer.
  size_t group(const Layer& layer) const {
    return static_cast<size_t>(layer.kv_group) < cache_index.size()
               ? static_cast<size_t>(layer.kv_group) : 0;
  }
  const at::Tensor& cos(const Layer& layer) const {
    return layer.uses_local_rope ? local_cos : cos_table;
  }
  const at::Tensor& sin(const Layer& layer) const {
    return layer.uses_local_rope ? local_sin : sin_table;
  }
};

// One thread's int8 activations: quantize_row's q [M, K], d and s [M, K / 32].
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Acts(int64_t rows, int64_t max_k) : q(rows * max_k), d(rows * max_k / 32), s(rows * max_k / 32) {}

  void quantize(const float* x, int64_t rows, int64_t K) {
    for (int64_t r = 0; r < rows; ++r)
      matmul_tiles::quantize_row(x + r * K, K, q.data() + r * K, d.data() + r * (K / 32),
                                 s.data() + r * (K / 32));
  }
};

template <gguf_blocks::Layout L>
void matmul_range(const PackedMatmul& w, const Acts& a, int64_t M, float* y, int64_t g0,
                  int64_t g1) {
  matmul_tiles::matmul_groups<L, false, true>(std::get<0>(w).data_ptr<uint8_t>(), a.q.data(),
                                               a.d.data(), a.s.data(), M, std::get<2>(w),
                                               std::get<3>(w), y, g0, g1);
}

// This thread's share of y [M, N] = x @ W^T (x quantized in `a`).
inline void matmul_share(const PackedMatmul& w, const Acts& a, int64_t M, float* y, int tid,
                         int team) {
  using gguf_blocks::Layout;
  const int64_t G = (std::get<2>(w) + gguf_blocks::TILE_N - 1) / gguf_blocks::TILE_N;
  const int64_t g0 = G * tid / team, g1 = G * (tid + 1) / team;
  switch (gguf_blocks::type_info(std::get<1>(w)).layout) {
    case Layout::U4H: matmul_range<Layout::U4H>(w, a, M, y, g0, g1); break;
    case Layout::U4F: matmul_range<Layout::U4F>(w, a, M, y, g0, g1); break;
    case Layout::U5H: matmul_range<Layout::U5H>(w, a, M, y, g0, g1); break;
    case Layout::U5F: matmul_range<Layout::U5F>(w, a, M, y, g0, g1); break;
    case Layout::S8H: matmul_range<Layout::S8H>(w, a, M, y, g0, g1); break;
    case Layout::S8F2: matmul_range<Layout::S8F2>(w, a, M, y, g0, g1); break;
    case Layout::L4F: matmul_range<Layout::L4F>(w, a, M, y, g0, g1); break;
  }
}

// rows of x [M, n] -> out: hidden += delta first where delta is given (add_rms_norm), as the
// fused ops do it row by row.
inline void norm_rows(float* hidden, const float* delta, const at::Tensor& weight, double eps,
                      int64_t M, int64_t n, float* out) {
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    if (delta != nullptr) fused_rows::add_row(hidden + r * n, delta + r * n, n);
    fused_rows::norm_row(hidden + r * n, w, static_cast<float>(eps), n, out + r * n);
  }
}

inline int64_t share_begin(int64_t count, int tid, int team) { return count * tid / team; }

// A layer output's rows as they join the residual stream: normed into `normed` where the layer
// has a norm there (Gemma's sandwich, rms_norm row by row as the fused op does), else as is.
inline const float* output_rows(const float* out, const std::optional<at::Tensor>& norm,
                                double eps, int64_t M, int64_t n, std::vector<float>& normed) {
  if (!norm) return out;
  const float* w = norm->data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    fused_rows::norm_row(out + r * n, w, static_cast<float>(eps), n, normed.data() + r * n);
  return normed.data();
}

// Rows [t0, t1) of y [M, N] from its parts' outputs, each [M, N_part] in turn in `parts`
// (torch.cat of the parts' products, as the Python loop's ConcatWeight makes it).
inline void join_parts(const std::vector<PackedMatmul>& w, const float* parts, int64_t M,
                       int64_t N, int64_t t0, int64_t t1, float* y) {
  int64_t column = 0;  // the part's first column in y
  for (const PackedMatmul& part : w) {
    const int64_t n_part = std::get<2>(part);
    for (int64_t t = t0; t < t1; ++t)
      std::memcpy(y + t * N + column, parts + M * column + t * n_part, n_part * sizeof(float));
    column += n_part;
  }
}

// q [M, H, D] *= q_scale for tokens [first, last), as `q * q_scale` rounds (float32 products).
inline void scale_queries(float* q, double q_scale, int64_t first, int64_t last,
                          int64_t row) {
  const float s = static_cast<float>(q_scale);
  for (int64_t i = first * row; i < last * row; ++i) q[i] *= s;
}

// Every input a kernel would check before it reads or writes through an index.
inline void check_step(const std::vector<Layer>& layers, const at::Tensor& hidden,
                       const Step& st, const at::Tensor& q, const at::Tensor& attn) {
  const Layer& first = layers.front();
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layers: hidden must be a contiguous float32 [tokens, hidden] tensor");
  const int64_t tokens = hidden.size(0);
  for (const at::Tensor* t : {&st.cos_table, &st.sin_table, &st.local_cos, &st.local_sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                    t->size(1) == st.head_dim && t->sizes() == st.cos_table.sizes(),
                "decode_layers: the cos and sin tables must be float32 [positions, ",
                st.head_dim, "], all of one shape");
  TORCH_CHECK(!st.cache_index.empty() && st.cache_index.size() == st.block_table.size(),
              "decode_layers: one cache index and one block table per KV layer group");
  const int64_t plane = first.k_cache.size(1) * first.k_cache.size(2);
  for (const at::Tensor* t : {&st.positions, &st.cache_index.front()})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->numel() == tokens &&
                    t->is_contiguous(),
                "decode_layers: positions and cache_index must be contiguous int64 [", tokens, "]");
  const int64_t* pos = st.positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < st.cos_table.size(0), "positions[", t, "] = ", pos[t],
                " is outside the RoPE table's ", st.cos_table.size(0), " positions");
  for (size_t g = 0; g < st.cache_index.size(); ++g) {
    const at::Tensor& index = st.cache_index[g];
    TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 &&
                    index.numel() == tokens && index.is_contiguous(),
                "decode_layers: each group's cache_index must be contiguous int64 [", tokens, "]");
    const int64_t* slots = index.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < plane, "cache_index[", t, "] = ", slots[t],
                  " (KV group ", g, ") is outside the cache's ", plane, " rows");
    paged_attend::check_inputs(q, first.k_cache, first.v_cache, st.block_table[g],
                               st.context_lens, attn);
  }
  for (const Layer& layer : layers) {
    TORCH_CHECK(layer.k_cache.sizes() == first.k_cache.sizes() &&
                    layer.k_cache.scalar_type() == first.k_cache.scalar_type(),
                "decode_layers: every layer's cache must have the first layer's shape and dtype");
    const int64_t qkv_heads = st.num_heads + 2 * first.k_cache.size(0);
    int64_t n_qkv = 0;
    for (const PackedMatmul& part : layer.qkv) {
      TORCH_CHECK(std::get<3>(part) == hidden.size(1), "decode_layers: a qkv part's K is not ",
                  hidden.size(1));
      n_qkv += std::get<2>(part);
    }
    TORCH_CHECK(n_qkv == qkv_heads * st.head_dim &&
                    std::get<2>(layer.o) == hidden.size(1) &&
                    std::get<2>(layer.down) == hidden.size(1),
                "decode_layers: a layer's matmuls do not match hidden's ", hidden.size(1),
                " features");
    TORCH_CHECK(layer.window >= 0, "decode_layers: a layer's window must be 0 or positive");
  }
}

// A KV layer group's runs of rows (run_attend.h): where its rows share their keys, attention
// takes them in blocks, (block, KV head) items largest first. Per group, as the dispatcher
// path's attention finds them in that group's block table.
struct GroupRuns {
  std::vector<run_attend::Block> blocks;
  bool by_blocks;
  std::vector<int64_t> order;
};

// A float16 cache row is c10::Half to the RoPE store and its 16 bits to attention.
template <typename T>
using StoreType = std::conditional_t<std::is_same_v<T, uint16_t>, c10::Half, T>;

template <typename T>
at::Tensor forward_cache(const std::vector<Layer>& layers, const at::Tensor& final_norm,
                         at::Tensor& hidden, const Step& st) {
  const Layer& first = layers.front();
  const int64_t M = hidden.size(0), n = hidden.size(1);
  const int64_t H = st.num_heads, D = st.head_dim, Hkv = first.k_cache.size(0);
  const int64_t n_qkv = (H + 2 * Hkv) * D, n_gu = std::get<2>(first.gate_up);
  const int64_t inter = n_gu / 2, max_k = std::max({n, H * D, inter});
  at::Tensor q = at::empty({M, H, D}, at::kFloat), attn = at::empty({M, H, D}, at::kFloat);
  check_step(layers, hidden, st, q, attn);
  at::Tensor out = at::empty_like(hidden);
  std::vector<float> qkv(M * n_qkv), o(M * n), gu(M * n_gu), down(M * n);
  std::vector<float> qkv_parts(M * n_qkv);  // a split qkv's parts, each [M, N_part], in turn
  const int32_t* lens = st.context_lens.data_ptr<int32_t>();
  const int64_t parts = paged_attend::num_parts(lens, M), items = M * Hkv, group = H / Hkv;
  std::vector<float> part_acc(parts > 1 ? items * parts * group * D : 0);
  std::vector<float> part_max(parts > 1 ? items * parts * group : 0), part_sum(part_max.size());
  // a run of one request's prompt rows (or a verify's) shares its keys: run_attend.h's blocks,
  // (block, KV head) items taken largest first from each layer's counter
  std::vector<GroupRuns> runs;
  for (const at::Tensor& table : st.block_table) {
    auto blocks = run_attend::row_blocks(table.data_ptr<int32_t>(), lens, M, table.size(1),
                                         first.k_cache.size(2));
    const bool by_blocks = run_attend::attends_by_blocks<T>(blocks, D);
    auto order = by_blocks ? run_attend::largest_first(blocks, lens, Hkv) : std::vector<int64_t>();
    runs.push_back({std::move(blocks), by_blocks, std::move(order)});
  }
  std::unique_ptr<std::atomic<int64_t>[]> next_block(new std::atomic<int64_t>[layers.size()]());
  const int64_t plane = first.k_cache.size(1) * first.k_cache.size(2);
  float* residual0 = hidden.data_ptr<float>();
  const int num_threads = at::get_num_threads();
  SpinBarrier* barrier = nullptr;
  std::vector<float> residual_copies;

#pragma omp parallel num_threads(num_threads)
  {
    // the team may be smaller than asked (a nested call, OMP_DYNAMIC): shares follow its size
    const int team = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp single
    {
      barrier = new SpinBarrier(team, std::chrono::microseconds(schedule::current().spin_us));
      residual_copies.resize((team - 1) * M * n);
      for (int t = 1; t < team; ++t)
        std::memcpy(residual_copies.data() + (t - 1) * M * n, residual0, M * n * sizeof(float));
    }  // (the single's own barrier: the copies exist before anyone updates the residual)
    float* residual = tid == 0 ? residual0 : residual_copies.data() + (tid - 1) * M * n;
    std::vector<float> x(M * max_k), normed(first.attn_output_norm ? M * n : 0);
    Acts acts(M, max_k);
    paged_attend::Scratch<T> scratch(group, D);
    std::optional<run_attend::BlockScratch<T>> block_scratch;
    const bool any_blocks = std::any_of(runs.begin(), runs.end(),
                                        [](const GroupRuns& r) { return r.by_blocks; });
    if (any_blocks) block_scratch.emplace(group, D);
    std::vector<float> max(group), sum(group);
    const float* delta = nullptr;  // the previous layer's output, as it joins the residual
    int64_t layer_index = 0;
    for (const Layer& layer : layers) {
      std::atomic<int64_t>& next_item = next_block[layer_index++];
      const size_t g = st.group(layer);
      norm_rows(residual, delta, layer.input_norm, st.eps, M, n, x.data());
      acts.quantize(x.data(), M, n);
      const bool is_split = layer.qkv.size() > 1;
      int64_t column = 0;  // a part's first output column
      for (const PackedMatmul& part : layer.qkv) {
        matmul_share(part, acts, M, is_split ? qkv_parts.data() + M * column : qkv.data(), tid,
                     team);
        column += std::get<2>(part);
      }
      barrier->wait();

      const fused_rows::RopeProblem rope{
          qkv.data(), layer.qkv_bias ? layer.qkv_bias->data_ptr<float>() : nullptr,
          layer.q_norm ? layer.q_norm->data_ptr<float>() : nullptr,
          layer.k_norm ? layer.k_norm->data_ptr<float>() : nullptr, static_cast<float>(st.eps),
          st.cos(layer).data_ptr<float>(), st.sin(layer).data_ptr<float>(),
          st.positions.data_ptr<int64_t>(), st.cache_index[g].data_ptr<int64_t>(), H, Hkv, D,
          plane, q.data_ptr<float>()};
      const int64_t t0 = share_begin(M, tid, team), t1 = share_begin(M, tid + 1, team);
      if (is_split) join_parts(layer.qkv, qkv_parts.data(), M, n_qkv, t0, t1, qkv.data());
      fused_rows::rope_store_rows(rope, static_cast<StoreType<T>*>(layer.k_cache.data_ptr()),
                                  static_cast<StoreType<T>*>(layer.v_cache.data_ptr()), t0, t1);
      if (st.q_scale != 1.0) scale_queries(q.data_ptr<float>(), st.q_scale, t0, t1, H * D);
      barrier->wait();

      const at::Tensor& table = st.block_table[g];
      const paged_attend::Problem<T> pb{
          q.data_ptr<float>(), static_cast<const T*>(layer.k_cache.data_ptr()),
          static_cast<const T*>(layer.v_cache.data_ptr()), table.data_ptr<int32_t>(), lens,
          H, Hkv, D, first.k_cache.size(1), first.k_cache.size(2), table.size(1),
          static_cast<float>(st.scale), layer.window};
      float* attn_out = attn.data_ptr<float>();
      const GroupRuns& run = runs[g];
      if (run.by_blocks) {
        const int64_t block_items = static_cast<int64_t>(run.order.size());
        for (int64_t i = next_item++; i < block_items; i = next_item++)
          run_attend::attend_block(pb, run.blocks[run.order[i] / Hkv], run.order[i] % Hkv,
                                   *block_scratch, attn_out);
      } else if (parts == 1 && paged_attend::heads_split_exactly<T>(group)) {
        paged_attend::attend_heads(pb, share_begin(items * group, tid, team),
                                   share_begin(items * group, tid + 1, team), scratch,
                                   max.data(), sum.data(), attn_out);
      } else if (parts == 1) {
        paged_attend::attend_items(pb, share_begin(items, tid, team),
                                   share_begin(items, tid + 1, team), scratch, max.data(),
                                   sum.data(), attn_out);
      } else {
        paged_attend::attend_parts(pb, parts, share_begin(items * parts, tid, team),
                                   share_begin(items * parts, tid + 1, team), scratch,
                                   part_acc.data(), part_max.data(), part_sum.data());
        barrier->wait();
        paged_attend::merge_parts(parts, group, D, part_acc.data(), part_max.data(),
                                  part_sum.data(), share_begin(items * group, tid, team),
                                  share_begin(items * group, tid + 1, team), attn_out);
      }
      barrier->wait();

      acts.quantize(attn_out, M, H * D);
      matmul_share(layer.o, acts, M, o.data(), tid, team);
      barrier->wait();

      norm_rows(residual, output_rows(o.data(), layer.attn_output_norm, st.eps, M, n, normed),
                layer.post_norm, st.eps, M, n, x.data());
      acts.quantize(x.data(), M, n);
      matmul_share(layer.gate_up, acts, M, gu.data(), tid, team);
      barrier->wait();

      for (int64_t r = 0; r < M; ++r) {
        if (st.is_gelu_tanh)
          fused_rows::gelu_tanh_mul_row(gu.data() + r * n_gu, inter, x.data() + r * inter);
        else
          fused_rows::silu_mul_row(gu.data() + r * n_gu, inter, x.data() + r * inter);
      }
      acts.quantize(x.data(), M, inter);
      matmul_share(layer.down, acts, M, down.data(), tid, team);
      barrier->wait();
      delta = output_rows(down.data(), layer.mlp_output_norm, st.eps, M, n, normed);
    }
    if (tid == 0) norm_rows(residual, delta, final_norm, st.eps, M, n, out.data_ptr<float>());
  }
  delete barrier;
  return out;
}

// hidden [T, n] (the embeddings, updated in place) -> the final norm's output, as
// LayerStack::forward's dispatcher path computes it.
inline at::Tensor forward(const std::vector<Layer>& layers, const at::Tensor& final_norm,
                         at::Tensor& hidden, const Step& st) {
  const auto type = layers.front().k_cache.scalar_type();
  if (type == at::kHalf) return forward_cache<uint16_t>(layers, final_norm, hidden, st);
  if (type == at::kChar) return forward_cache<int8_t>(layers, final_norm, hidden, st);
  TORCH_CHECK(type == at::kFloat, "decode_layers: the KV cache must be float32, float16 or int8");
  return forward_cache<float>(layers, final_norm, hidden, st);
}

}  // namespace team_forward
