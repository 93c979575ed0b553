// One row's draw for sampling.cpp: the truncated draw (the cut on the candidates, widening) and
// the untruncated draw (bounded noise). See sampling.cpp for the plan.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "sampling_select.h"

namespace sampling {

constexpr int64_t kUndecided = -1;
constexpr int64_t kFirstWidth = 64;  // candidates first looked at (truncation.py's WIDTHS[0])
constexpr int64_t kWiden = -2;       // cut_and_draw: the candidates were not enough
// A top-p mass fraction C / Z: PyTorch's float exp is within 1 ulp (2^-23 relative), this file's
// double exp exact and its exp256 (for Z over the whole row) within 0.705 ulp, so the two
// fractions differ by < 2.7 * 2^-23: the margin is 3x that.
constexpr double kMassMargin = 0x1p-20;
// The two paths' noise differs by at most 9.5e-7 (one ulp; tests/sample/test_fused.py checks
// every u), and each score adds half an ulp of itself.
constexpr double kScoreMargin = 0x1p-15;
constexpr double kScoreRelativeMargin = 0x1p-20;
constexpr float kGumbelMax = 17.0f;  // the largest u, 1 - 2^-24, gives 16.64

// Gumbel-max over candidates [0, count): the winner's id, or kUndecided when the best two
// scores are too close for the PyTorch path's rounding to be sure of the same winner.
int64_t draw_among(const Candidate* candidates, int64_t count, uint32_t key) {
  if (count == 1) return candidates[0].id;
  float best = kNegInf, second = kNegInf;
  int64_t best_id = kUndecided;
  alignas(32) int32_t ids[8];
  alignas(32) float values[8], scores[8];
  for (int64_t start = 0; start < count; start += 8) {
    const int64_t lanes = std::min<int64_t>(8, count - start);
    for (int64_t lane = 0; lane < 8; ++lane) {  // unused lanes: noise for id 0, score -inf
      ids[lane] = lane < lanes ? candidates[start + lane].id : 0;
      values[lane] = lane < lanes ? candidates[start + lane].value : kNegInf;
    }
    const __m256 noise = gumbel8(hash8(_mm256_load_si256(reinterpret_cast<__m256i*>(ids)), key));
    _mm256_store_ps(scores, _mm256_add_ps(_mm256_load_ps(values), noise));
    for (int64_t lane = 0; lane < lanes; ++lane) {
      if (scores[lane] > best) {
        second = best, best = scores[lane], best_id = ids[lane];
      } else if (scores[lane] > second) {
        second = scores[lane];
      }
    }
  }
  const double margin = kScoreMargin + kScoreRelativeMargin * std::fabs(best);
  if (!std::isfinite(best) || static_cast<double>(best) - second <= margin) return kUndecided;
  return best_id;
}

enum class Cut { kFound, kWiden, kUndecided };

// Candidates in descending order, sorted only as far as they are read: each time, a block twice
// the sorted part is split off by nth_element and sorted (a wide top-p cut reads a few thousand
// of the 20,000 tokens collect_above may bring). Everything sorted precedes the rest.
class SortedOnDemand {
 public:
  SortedOnDemand(std::vector<Candidate>& c, bool is_sorted)
      : c_(c), sorted_(is_sorted ? static_cast<int64_t>(c.size()) : 0) {}
  int64_t size() const { return static_cast<int64_t>(c_.size()); }
  int64_t sorted() const { return sorted_; }
  const Candidate& operator[](int64_t j) {
    if (j >= sorted_) {
      const int64_t end = std::min(size(), std::max({j + 1, 2 * sorted_, int64_t{256}}));
      if (end < size())
        std::nth_element(c_.begin() + sorted_, c_.begin() + end - 1, c_.end(), by_value_then_id);
      std::sort(c_.begin() + sorted_, c_.begin() + end, by_value_then_id);
      sorted_ = end;
    }
    return c_[j];
  }

 private:
  std::vector<Candidate>& c_;
  int64_t sorted_;
};

// truncation.py's _truncate_within on scaled candidates: how many are kept, and the kept ones
// moved to the front. `all_inside`: no token outside the candidates can be kept.
Cut find_cut(std::vector<Candidate>& candidates, bool is_sorted, bool all_inside, const Row& row,
             double whole, int64_t& num_kept) {
  SortedOnDemand c(candidates, is_sorted);
  const int64_t n = c.size();
  const float s_max = c[0].value;
  // 1) min-p, 2) top-k (ties kept): the survivors, first in sorted order (both tests rise with
  // the value), so they are the sorted part's leading run, then the rest's partition
  const bool has_k = row.top_k > 0;
  const float kth = has_k && row.top_k <= n ? c[row.top_k - 1].value : kNegInf;
  const auto survives = [&](const Candidate& x) {
    return x.value - s_max >= row.log_min_p && x.value >= kth;
  };
  int64_t survivors = 0;
  while (survivors < c.sorted() && survives(candidates[survivors])) ++survivors;
  if (survivors == c.sorted())
    survivors = std::partition(candidates.begin() + survivors, candidates.end(), survives) -
                candidates.begin();
  const bool cut = has_k || row.log_min_p > kNegInf;
  if (cut && survivors == n && !all_inside) return Cut::kWiden;
  num_kept = survivors;
  if (!(row.top_p < 1.0f)) return Cut::kFound;
  // 3) top-p: positions stay while the mass before them is below top_p
  const auto weight = [&](const Candidate& x) { return std::exp(static_cast<double>(x.value - s_max)); };
  double total = whole;
  if (cut) {  // any order: the sums differ in the last bits of a double, far inside the margin
    total = 0.0;
    for (int64_t j = 0; j < survivors; ++j) total += weight(candidates[j]);
  }
  double before = 0.0, last_before = 0.0;
  int64_t j = 0;
  for (; j < survivors && before / total < row.top_p; ++j) last_before = before, before += weight(c[j]);
  if (!cut && j == n && !all_inside) return Cut::kWiden;  // the cut lies past the candidates
  if (row.top_p - last_before / total <= kMassMargin ||
      (j < survivors && before / total - row.top_p <= kMassMargin))
    return Cut::kUndecided;
  num_kept = j;  // and the tokens tied with the last one kept
  const float last = c[j - 1].value;
  while (num_kept < survivors && c[num_kept].value >= last) ++num_kept;
  if (!cut && num_kept == n && !all_inside) return Cut::kWiden;
  return Cut::kFound;
}

int64_t draw_truncated(const Row& row, Workspace& ws) {
  const float max = chunk_maxima(row.x, row.vocab, ws.chunk_max);
  const float s_max = max / row.temperature;
  if (!std::isfinite(s_max)) return kUndecided;  // NaN, or no finite logit, or infinite
  const bool top_p_alone = row.top_p < 1.0f && row.top_k <= 0 && row.log_min_p == kNegInf;
  const double whole = top_p_alone ? whole_mass(row, s_max) : 0.0;
  const auto cut_and_draw = [&](bool is_sorted, bool all_inside) {  // ws.candidates, raw
    for (Candidate& c : ws.candidates) c.value /= row.temperature;
    int64_t num_kept = 0;
    const Cut cut = find_cut(ws.candidates, is_sorted, all_inside, row, whole, num_kept);
    return cut != Cut::kFound ? (cut == Cut::kWiden && !all_inside ? kWiden : kUndecided)
                              : draw_among(ws.candidates.data(), num_kept, row.key);
  };
  // 1) the largest logits: 64, or a power of two above top_k, from the chunk maxima
  int64_t width = kFirstWidth;
  while (width <= row.top_k && width < row.vocab) width *= 2;
  const int64_t num_chunks = static_cast<int64_t>(ws.chunk_max.size());
  for (bool first = true;; first = false) {
    width = std::min(width, row.vocab);
    select_top(row, width, ws, width < num_chunks);
    const int64_t token = cut_and_draw(
        true, static_cast<int64_t>(ws.candidates.size()) < width || width == row.vocab);
    if (token != kWiden) return token;
    // 2) the cut lies further: min-p's survivors, or top-p's tokens above a floor holding its
    // mass, collected exactly in one pass; else 8x wider, up to the whole vocabulary
    const float floor = row.log_min_p > kNegInf ? row.log_min_p
                        : first && top_p_alone  ? top_p_floor(row, s_max, whole)
                                                : kNegInf;
    if (floor > kNegInf) {
      collect_above(row, s_max, floor, ws.candidates);
      return cut_and_draw(false, true);
    }
    width *= 8;
  }
}

int64_t draw_untruncated(const Row& row) {
  const RowMax max = row_max(row.x, row.vocab);
  const float s_max = max.value / row.temperature;
  if (max.has_nan || !std::isfinite(s_max)) return kUndecided;
  const __m256 t8 = _mm256_set1_ps(row.temperature);
  float best = kNegInf, second = kNegInf, floor = kNegInf;  // nothing below floor can win
  int64_t best_id = kUndecided;
  alignas(32) float scores[8];
  const auto score_block = [&](int64_t start, __m256 s, __m256i hashes) {
    _mm256_store_ps(scores, _mm256_add_ps(s, gumbel8(hashes)));
    for (int64_t lane = 0; lane < 8 && start + lane < row.vocab; ++lane) {
      if (scores[lane] > best) {
        second = best, best = scores[lane], best_id = start + lane;
      } else if (scores[lane] > second) {
        second = scores[lane];
      }
    }
    floor = best - static_cast<float>(kScoreMargin + kScoreRelativeMargin * std::fabs(best)) - 1e-3f;
  };
  // the max token first: its score is the first floor
  const int64_t top_start = max.id / 8 * 8;
  const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const auto block_ids = [&](int64_t start) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(start)), lane_ids);
  };
  alignas(32) float tail[8];
  const auto load_scaled = [&](int64_t start) {
    if (start + 8 <= row.vocab) return _mm256_div_ps(_mm256_loadu_ps(row.x + start), t8);
    for (int64_t lane = 0; lane < 8; ++lane)
      tail[lane] = start + lane < row.vocab ? row.x[start + lane] : kNegInf;
    return _mm256_div_ps(_mm256_load_ps(tail), t8);
  };
  score_block(top_start, load_scaled(top_start), hash8(block_ids(top_start), row.key));
  for (int64_t start = 0; start < row.vocab; start += 8) {
    if (start == top_start) continue;
    const __m256 s = load_scaled(start);
    const __m256 floor8 = _mm256_set1_ps(floor);
    if (!_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(s, _mm256_set1_ps(kGumbelMax)), floor8,
                                          _CMP_GE_OQ)))
      continue;
    const __m256i hashes = hash8(block_ids(start), row.key);
    const __m256 reach = _mm256_add_ps(s, gumbel_bound8(hashes));
    if (_mm256_movemask_ps(_mm256_cmp_ps(reach, floor8, _CMP_GE_OQ))) score_block(start, s, hashes);
  }
  const double margin = kScoreMargin + kScoreRelativeMargin * std::fabs(best);
  if (!std::isfinite(best) || static_cast<double>(best) - second <= margin) return kUndecided;
  return best_id;
}

}  // namespace sampling
