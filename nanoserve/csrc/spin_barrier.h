// A barrier for the threads of one parallel region that spins, then yields, and never sleeps.
//
// decode_layers.cpp's one-region forward meets ~6 barriers a layer, a few to tens of
// microseconds apart. libgomp's own barrier spins GOMP_SPINCOUNT times (nanoserve sets 1,000,
// nanoserve/__init__.py) and then sleeps on a futex, and a wake-up costs 20-110 us here
// (docs/benchmarks.md), longer than the work between two barriers. This one spins with `pause`
// and, past kSpinsBeforeYield, gives its core away with sched_yield between checks, so a thread
// whose partner was descheduled (the API process on the same two cores) does not hold the core
// the partner needs.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <cstdint>

class SpinBarrier {
 public:
  explicit SpinBarrier(int num_threads) : num_threads_(num_threads) {}

  void wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < kSpinsBeforeYield) _mm_pause();
      else sched_yield();
    }
  }

 private:
  // a `pause` is ~3 cycles on a Zen 1 and ~65 from Zen 2 on: ~20 us to ~0.5 ms of spinning
  static constexpr int64_t kSpinsBeforeYield = 20000;
  const int num_threads_;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};
