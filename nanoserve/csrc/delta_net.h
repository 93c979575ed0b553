// Gated DeltaNet's mixer (Qwen3.5's linear attention) for a flat batch of sequences: the causal
// depthwise conv with SiLU, then the gated delta rule token by token over each sequence's
// state in the pools, with snapshots of the state copied out where asked. What it computes,
// the contract and the measured figures: nanoserve/model/delta_net_ops.py. float32 arithmetic
// (the recurrent state stored float32, bfloat16 or float16: --mamba-ssm-cache-dtype); AVX2 + FMA
// + F16C, built only for the avx2 tier (one binary, so one set of bits, on every CPU).
//
// Bits. A token's output and the states after it depend only on its sequence's earlier tokens:
// each token is one step of the recurrence (no chunked form), every sum runs in one fixed
// order (the conv over its taps, kv_mem and o over key_head_dim in index order, vectorised
// across value_head_dim columns, which never reorders a column's sum), and every multiply-add
// is an explicit intrinsic. How work is split over threads or calls changes no bit.
//
// A header so that the hybrid layer stack (hybrid_layers.cpp) runs the same functions, so the
// same bits, as the `delta_rule` op delta_net.cpp registers; included only by avx2 builds.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "schedule.h"
#include "simd_exp.h"
#include "simd_reduce.h"

namespace delta_net {

constexpr int64_t kMaxKernel = 8;      // conv taps the kernel keeps on the stack
constexpr int64_t kConvChannels = 256;  // channels one conv work item takes at most: whole heads
constexpr int64_t kMaxHeadDim = kConvChannels;

struct Problem {
  const float *qkv, *a, *b, *conv_weight, *neg_exp_a, *dt_bias;
  float* conv_states;
  void* ssm_states;  // float, or a 16-bit State's storage (below)
  const int32_t *slots, *query_start, *snapshots;
  float *conv_out, *gates, *core;  // [T, conv_dim], [T, value_heads, 2], [T, value_dim]
  int64_t num_seqs, conv_dim, kernel, key_heads, value_heads, dk, dv;
  int64_t conv_slot_stride, ssm_slot_stride, conv_layer_offset, ssm_layer_offset;
  bool tiled;

  int64_t key_dim() const { return key_heads * dk; }
  float scale() const { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk))); }
  float* conv_of(int64_t slot) const {  // [conv_dim, kernel - 1]
    return conv_states + slot * conv_slot_stride + conv_layer_offset;
  }
  template <typename T>
  T* ssm_of(int64_t slot, int64_t head) const {  // [dk, dv]
    return static_cast<T*>(ssm_states) + slot * ssm_slot_stride + ssm_layer_offset +
           head * dk * dv;
  }
  int64_t key_head_of(int64_t head) const {
    return tiled ? head % key_heads : head / (value_heads / key_heads);
  }
};

// Run fn(i) for i in [0, count), one index at a time to whichever thread is free.
template <typename Fn>
void for_each_item(int64_t count, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < count; i = next++) fn(i);
  });
}

inline __m256 silu(__m256 x) {  // x / (1 + exp(-x)), as PyTorch's CPU kernel computes it
  const __m256 e = simd::exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// ---- phase 1: the conv, q and k norms and the gates, per (sequence, block of channels) ----

// out[0, dim) = x * rsqrt(sum(x * x) + 1e-6) * scale; the sum in 8 lanes, then simd::hsum.
inline void l2norm(const float* x, int64_t dim, float scale, float* out) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    sum = _mm256_fmadd_ps(v, v, sum);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(simd::hsum(sum) + 1e-6f));
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < dim; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), s));
}

// Sequence n's per-(token, head) scalars into p.gates [T, value_heads, 2]: decay =
// exp(neg_exp_a * softplus(a + dt_bias)) and beta = sigmoid(b) (softplus(x) = x above 20, as
// torch's). Each is computed in double and rounded once to float, so a libm's last double bit
// never reaches the float.
inline void sequence_gates(const Problem& p, int64_t n) {
  for (int64_t t = p.query_start[n]; t < p.query_start[n + 1]; ++t) {
    for (int64_t h = 0; h < p.value_heads; ++h) {
      const float x = p.a[t * p.value_heads + h] + p.dt_bias[h];
      const float softplus = x > 20.0f ? x : static_cast<float>(std::log1p(std::exp(double{x})));
      const float g = p.neg_exp_a[h] * softplus;
      const double b = p.b[t * p.value_heads + h];
      float* out = p.gates + (t * p.value_heads + h) * 2;
      out[0] = static_cast<float>(std::exp(double{g}));
      out[1] = static_cast<float>(1.0 / (1.0 + std::exp(-b)));
    }
  }
}

// Channels [c0, c0 + width) of sequence n (whole heads): conv_out rows = silu(conv), its q and
// k heads l2-normalised (q scaled), the live conv state advanced past the sequence's tokens,
// and conv snapshots where asked. The extended input ext[e] is the old state for e < K - 1
// (oldest first), else token first + e - (K - 1); token i's output is sum_j w[j] ext[i + j],
// and the state after it is ext[i + 1, i + K).
inline void conv_block(const Problem& p, int64_t n, int64_t c0, int64_t width) {
  const int64_t K = p.kernel, C = p.conv_dim, first = p.query_start[n];
  const int64_t len = p.query_start[n + 1] - first;
  float hist[(kMaxKernel - 1) * kConvChannels], taps[kMaxKernel * kConvChannels];
  float* live = p.conv_of(p.slots[n]);
  for (int64_t c = 0; c < width; ++c) {  // transposed: channel-contiguous rows per tap
    for (int64_t j = 0; j + 1 < K; ++j) hist[j * width + c] = live[(c0 + c) * (K - 1) + j];
    for (int64_t j = 0; j < K; ++j) taps[j * width + c] = p.conv_weight[(c0 + c) * K + j];
  }
  auto ext = [&](int64_t e) {  // -> channel c0 of ext[e]
    return e < K - 1 ? hist + e * width : p.qkv + (first + e - (K - 1)) * C + c0;
  };
  auto save_state = [&](float* state, int64_t after) {  // ext[after + 1, after + K)
    for (int64_t j = 0; j + 1 < K; ++j) {
      const float* src = ext(after + 1 + j);
      for (int64_t c = 0; c < width; ++c) state[(c0 + c) * (K - 1) + j] = src[c];
    }
  };
  for (int64_t i = 0; i < len; ++i) {
    float* out = p.conv_out + (first + i) * C + c0;
    for (int64_t c = 0; c < width; c += 8) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(taps + c), _mm256_loadu_ps(ext(i) + c));
      for (int64_t j = 1; j < K; ++j)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps + j * width + c),
                              _mm256_loadu_ps(ext(i + j) + c), acc);
      _mm256_storeu_ps(out + c, silu(acc));
    }
    for (int64_t c = 0; c < width && c0 + c < 2 * p.key_dim(); c += p.dk)
      l2norm(out + c, p.dk, c0 + c < p.key_dim() ? p.scale() : 1.0f, out + c);
    const int32_t snapshot = p.snapshots[first + i];
    if (snapshot >= 0) save_state(p.conv_of(snapshot), i);
  }
  // last: hist is a copy, so the live state may be overwritten now
  if (len > 0) save_state(live, len - 1);
}

// ---- the recurrent state's storage (--mamba-ssm-cache-dtype) ------------------------------

// A 16-bit state is widened to float32 as a call reads it, and rounded to the nearest value
// of its type (ties to even, as torch's conversions round) after every token, so a token's bits
// still do not depend on how its sequence was cut into calls: a snapshot holds exactly the state
// the next token reads. Between, the arithmetic is the float32 state's. Each type: load 8
// values as float32, round 8 float32s to the nearest value of the type (still float32), store 8
// float32s the type holds exactly.
struct FloatState {
  using Storage = float;
  static __m256 load(const float* x) { return _mm256_loadu_ps(x); }
  static __m256 round(__m256 x) { return x; }
  static void store(float* x, __m256 v) { _mm256_storeu_ps(x, v); }
};

struct BFloat16State {  // the upper 16 bits of a float32
  using Storage = uint16_t;
  static __m256 load(const uint16_t* x) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  static __m256 round(__m256 x) {  // torch's round_to_nearest_even; NaN stays a NaN
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    const __m256 rounded =
        _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xffff0000u))));
    return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  static void store(uint16_t* x, __m256 v) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
  }
};

struct Float16State {  // F16C's conversions, rounding to nearest even
  using Storage = uint16_t;
  static __m256 load(const uint16_t* x) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
  static __m256 round(__m256 x) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(uint16_t* x, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

// ---- phase 2: the recurrence, per (sequence, value head) ----------------------------------

// Columns are independent through the whole recurrence (column j of S needs only v[j] and the
// token's k, q, decay and beta), so a strip of 8W columns [dk, 8W] runs every token of its
// sequence while it sits in L1 (16 KB at dk 128, W 4), and W column blocks at once keep W
// independent FMA chains in flight. Both are schedules: a column's arithmetic is the same for
// every strip width. Per token and element, 4 float ops (decay, kv_mem, update, o) on the two
// FMA pipes: a 512-token prefill of Qwen3.5-0.8B's 16 heads is ~34M cycles, what one Zen 5
// thread measures (12.6 ms, whether strips or tokens are the outer loop). On two threads the
// strip-outer loop takes 8.1-9.2 ms, the token-outer one (all of S per token) 13.0 ms.

// Pass 1 over a strip (S at its first column, rows `stride` floats apart): S *= decay,
// kv_mem = sum_i S[i] k[i].
template <int W>
inline void decay_and_read(float* S, int64_t dk, int64_t stride, __m256 decay, const float* k,
                           float* kv_mem) {
  __m256 acc[W];
  for (int w = 0; w < W; ++w) acc[w] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * stride;
    const __m256 ki = _mm256_set1_ps(k[i]);
    for (int w = 0; w < W; ++w) {
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * w), decay);
      _mm256_storeu_ps(row + 8 * w, s);
      acc[w] = _mm256_fmadd_ps(s, ki, acc[w]);
    }
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(kv_mem + 8 * w, acc[w]);
}

// Pass 2 over the same strip: S[i] += k[i] delta, o = sum_i S[i] q[i]; S is kept as State
// rounds it (o reads it before).
template <typename State, int W>
inline void update_and_read(float* S, int64_t dk, int64_t stride, const float* k,
                            const float* q, const float* delta, float* o) {
  __m256 d[W], acc[W];
  for (int w = 0; w < W; ++w) {
    d[w] = _mm256_loadu_ps(delta + 8 * w);
    acc[w] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * stride;
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int w = 0; w < W; ++w) {
      const __m256 s = _mm256_fmadd_ps(ki, d[w], _mm256_loadu_ps(row + 8 * w));
      _mm256_storeu_ps(row + 8 * w, State::round(s));
      acc[w] = _mm256_fmadd_ps(s, qi, acc[w]);
    }
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(o + 8 * w, acc[w]);
}

// Rows [0, dk) of a strip of 8W columns, `from` to `to` (row strides in elements).
template <int W, typename From, typename To>
inline void copy_strip(const typename From::Storage* from, int64_t from_stride,
                       typename To::Storage* to, int64_t to_stride, int64_t dk) {
  for (int64_t i = 0; i < dk; ++i)
    for (int w = 0; w < W; ++w)
      To::store(to + i * to_stride + 8 * w, From::load(from + i * from_stride + 8 * w));
}

// Sequence n, value head h, columns [j0, j0 + 8W): every token of the sequence, in order, on
// the live state: in place if it is float32, else on a float32 copy of the strip that is
// written back once the tokens are done (rounded already, so exactly).
template <typename State, int W>
inline void recur_strip(const Problem& p, int64_t n, int64_t h, int64_t j0) {
  using T = typename State::Storage;
  constexpr bool kInPlace = std::is_same_v<State, FloatState>;
  const int64_t dk = p.dk, dv = p.dv, C = p.conv_dim, key_dim = p.key_dim();
  const int64_t kh = p.key_head_of(h);
  float delta[8 * W];  // kv_mem first
  T* live = p.ssm_of<T>(p.slots[n], h) + j0;
  float copy[kInPlace ? 1 : kMaxHeadDim * 8 * W];  // [dk, 8W]
  float* S;
  int64_t stride;
  if constexpr (kInPlace) {
    S = live, stride = dv;
  } else {
    S = copy, stride = 8 * W;
    copy_strip<W, State, FloatState>(live, dv, S, stride, dk);
  }
  for (int64_t t = p.query_start[n]; t < p.query_start[n + 1]; ++t) {
    const float* row = p.conv_out + t * C;  // q and k normalised by phase 1
    const float *q = row + kh * dk, *k = row + key_dim + kh * dk;
    const float* gate = p.gates + (t * p.value_heads + h) * 2;  // decay, beta
    decay_and_read<W>(S, dk, stride, _mm256_set1_ps(gate[0]), k, delta);
    const float* v = row + 2 * key_dim + h * dv + j0;
    const __m256 beta = _mm256_set1_ps(gate[1]);
    for (int w = 0; w < W; ++w)  // delta = (v - kv_mem) * beta
      _mm256_storeu_ps(delta + 8 * w, _mm256_mul_ps(
          _mm256_sub_ps(_mm256_loadu_ps(v + 8 * w), _mm256_loadu_ps(delta + 8 * w)), beta));
    update_and_read<State, W>(S, dk, stride, k, q, delta,
                              p.core + t * p.value_heads * dv + h * dv + j0);
    const int32_t snapshot = p.snapshots[t];
    if (snapshot >= 0)
      copy_strip<W, FloatState, State>(S, stride, p.ssm_of<T>(snapshot, h) + j0, dv, dk);
  }
  if constexpr (!kInPlace) copy_strip<W, FloatState, State>(S, stride, live, dv, dk);
}

// Every (sequence, value head) of the problem, strips of 8W columns, then 8 at a time.
template <typename State, int W>
inline void recur_heads(const Problem& p) {
  const int64_t heads = p.value_heads, wide = p.dv / (8 * W);
  for_each_item(p.num_seqs * heads, [&](int64_t item) {
    const int64_t n = item / heads, h = item % heads;
    for (int64_t strip = 0; strip < wide; ++strip) recur_strip<State, W>(p, n, h, 8 * W * strip);
    for (int64_t j0 = 8 * W * wide; j0 < p.dv; j0 += 8) recur_strip<State, 1>(p, n, h, j0);
  });
}

inline void check_float(const torch::Tensor& x, std::initializer_list<int64_t> sizes,
                        const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.sizes() == torch::IntArrayRef(sizes),
              name, " must be a contiguous float32 CPU tensor of shape ",
              torch::IntArrayRef(sizes), ", not ", x.sizes());
}

// The recurrent state: contiguous, on the CPU, float32, bfloat16 or float16.
inline void check_state(const torch::Tensor& x, std::initializer_list<int64_t> sizes) {
  const auto type = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                  x.sizes() == torch::IntArrayRef(sizes) &&
                  (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf),
              "ssm_states must be a contiguous float32, bfloat16 or float16 CPU tensor of shape ",
              torch::IntArrayRef(sizes), ", not ", x.scalar_type(), " ", x.sizes());
}

inline const int32_t* check_index(const torch::Tensor& x, int64_t numel, int64_t lowest,
                           int64_t limit, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kInt32 && x.dim() == 1 &&
                  x.numel() == numel && x.is_contiguous(),
              name, " must be a contiguous int32 CPU tensor of ", numel, " elements");
  const int32_t* v = x.data_ptr<int32_t>();
  for (int64_t i = 0; i < numel; ++i)
    TORCH_CHECK(v[i] >= lowest && v[i] < limit, name, "[", i, "] = ", v[i], " is outside [",
                lowest, ", ", limit, ")");
  return v;
}


// core [T, value_heads * dv]: the gated delta rule's output of every token (before the gated
// norm); conv_states [slots, layers, conv_dim, K - 1] and ssm_states [slots, layers,
// value_heads, dk, dv] (float32, bfloat16 or float16) updated in place at `layer`, and copied
// at snapshots (delta_net_ops.py).
inline torch::Tensor delta_rule(torch::Tensor qkv, torch::Tensor a, torch::Tensor b,
                         torch::Tensor conv_weight, torch::Tensor neg_exp_a,
                         torch::Tensor dt_bias, torch::Tensor conv_states,
                         torch::Tensor ssm_states, int64_t layer, torch::Tensor slots,
                         torch::Tensor query_start, torch::Tensor snapshots,
                         int64_t num_key_heads, bool v_heads_tiled) {
  TORCH_CHECK(ssm_states.dim() == 5 && conv_states.dim() == 4 && qkv.dim() == 2 && a.dim() == 2,
              "ssm_states must be 5-d, conv_states 4-d, qkv and a 2-d");
  const int64_t T = qkv.size(0), C = qkv.size(1), H = a.size(1), K = conv_weight.size(-1);
  const int64_t num_slots = ssm_states.size(0), layers = ssm_states.size(1);
  const int64_t dk = ssm_states.size(3), dv = ssm_states.size(4);
  TORCH_CHECK(dk % 8 == 0 && dv % 8 == 0 && dk > 0 && dv > 0 && dk <= kMaxHeadDim,
              "key and value head dims must be multiples of 8 (key at most ", kMaxHeadDim,
              "), not ", dk, " and ", dv);
  TORCH_CHECK(K >= 2 && K <= kMaxKernel, "conv_kernel must be in [2, ", kMaxKernel, "]");
  TORCH_CHECK(num_key_heads > 0 && H % num_key_heads == 0 &&
                  C == 2 * num_key_heads * dk + H * dv,
              "qkv's ", C, " columns are not 2 * ", num_key_heads, " key heads of ", dk,
              " + ", H, " value heads of ", dv);
  TORCH_CHECK(layer >= 0 && layer < layers, "layer ", layer, " is outside [0, ", layers, ")");
  check_float(qkv, {T, C}, "qkv");
  check_float(a, {T, H}, "a");
  check_float(b, {T, H}, "b");
  check_float(conv_weight, {C, K}, "conv_weight");
  check_float(neg_exp_a, {H}, "neg_exp_a");
  check_float(dt_bias, {H}, "dt_bias");
  check_float(conv_states, {num_slots, layers, C, K - 1}, "conv_states");
  check_state(ssm_states, {num_slots, layers, H, dk, dv});
  const int64_t N = slots.numel();
  const int32_t* starts = check_index(query_start, N + 1, 0, T + 1, "query_start");
  TORCH_CHECK(starts[0] == 0 && starts[N] == T, "query_start must run from 0 to ", T);
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(starts[n] <= starts[n + 1], "query_start must not decrease (at ", n, ")");
  auto conv_out = torch::empty({T, C}, qkv.options());  // after SiLU, q and k normalised
  auto gates = torch::empty({T, H, 2}, qkv.options());  // decay, beta
  auto core = torch::empty({T, H * dv}, qkv.options());
  const Problem p{qkv.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                  conv_weight.data_ptr<float>(), neg_exp_a.data_ptr<float>(),
                  dt_bias.data_ptr<float>(), conv_states.data_ptr<float>(),
                  ssm_states.data_ptr(),
                  check_index(slots, N, 0, num_slots, "slots"), starts,
                  check_index(snapshots, T, -1, num_slots, "snapshots"),
                  conv_out.data_ptr<float>(), gates.data_ptr<float>(), core.data_ptr<float>(),
                  N, C, K, num_key_heads, H, dk, dv,
                  layers * C * (K - 1), layers * H * dk * dv, layer * C * (K - 1),
                  layer * H * dk * dv, v_heads_tiled};
  // 1) the conv in blocks of whole heads, and each sequence's gates with its first block:
  // every token's q, k, v and gates before any recurrence reads them
  const int64_t width = kConvChannels / dk * dk, blocks = (C + width - 1) / width;
  for_each_item(N * blocks, [&](int64_t item) {
    const int64_t n = item / blocks, c0 = item % blocks * width;
    conv_block(p, n, c0, std::min(width, C - c0));
    if (c0 == 0) sequence_gates(p, n);
  });
  // 2) the recurrence, each (sequence, value head) on one thread: strip by strip of the
  // schedule's columns (8 at the end), each strip through the sequence's tokens in order.
  // (Strips as work items of their own: the same at a prefill, slower at a decode on two Zen 5
  // threads, 2.5 against 1.8 ms for 32 sequences, 72 against 54 us for one.)
  auto recur = [&](auto state) {
    using State = decltype(state);
    switch (schedule::current().delta_net_strip_columns) {
      case 8: recur_heads<State, 1>(p); break;
      case 16: recur_heads<State, 2>(p); break;
      case 64: recur_heads<State, 8>(p); break;
      default: recur_heads<State, 4>(p); break;
    }
  };
  if (ssm_states.scalar_type() == torch::kBFloat16)
    recur(BFloat16State{});
  else if (ssm_states.scalar_type() == torch::kHalf)
    recur(Float16State{});
  else
    recur(FloatState{});
  return core;
}

}  // namespace delta_net
