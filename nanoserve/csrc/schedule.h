// The kernels' schedule: every choice that decides when bytes are fetched or how work is split,
// never what is computed. Each module built from these headers holds one `current()` schedule,
// today's constants until native.py's caller sets another (the tuner's choice for this CPU:
// nanoserve/kernel_tuning/). No schedule changes a bit of any output: the tests run every
// candidate against the defaults (tests/model/test_kernel_schedule.py).
//
//   weights[layout][row class]  the software prefetch of a packed weight's blocks where the
//                               matmul streams them (below wide_min_rows rows): hint and bytes
//                               ahead; row class 0 is one row, 1 is 2 rows and more
//   attention_hint              the prefetch of the next tile's KV-cache rows in attention
//   attention_block_tokens      the keys decode attention reads per step of its walk (32, 64
//                               or 128: whole tiles, paged_attend.h); their scores are taken
//                               together, then each tile's softmax and P·V in order, so a
//                               row's arithmetic is the same at every size
//   wide_min_rows               from this many rows the matmul reads a 4-bit weight's wide
//                               form and (avx512 tier) the pairs kernel; at least 16, so a
//                               one-region forward (team_forward.h, up to 15 tokens) always
//                               streams
//   pairs_min_rows              (avx512 tier) from this many rows a streamed weight is read by
//                               the pairs kernel, two groups a 512-bit register, not one a
//                               256-bit one (both give the same bits)
//   amx_min_rows                (amx tiers) from this many rows the matmul runs on tiles
//   spin_us                     how long a one-region barrier spins before it sleeps
//   grain_bytes                 the weight bytes a matmul thread task takes at least
//   delta_net_strip_columns     the value columns of a DeltaNet state the recurrence carries
//                               through a sequence's tokens at once (8, 16, 32 or 64: W
//                               independent FMA chains of 8, delta_net.h); a column's sums are
//                               the same at every width
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include <torch/extension.h>

namespace schedule {

// A prefetch's hint is an immediate: a run-time choice is a switch over the four. Each case is
// its own asm statement: with `_mm_prefetch` in every case, GCC 12 at -O3 merged the cases of
// a switch inlined into a kernel's loop into one prefetch of a table-loaded hint, and then
// dropped it (no prefetch instruction was left in the matmul modules; the schedule's weight
// hints did nothing). An asm statement is neither merged nor dropped.
enum Hint : int32_t { kNone = 0, kNTA = 1, kT2 = 2, kT1 = 3, kT0 = 4 };

inline void prefetch(const void* address, int32_t hint) {
  const char* p = static_cast<const char*>(address);
  switch (hint) {
    case kNTA: asm volatile("prefetchnta %0" : : "m"(*p)); break;
    case kT2: asm volatile("prefetcht2 %0" : : "m"(*p)); break;
    case kT1: asm volatile("prefetcht1 %0" : : "m"(*p)); break;
    case kT0: asm volatile("prefetcht0 %0" : : "m"(*p)); break;
    default: break;
  }
}

struct Prefetch {
  int32_t hint;
  int32_t bytes;  // how far ahead of the block being read
};

// A matmul over more than 4 rows passes over each chunk of groups once per 4 rows: the first
// pass streams the chunk from memory, the later ones read it from L2, and the memory would
// idle through them. So the second pass asks for the next chunk's lines into L2, a block's
// worth with each block it reads (this distance, the chunk's bytes, ahead of it), and the next
// first pass finds them there (docs/benchmarks.md, "Many-row matmuls that keep the memory
// streaming"). Only where two chunks fit well within an L2, which each kernel's caller checks.
inline Prefetch next_chunk(int64_t chunk_bytes) { return {kT1, int32_t(chunk_bytes)}; }

constexpr int kNumLayouts = 6;  // gguf_blocks::Layout
constexpr int kRowClasses = 2;
constexpr int64_t kMinWideRows = 16;

inline int row_class(int64_t rows) { return rows <= 1 ? 0 : 1; }

struct Schedule {
  Prefetch weights[kNumLayouts][kRowClasses];
  int32_t attention_hint;
  int32_t attention_block_tokens;
  int64_t wide_min_rows;
  int64_t pairs_min_rows;
  int64_t amx_min_rows;
  int32_t spin_us;
  int64_t grain_bytes;
  int32_t delta_net_strip_columns;
};

// Today's constants, each chosen on a 2-core AMD EPYC (docs/benchmarks.md): non-temporal
// requests 1 KB ahead (Zen 1 and Zen 3's best), T1 for the KV rows, attention a tile (32
// keys) a step, the wide form from 16 rows, a 10 us spin, 16 KB tasks, DeltaNet strips of 32
// columns (delta_net.h).
inline Schedule defaults() {
  Schedule s{};
  for (auto& layout : s.weights)
    for (auto& rows : layout) rows = Prefetch{kNTA, 1024};
  s.attention_hint = kT1;
  s.attention_block_tokens = 32;
  s.wide_min_rows = kMinWideRows;
  s.pairs_min_rows = kMinWideRows;
  s.amx_min_rows = 16;  // below, a tile's fixed costs lose to vpdpbusd (cpu-tiers prototype)
  s.spin_us = 10;
  s.grain_bytes = 16384;
  s.delta_net_strip_columns = 32;
  return s;
}

inline Schedule& current() {
  static Schedule s = defaults();
  return s;
}

inline const Prefetch& weights(int layout, int64_t rows) {
  return current().weights[layout][row_class(rows)];
}

// As a flat list for Python: per layout, per row class, hint then bytes; then attention_hint,
// attention_block_tokens, wide_min_rows, pairs_min_rows, amx_min_rows, spin_us, grain_bytes,
// delta_net_strip_columns.
constexpr size_t kFlatSize = kNumLayouts * kRowClasses * 2 + 8;

inline std::vector<int64_t> flat(const Schedule& s) {
  std::vector<int64_t> out;
  for (const auto& layout : s.weights)
    for (const auto& rows : layout) {
      out.push_back(rows.hint);
      out.push_back(rows.bytes);
    }
  out.insert(out.end(), {s.attention_hint, s.attention_block_tokens, s.wide_min_rows,
                         s.pairs_min_rows, s.amx_min_rows, s.spin_us, s.grain_bytes,
                         s.delta_net_strip_columns});
  return out;
}

inline void set_flat(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == kFlatSize, "schedule: ", kFlatSize, " values expected, got ",
              v.size());
  Schedule s{};
  size_t i = 0;
  for (auto& layout : s.weights)
    for (auto& rows : layout) {
      TORCH_CHECK(v[i] >= kNone && v[i] <= kT0, "schedule: a prefetch hint is 0-4, got ", v[i]);
      TORCH_CHECK(v[i + 1] >= 0 && v[i + 1] <= (1 << 20),
                  "schedule: a prefetch distance is 0 to 1 MiB, got ", v[i + 1]);
      rows = Prefetch{int32_t(v[i]), int32_t(v[i + 1])};
      i += 2;
    }
  TORCH_CHECK(v[i] >= kNone && v[i] <= kT0, "schedule: attention_hint is 0-4, got ", v[i]);
  TORCH_CHECK(v[i + 1] == 32 || v[i + 1] == 64 || v[i + 1] == 128,
              "schedule: attention_block_tokens is 32, 64 or 128, got ", v[i + 1]);
  TORCH_CHECK(v[i + 2] >= kMinWideRows, "schedule: wide_min_rows is at least ", kMinWideRows,
              ", got ", v[i + 2]);
  TORCH_CHECK(v[i + 3] >= 1, "schedule: pairs_min_rows is at least 1, got ", v[i + 3]);
  TORCH_CHECK(v[i + 4] >= 1, "schedule: amx_min_rows is at least 1, got ", v[i + 4]);
  TORCH_CHECK(v[i + 5] >= 0 && v[i + 5] <= 100000, "schedule: spin_us is 0-100000, got ",
              v[i + 5]);
  TORCH_CHECK(v[i + 6] >= 1, "schedule: grain_bytes is at least 1, got ", v[i + 6]);
  TORCH_CHECK(v[i + 7] == 8 || v[i + 7] == 16 || v[i + 7] == 32 || v[i + 7] == 64,
              "schedule: delta_net_strip_columns is 8, 16, 32 or 64, got ", v[i + 7]);
  s.attention_hint = int32_t(v[i]);
  s.attention_block_tokens = int32_t(v[i + 1]);
  s.wide_min_rows = v[i + 2];
  s.pairs_min_rows = v[i + 3];
  s.amx_min_rows = v[i + 4];
  s.spin_us = int32_t(v[i + 5]);
  s.grain_bytes = v[i + 6];
  s.delta_net_strip_columns = int32_t(v[i + 7]);
  current() = s;
}

}  // namespace schedule
