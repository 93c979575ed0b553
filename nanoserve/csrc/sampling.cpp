// The sampler's common path on the CPU: greedy argmax, or temperature, min-p, top-k, top-p and
// the seeded Gumbel-max draw, one row per task. What it computes and the PyTorch path it must
// equal: nanoserve/sample/fused.py (truncation.py and noise.py hold the semantics). Reading a
// row: sampling_select.h; the cut and the draw: sampling_rows.h; vector math: sampling_simd.h.
//
// A truncated row: one pass for the maxima of its 64-token chunks (and one adding up
// exp(s - s_max) when top-p alone needs the whole row's mass). The width-th largest chunk
// maximum bounds the width largest logits from below, so only the chunks reaching it are read
// again (topk.py's argument); width is 64, or a power of two above top_k. When the cut might lie
// past those candidates: min-p rows collect exactly their survivors in one pass; top-p rows
// collect the tokens above a floor found from a histogram of the mass; other rows look 8x wider.
// Candidates are sorted only as far as the cut reads them.
// An untruncated row: its max, then a pass where a few integer operations bound each token's
// noise from above; only tokens that could still beat the best score get the two logs.
//
// Measured per row, one thread, the default model's real logits (2-core AVX2 machine, CPU time):
// greedy 8 us; top-k 50 with top-p 25 us; min-p 22 us; top-p alone 50-60 us (its mass pass is
// most of it); untruncated 50 us, where noise for every token within 17 of the max took 226 us.
// top_k=200: 46 us, where keeping the 1,024 largest with a rising threshold took 205 us.
// T=1, top_p=0.95 (a tenth of rows keep over 64 tokens): mean 90 us, 95th percentile 220 us,
// where widening to 1,024 then 8,192 candidates, fully sorted, took 157 and 390 us.
//
// Exact where it can be (division, subtraction and comparisons are PyTorch's float operations),
// and where it cannot (exp and log differ from PyTorch's in the last bit) a row whose answer is
// within a margin of changing comes back undecided (-1): a top-p mass within kMassMargin of
// top_p, two scores within kScoreMargin, NaN or infinite logits. The caller runs the PyTorch
// path on that row, so both paths choose the same token.
//
// Penalties (stages.py's apply_penalties) run here too, one pass per row instead of ~15 over
// [rows, vocab] copies, with the same float operations in the same order (so the same bits):
// each product is rounded on its own before it is subtracted, as PyTorch's separate ops do.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "sampling_rows.h"

namespace {

using namespace sampling;

template <typename T>
const T* data_of(const torch::Tensor& t, torch::ScalarType type, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == type, name,
              " must be a contiguous CPU tensor of ", type);
  return t.data_ptr<T>();
}

// Run fn(i) for i in [0, count), one index at a time to whichever thread is free.
template <typename Fn>
void for_each_row(int64_t count, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < count; i = next++) fn(i);
  });
}

// A product the compiler may not fuse into the following subtraction: GCC contracts a * b - c
// into one FMA by default (-ffp-contract=fast), which rounds once where PyTorch rounds twice.
template <typename T>
inline T rounded(T product) {
  asm("" : "+x"(product));
  return product;
}

struct Penalties {
  float repetition, frequency, presence;
  bool use_repetition, use_frequency, use_presence;  // as stages.py: each kind, if any row asks
};

// One row in place: repetition divides positive logits of seen tokens and multiplies negative
// ones; then x - frequency * count, then x - presence * (count > 0).
void penalize_row(float* x, const int32_t* counts, const bool* prompt, int64_t vocab,
                  const Penalties& p) {
  const __m256 rep = _mm256_set1_ps(p.repetition), freq = _mm256_set1_ps(p.frequency);
  const __m256 pres = _mm256_set1_ps(p.presence), zero = _mm256_setzero_ps();
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(counts + i));
    const __m256 in_output = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_setzero_si256()));
    if (p.use_repetition) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(prompt + i));
      const __m256 in_prompt = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
      const __m256 changed = _mm256_blendv_ps(_mm256_mul_ps(v, rep), _mm256_div_ps(v, rep),
                                              _mm256_cmp_ps(v, zero, _CMP_GT_OQ));
      v = _mm256_blendv_ps(v, changed, _mm256_or_ps(in_output, in_prompt));
    }
    if (p.use_frequency) v = _mm256_sub_ps(v, rounded(_mm256_mul_ps(freq, _mm256_cvtepi32_ps(c))));
    if (p.use_presence)
      v = _mm256_sub_ps(v, rounded(_mm256_mul_ps(pres, _mm256_and_ps(in_output, one))));
    _mm256_storeu_ps(x + i, v);
  }
  for (; i < vocab; ++i) {
    float v = x[i];
    if (p.use_repetition && (counts[i] > 0 || prompt[i]))
      v = v > 0 ? v / p.repetition : v * p.repetition;
    if (p.use_frequency) v -= rounded(p.frequency * static_cast<float>(counts[i]));
    if (p.use_presence) v -= rounded(p.presence * (counts[i] > 0 ? 1.0f : 0.0f));
    x[i] = v;
  }
}

}  // namespace

// stages.py's apply_penalties in place on `rows` of logits [R, V]: slots [R] int64, per slot
// output_counts [S, V] int32, prompt_mask [S, V] bool (read only with use_repetition), and
// repetition, frequency, presence [S] float32.
void apply_penalties(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& slots,
                     const torch::Tensor& output_counts, const torch::Tensor& prompt_mask,
                     const torch::Tensor& repetition, const torch::Tensor& frequency,
                     const torch::Tensor& presence, bool use_repetition, bool use_frequency,
                     bool use_presence) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1 &&
                  logits.scalar_type() == torch::kFloat32,
              "logits must be a float32 CPU [rows, vocab] tensor with unit stride on vocab");
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(output_counts.size(1) == vocab, "output_counts must be [slots, vocab]");
  TORCH_CHECK(!use_repetition || prompt_mask.sizes() == output_counts.sizes(),
              "prompt_mask must be [slots, vocab] with repetition penalties");
  float* x = logits.data_ptr<float>();
  const int64_t* row_of = data_of<int64_t>(rows, torch::kInt64, "rows");
  const int64_t* slot_of = data_of<int64_t>(slots, torch::kInt64, "slots");
  const int32_t* counts = data_of<int32_t>(output_counts, torch::kInt32, "output_counts");
  const bool* prompt = use_repetition ? data_of<bool>(prompt_mask, torch::kBool, "prompt_mask")
                                      : nullptr;
  const float* reps = data_of<float>(repetition, torch::kFloat32, "repetition");
  const float* freqs = data_of<float>(frequency, torch::kFloat32, "frequency");
  const float* press = data_of<float>(presence, torch::kFloat32, "presence");
  for_each_row(rows.numel(), [&](int64_t i) {
    const int64_t r = row_of[i], slot = slot_of[r];
    penalize_row(x + r * logits.stride(0), counts + slot * vocab,
                 prompt == nullptr ? nullptr : prompt + slot * vocab, vocab,
                 {reps[slot], freqs[slot], press[slot], use_repetition, use_frequency, use_presence});
  });
}

// Tokens for `rows` of the batch: argmax for greedy slots, the draw for random ones; -1 where
// the PyTorch path must decide. logits [R, V] float32; rows [n], slots [R], positions [R]
// int64; per slot: is_random (bool), temperature, top_k, top_p, log_min_p, seed.
torch::Tensor sample_rows(const torch::Tensor& logits, const torch::Tensor& rows,
                          const torch::Tensor& slots, const torch::Tensor& positions,
                          const torch::Tensor& is_random, const torch::Tensor& temperature,
                          const torch::Tensor& top_k, const torch::Tensor& top_p,
                          const torch::Tensor& log_min_p, const torch::Tensor& seed) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1 &&
                  logits.scalar_type() == torch::kFloat32,
              "logits must be a float32 CPU [rows, vocab] tensor with unit stride on vocab");
  const int64_t vocab = logits.size(1), row_stride = logits.stride(0), count = rows.numel();
  TORCH_CHECK(vocab < (int64_t{1} << 31), "vocabulary too large for int32 token ids");
  const float* x = logits.data_ptr<float>();
  const int64_t* row_of = data_of<int64_t>(rows, torch::kInt64, "rows");
  const int64_t* slot_of = data_of<int64_t>(slots, torch::kInt64, "slots");
  const int64_t* position_of = data_of<int64_t>(positions, torch::kInt64, "positions");
  const bool* random = data_of<bool>(is_random, torch::kBool, "is_random");
  const float* temperatures = data_of<float>(temperature, torch::kFloat32, "temperature");
  const int64_t* top_ks = data_of<int64_t>(top_k, torch::kInt64, "top_k");
  const float* top_ps = data_of<float>(top_p, torch::kFloat32, "top_p");
  const float* log_min_ps = data_of<float>(log_min_p, torch::kFloat32, "log_min_p");
  const int64_t* seeds = data_of<int64_t>(seed, torch::kInt64, "seed");
  torch::Tensor out = torch::empty({count}, torch::kInt64);
  int64_t* tokens = out.data_ptr<int64_t>();
  for_each_row(count, [&](int64_t i) {
    thread_local Workspace ws;  // its buffers are reused from row to row and step to step
    const int64_t r = row_of[i], slot = slot_of[r];
    const Row row{x + r * row_stride, vocab, temperatures[slot], top_ks[slot], top_ps[slot],
                  log_min_ps[slot], row_key(seeds[slot], position_of[r])};
    if (!random[slot]) {
      const RowMax max = row_max(row.x, vocab);
      tokens[i] = max.has_nan ? kUndecided : max.id;
    } else if (row.top_k > 0 || row.top_p < 1.0f || row.log_min_p > kNegInf) {
      tokens[i] = draw_truncated(row, ws);
    } else {
      tokens[i] = draw_untruncated(row);
    }
  });
  return out;
}

// For tests: the Gumbel noise this file draws for int32 hashes (noise.py's gumbel_from_hashes),
// and its upper bound.
std::vector<torch::Tensor> gumbel_from_hashes(const torch::Tensor& hashes) {
  const int32_t* h = data_of<int32_t>(hashes, torch::kInt32, "hashes");
  const int64_t n = hashes.numel();
  torch::Tensor noise = torch::empty({n}, torch::kFloat32), bound = torch::empty({n}, torch::kFloat32);
  alignas(32) int32_t lanes[8];
  alignas(32) float g[8], b[8];
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    std::fill(lanes, lanes + 8, 0);
    std::copy(h + i, h + i + count, lanes);
    const __m256i v = _mm256_load_si256(reinterpret_cast<__m256i*>(lanes));
    _mm256_store_ps(g, gumbel8(v));
    _mm256_store_ps(b, gumbel_bound8(v));
    std::copy(g, g + count, noise.data_ptr<float>() + i);
    std::copy(b, b + count, bound.data_ptr<float>() + i);
  }
  return {noise.view(hashes.sizes()), bound.view(hashes.sizes())};
}

// For tests: noise.py's row_keys.
torch::Tensor row_keys(const torch::Tensor& seeds, const torch::Tensor& positions) {
  const int64_t* s = data_of<int64_t>(seeds, torch::kInt64, "seeds");
  const int64_t* p = data_of<int64_t>(positions, torch::kInt64, "positions");
  torch::Tensor out = torch::empty({seeds.numel()}, torch::kInt32);
  for (int64_t i = 0; i < seeds.numel(); ++i)
    out.data_ptr<int32_t>()[i] = static_cast<int32_t>(row_key(s[i], p[i]));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_rows", &sample_rows, "greedy argmax or the truncated Gumbel-max draw, per row");
  m.def("apply_penalties", &apply_penalties, "repetition, frequency and presence penalties");
  m.def("gumbel_from_hashes", &gumbel_from_hashes, "Gumbel noise and its bound (tests)");
  m.def("row_keys", &row_keys, "row keys from seeds and positions (tests)");
}
