// A barrier for the threads of one parallel region: it spins for up to `spin` (the schedule's
// spin_us), then sleeps on a futex until the last thread arrives.
//
// decode_layers.cpp's one-region forward meets ~6 barriers a layer, a few to tens of
// microseconds apart, and its threads reach them nearly together (equal shares of each matmul,
// of attention's query heads): a short spin costs less than a futex wake-up (20-110 us here,
// docs/benchmarks.md). A longer wait means a thread was descheduled (on 2 cores the API process
// and the client run beside the engine); then sleeping helps, as an idle core lets the
// scheduler run there whatever displaced it. `bench serve` at one stream (default model, 2
// cores, 6 requests, two rounds each): spinning 5 / 10 / 20 us measured ITL p90 9.4-11.1 /
// 10.3-11.5 / 12.1-13.8 ms, the fork/join path 13.0-13.1; earlier, with attention split by
// whole groups, 50 / 500 us gave 13.7-15.7 / 19.1-22.1, and spinning on with sched_yield ~21.
// A batch-1 step alone measured the same at 5 to 50 us (6.8-7.8 ms).
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

class SpinBarrier {
 public:
  // `spin`: the schedule's spin_us (schedule.h), 10 us unless tuned
  SpinBarrier(int num_threads, std::chrono::microseconds spin)
      : num_threads_(num_threads), spin_(spin) {}

  void wait() {
    const uint32_t generation = generation_.load();
    if (arrived_.fetch_add(1) + 1 == num_threads_) {
      arrived_.store(0);
      generation_.store(generation + 1);
      if (sleepers_.load() > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + spin_;
    for (int spins = 1;; ++spins) {
      if (generation_.load() != generation) return;
      _mm_pause();
      if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    // Seen by the last thread after its store to generation_, or this thread's futex call
    // finds generation_ changed and returns at once (all seq_cst: no wake-up is lost).
    sleepers_.fetch_add(1);
    while (generation_.load() == generation) futex(FUTEX_WAIT_PRIVATE, generation);
    sleepers_.fetch_sub(1);
  }

 private:
  void futex(int op, uint32_t value) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), op, value, nullptr, nullptr, 0);
  }

  const int num_threads_;
  const std::chrono::microseconds spin_;
  std::atomic<int> arrived_{0}, sleepers_{0};
  std::atomic<uint32_t> generation_{0};
};
