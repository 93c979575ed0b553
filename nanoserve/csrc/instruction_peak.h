// The matmul kernel's instruction peak (`bench step` prints it beside the floors): how many
// multiply-adds a second the kernel's own instructions run when nothing waits on memory.
//
// - `kernel_peak`: the tier's kernel for many rows (matmul_groups, as a step with `rows`
//   activation rows runs it: the wide form of a 4- or 5-bit layout, the tier's own kernels
//   where it has them) over a weight and activations small enough to stay in L1, again and
//   again on every thread at once. What a step's matmuls lose against it is lost to memory,
//   to threads waiting on each other or to the work around the kernel, not to its arithmetic.
// - `multiply_peak`: the multiply pipes alone, independent `maddubs` chains in registers (32
//   int8 multiply-adds each): the ceiling any int8 kernel of this tier's instruction set has.
//
// Zeros throughout: the integer instructions take the same time whatever their values, and
// zero floats keep the float ones away from slow denormals.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "gguf_blocks.h"
#include "matmul_tiles.h"

namespace instruction_peak {

using gguf_blocks::Layout;

// Runs `body` (one call: `macs` multiply-adds) on every thread for about `seconds`; the
// multiply-adds a second of all threads together, the best of three rounds.
template <typename Body>
double all_threads(double seconds, double macs, Body body) {
  using Clock = std::chrono::steady_clock;
  const int64_t threads = at::get_num_threads();
  double best = 0.0;
  for (int round = 0; round < 3; ++round) {
    std::atomic<int64_t> calls{0};
    const auto start = Clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      const auto until = start + std::chrono::duration<double>(seconds / 3) * (t1 - t0);
      int64_t mine = 0;
      while (Clock::now() < until)
        for (int i = 0; i < 64; ++i, ++mine) body();
      calls += mine;
    });
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, double(calls.load()) * macs / elapsed);
  }
  return best;
}

// kernel_peak's work for one layout: a K = 512 weight of two 8-row groups against `rows`
// activation rows (at most 16, so that with the weight they fit a 32 KB L1).
template <Layout L>
double layout_peak(int64_t rows, double seconds) {
  constexpr bool kWide = gguf_blocks::is_unsigned(L);
  constexpr int64_t K = 512, N = 2 * matmul_tiles::TILE_N;
  const int64_t M = std::clamp<int64_t>(rows, 1, 16);
  std::vector<uint8_t> weight(N / matmul_tiles::TILE_N * (K / gguf_blocks::QK) *
                              gguf_blocks::block_bytes<L, kWide>());
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * K / gguf_blocks::QK), s(M * K / gguf_blocks::QK);
  return all_threads(seconds, double(M * N * K), [&] {
    thread_local std::vector<float> y(16 * N);
    matmul_tiles::matmul_groups<L, kWide, false>(weight.data(), q.data(), d.data(), s.data(),
                                                 M, N, K, y.data(), 0, 2);
  });
}

inline double kernel_peak(int64_t ggml_type, int64_t rows, double seconds) {
  switch (gguf_blocks::type_info(ggml_type).layout) {
    case Layout::U4H: return layout_peak<Layout::U4H>(rows, seconds);
    case Layout::U4F: return layout_peak<Layout::U4F>(rows, seconds);
    case Layout::U5H: return layout_peak<Layout::U5H>(rows, seconds);
    case Layout::U5F: return layout_peak<Layout::U5F>(rows, seconds);
    case Layout::S8H: return layout_peak<Layout::S8H>(rows, seconds);
    case Layout::S8F2: return layout_peak<Layout::S8F2>(rows, seconds);
    default: return layout_peak<Layout::L4F>(rows, seconds);
  }
}

// Eight independent chains of 16 `maddubs` (a chain's latency hidden by the others).
__attribute__((noinline)) inline __m256i maddubs_chains(int64_t n, __m256i a) {
  __m256i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi8(char(i));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 2; ++k)
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_maddubs_epi16(acc[c], a);
    __asm__ volatile("" : "+x"(a));  // one more pass is not the same as the last
  }
  __m256i sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm256_add_epi16(sum, acc[i]);
  return sum;
}

inline double multiply_peak(double seconds) {
  constexpr int64_t kPasses = 256;
  return all_threads(seconds, double(kPasses * 16 * 32), [] {
    thread_local __m256i sink;
    sink = maddubs_chains(kPasses, _mm256_set1_epi8(1));
  });
}

}  // namespace instruction_peak
