// Reading one row for sampling_rows.h: its max, chunk maxima, the whole row's mass, and the
// candidate sets the cut is looked for in. See sampling.cpp for the plan.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "sampling_simd.h"

namespace sampling {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunk = 64;  // tokens per chunk maximum

struct Candidate {
  float value;  // the raw logit while selecting, the scaled one after
  int32_t id;
};

bool by_value_then_id(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

struct Workspace {  // one per thread, reused across its rows
  std::vector<Candidate> candidates;
  std::vector<float> chunk_max, scratch;
};

struct Row {
  const float* x;  // raw logits [vocab]
  int64_t vocab;
  float temperature;
  int64_t top_k;
  float top_p;
  float log_min_p;
  uint32_t key;
};

struct RowMax {
  float value;
  int64_t id;  // the first id holding the max, as torch.argmax
  bool has_nan;
};

RowMax row_max(const float* x, int64_t vocab) {
  __m256 best = _mm256_set1_ps(kNegInf), nan = _mm256_setzero_ps();
  __m256i best_id = _mm256_setzero_si256(), ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 higher = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strict: the first max stays
    best = _mm256_blendv_ps(best, v, higher);
    best_id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_id),
                                                   _mm256_castsi256_ps(ids), higher));
    ids = _mm256_add_epi32(ids, _mm256_set1_epi32(8));
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_id[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_id), best_id);
  RowMax out{kNegInf, 0, _mm256_movemask_ps(nan) != 0};  // all -inf: id 0, as torch.argmax
  for (int lane = 0; lane < 8; ++lane) {
    const bool tie = lane_best[lane] == out.value && out.value > kNegInf && lane_id[lane] < out.id;
    if (lane_best[lane] > out.value || tie) out = {lane_best[lane], lane_id[lane], out.has_nan};
  }
  for (; i < vocab; ++i) {
    out.has_nan |= std::isnan(x[i]);
    if (x[i] > out.value) out = {x[i], i, out.has_nan};
  }
  return out;
}

// The maximum of each kChunk tokens into `chunk_max`; returns the row's max, or NaN if any.
float chunk_maxima(const float* x, int64_t vocab, std::vector<float>& chunk_max) {
  chunk_max.clear();
  __m256 nan = _mm256_setzero_ps();
  float row = kNegInf;
  for (int64_t start = 0; start < vocab; start += kChunk) {
    float best = kNegInf;
    if (start + kChunk <= vocab) {
      __m256 m = _mm256_set1_ps(kNegInf);
      for (int64_t i = start; i < start + kChunk; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
      }
      best = simd::hmax(m);
    } else {
      for (int64_t i = start; i < vocab; ++i) best = std::isnan(x[i]) ? x[i] : std::max(best, x[i]);
    }
    chunk_max.push_back(best);
    row = std::isnan(best) ? best : std::max(row, best);
  }
  return _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN() : row;
}

// Sum of exp(x / t - s_max) over the row in float64, with whole_mass's float division and
// subtraction.
double whole_mass(const Row& row, float s_max) {
  const __m256 t8 = _mm256_set1_ps(row.temperature), s_max8 = _mm256_set1_ps(s_max);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= row.vocab; i += 8) {
    const __m256 w = exp256(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(row.x + i), t8), s_max8));
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(low, high));
  double sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < row.vocab; ++i) sum += std::exp(static_cast<double>(row.x[i] / row.temperature - s_max));
  return sum;
}

// Keep the `width` largest candidates (by value, then id), in any order.
void keep_largest(std::vector<Candidate>& c, int64_t width) {
  if (static_cast<int64_t>(c.size()) <= width) return;
  std::nth_element(c.begin(), c.begin() + width - 1, c.end(), by_value_then_id);
  c.resize(width);
}

// The `width` largest finite logits (all of them if fewer), sorted descending by raw value.
// From chunk maxima (needs more chunks than `width`): the width-th largest chunk maximum is a
// floor for the width largest values, so only chunks reaching it are read. Otherwise one pass
// keeps a buffer above a rising threshold.
void select_top(const Row& row, int64_t width, Workspace& ws, bool from_chunks) {
  std::vector<Candidate>& out = ws.candidates;
  out.clear();
  if (from_chunks) {
    ws.scratch.assign(ws.chunk_max.begin(), ws.chunk_max.end());
    std::nth_element(ws.scratch.begin(), ws.scratch.begin() + width - 1, ws.scratch.end(),
                     std::greater<float>());
    const float floor = ws.scratch[width - 1];
    for (int64_t c = 0; c < static_cast<int64_t>(ws.chunk_max.size()); ++c) {
      if (!(ws.chunk_max[c] >= floor && ws.chunk_max[c] > kNegInf)) continue;
      for (int64_t i = c * kChunk; i < std::min(row.vocab, (c + 1) * kChunk); ++i)
        if (row.x[i] >= floor && row.x[i] > kNegInf) out.push_back({row.x[i], static_cast<int32_t>(i)});
    }
  } else {
    float threshold = kNegInf;  // strict: values above it may still be among the largest
    __m256 threshold8 = _mm256_set1_ps(threshold);
    int64_t i = 0;
    for (; i + 8 <= row.vocab; i += 8) {
      const __m256 v = _mm256_loadu_ps(row.x + i);
      for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(v, threshold8, _CMP_GT_OQ)); bits;
           bits &= bits - 1)
        out.push_back({row.x[i + __builtin_ctz(bits)], static_cast<int32_t>(i + __builtin_ctz(bits))});
      if (static_cast<int64_t>(out.size()) >= 2 * width) {
        keep_largest(out, width);
        threshold8 = _mm256_set1_ps(threshold = out[width - 1].value);
      }
    }
    for (; i < row.vocab; ++i)
      if (row.x[i] > threshold) out.push_back({row.x[i], static_cast<int32_t>(i)});
  }
  keep_largest(out, width);
  std::sort(out.begin(), out.end(), by_value_then_id);
}

// Every token with fl(x / t) - s_max >= floor (the float operations of the min-p test), raw
// logits, in any order: a token left out is below the floor.
void collect_above(const Row& row, float s_max, float floor, std::vector<Candidate>& out) {
  out.clear();
  const __m256 t8 = _mm256_set1_ps(row.temperature), s_max8 = _mm256_set1_ps(s_max);
  const __m256 floor8 = _mm256_set1_ps(floor);
  int64_t i = 0;
  for (; i + 8 <= row.vocab; i += 8) {
    const __m256 gap = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(row.x + i), t8), s_max8);
    for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(gap, floor8, _CMP_GE_OQ)); bits;
         bits &= bits - 1)
      out.push_back({row.x[i + __builtin_ctz(bits)], static_cast<int32_t>(i + __builtin_ctz(bits))});
  }
  for (; i < row.vocab; ++i)
    if (row.x[i] / row.temperature - s_max >= floor) out.push_back({row.x[i], static_cast<int32_t>(i)});
}

// For a top-p row whose cut lies past its first candidates: a floor on s - s_max just below
// the cut, from the mass in bins of a quarter nat (the cut lies above the first bin edge where
// the mass above reaches top_p), or -inf. A margin of 1e-3 of the mass, far above this sum's
// error: it only has to be sure; find_cut then works exactly on what collect_above brings.
float top_p_floor(const Row& row, float s_max, double whole) {
  constexpr int kBins = 128;
  constexpr float kBinsPerNat = 4.0f;  // the last bin holds everything below -31.75
  double mass[kBins] = {};
  const __m256 t8 = _mm256_set1_ps(row.temperature), s_max8 = _mm256_set1_ps(s_max);
  alignas(32) float weights[8];
  alignas(32) int32_t bins[8];
  for (int64_t start = 0; start < row.vocab; start += 8) {
    __m256 x;
    if (start + 8 <= row.vocab) {
      x = _mm256_loadu_ps(row.x + start);
    } else {
      alignas(32) float tail[8];
      for (int64_t lane = 0; lane < 8; ++lane)
        tail[lane] = start + lane < row.vocab ? row.x[start + lane] : kNegInf;
      x = _mm256_load_ps(tail);
    }
    const __m256 gap = _mm256_sub_ps(_mm256_div_ps(x, t8), s_max8);
    _mm256_store_ps(weights, exp256(gap));
    const __m256 depth = _mm256_min_ps(_mm256_mul_ps(gap, _mm256_set1_ps(-kBinsPerNat)),
                                       _mm256_set1_ps(kBins - 1));  // (-inf: the last bin)
    _mm256_store_si256(reinterpret_cast<__m256i*>(bins), _mm256_cvttps_epi32(depth));
    for (int lane = 0; lane < 8; ++lane) mass[bins[lane]] += weights[lane];
  }
  double above = 0.0;
  for (int bin = 0; bin + 1 < kBins; ++bin) {  // bins 0..bin hold the gaps > -(bin + 1) / 4
    above += mass[bin];
    if (above >= (row.top_p + 1e-3) * whole) return -(bin + 1) / kBinsPerNat;
  }
  return kNegInf;
}

}  // namespace sampling
