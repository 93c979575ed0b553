// The AMX tile operations the kernels use (matmul_amx.h), with two back ends:
//
//   amx_native  the real instructions (`_tile_*`, built with -mamx-tile -mamx-int8), with the
//               compiler barriers GCC 12 needs: its `_tile_loadconfig` declares an 8-byte read
//               of the 64-byte configuration and its `_tile_loadd` no memory read at all, so
//               stores into a configuration or a tile's source could be dropped or moved past
//               them (the configuration is also kept in a thread_local, never a temporary);
//   amx_emu     a scalar emulator written from Intel's manual (palette 1), always compiled:
//               8 tiles of 16 rows x 64 bytes per thread, rows and column bytes as configured,
//               every byte past them zero after each load and dot product, int32 sums that wrap,
//               and an abort naming the fault where the hardware faults (#GP: a configuration
//               it refuses; #UD: a tile operation before a configuration, on a tile it does not
//               configure, or on shapes that do not fit each other). Its dot products use
//               AVX-512 (vpdpbusd, or int16 products for signed x signed) where the module has
//               it: the same exact sums, faster tests.
//
// Only the int8 dot products (TDPBSUD, TDPBUSD, TDPBSSD): their int32 sums are exact, so the
// tiers keep the avx2 tier's bits. No bf16 tile operation belongs in a tier that must.
//
// `amx_tiles` is the back end the kernels call: amx_native in the `amx` tier's build,
// amx_emu in `amx-emu`'s (native.py sets NANOSERVE_AMX_EMU for it).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace amx_tile_config {

constexpr int kTiles = 8, kMaxRows = 16, kMaxColumnBytes = 64;

// LDTILECFG's 64 bytes (palette 1): bytes 16-31 the column bytes of tiles 0-7 as u16, bytes
// 48-55 their rows; every other byte but the palette (0) and start_row (1) reserved, zero.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved0[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int num_rows, int column_bytes) {
    rows[tile] = uint8_t(num_rows);
    colsb[tile] = uint16_t(column_bytes);
  }
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

}  // namespace amx_tile_config

namespace amx_emu {

using amx_tile_config::kMaxColumnBytes;
using amx_tile_config::kMaxRows;
using amx_tile_config::kTiles;
using amx_tile_config::TileConfig;

struct State {
  bool configured = false;
  uint16_t colsb[kTiles] = {};
  uint8_t rows[kTiles] = {};
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColumnBytes] = {};
  uint64_t tile_ops = 0;  // operations run on this thread (the tests see the emulator ran)
};

inline State& state() {
  static thread_local State s;
  return s;
}

[[noreturn]] inline void fault(const char* kind, const char* why) {
  std::fprintf(stderr, "amx_emu: %s: %s\n", kind, why);
  std::fflush(stderr);
  std::abort();
}

inline void clear(State& s) {
  std::memset(s.data, 0, sizeof(s.data));
}

// LDTILECFG: palette 0 is the initial state (nothing configured); palette 1 checks every field
// and zeroes every tile. What the hardware refuses with #GP is an abort here.
inline void load_config(const TileConfig& cfg) {
  State& s = state();
  ++s.tile_ops;
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(&cfg);
  if (cfg.palette > 1) fault("#GP", "palette above 1 (palette 1 is the only one)");
  for (int i = 2; i < 16; ++i)
    if (raw[i] != 0) fault("#GP", "a reserved byte (2-15) of the tile configuration is not 0");
  for (int i = 32; i < 48; ++i)
    if (raw[i] != 0) fault("#GP", "a reserved byte (32-47) of the tile configuration is not 0");
  for (int i = 56; i < 64; ++i)
    if (raw[i] != 0) fault("#GP", "a reserved byte (56-63) of the tile configuration is not 0");
  clear(s);
  if (cfg.palette == 0) {  // the initial state
    s.configured = false;
    std::memset(s.colsb, 0, sizeof(s.colsb));
    std::memset(s.rows, 0, sizeof(s.rows));
    return;
  }
  if (cfg.start_row != 0) fault("#GP", "start_row is not 0 (only a restarted load sets it)");
  for (int t = 0; t < kTiles; ++t) {
    if (cfg.colsb[t] > kMaxColumnBytes) fault("#GP", "a tile's column bytes exceed 64");
    if (cfg.rows[t] > kMaxRows) fault("#GP", "a tile's rows exceed 16");
    if ((cfg.colsb[t] == 0) != (cfg.rows[t] == 0))
      fault("#GP", "a tile has rows without column bytes, or column bytes without rows");
    s.colsb[t] = cfg.colsb[t];
    s.rows[t] = cfg.rows[t];
  }
  for (int t = kTiles; t < 16; ++t)
    if (cfg.colsb[t] != 0 || cfg.rows[t] != 0) fault("#GP", "tiles 8-15 do not exist");
  s.configured = true;
}

inline void release() {
  State& s = state();
  ++s.tile_ops;
  clear(s);
  s.configured = false;
  std::memset(s.colsb, 0, sizeof(s.colsb));
  std::memset(s.rows, 0, sizeof(s.rows));
}

inline void check_tile(const State& s, int t) {
  if (!s.configured) fault("#UD", "a tile operation before a tile configuration");
  if (t < 0 || t >= kTiles) fault("#UD", "no such tile");
  if (s.rows[t] == 0) fault("#UD", "a tile the configuration leaves unused");
}

// TILELOADD: row r from base + r * stride, the configured column bytes of it; the rest zero.
inline void load(int t, const void* base, int64_t stride) {
  State& s = state();
  ++s.tile_ops;
  check_tile(s, t);
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  const uint8_t* p = static_cast<const uint8_t*>(base);
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(s.data[t][r], p + r * stride, s.colsb[t]);
}

// TILESTORED: exactly rows x column bytes.
inline void store(int t, void* base, int64_t stride) {
  State& s = state();
  ++s.tile_ops;
  check_tile(s, t);
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(p + r * stride, s.data[t][r], s.colsb[t]);
}

inline void zero(int t) {
  State& s = state();
  ++s.tile_ops;
  check_tile(s, t);
  std::memset(s.data[t], 0, sizeof(s.data[t]));
}

// The dot products' signedness: of the first source (A) and the second (B).
enum class Signs { kSignedUnsigned, kUnsignedSigned, kSignedSigned, kUnsignedUnsigned };

inline int32_t byte_value(uint8_t b, bool is_signed) {
  return is_signed ? int32_t(int8_t(b)) : int32_t(b);
}

// dst.row[m].dword[n] += sum over k < K, i < 4 of A.row[m].byte[4k+i] * B.row[k].byte[4n+i],
// in int32 that wraps; the shape checks are the manual's #UD list.
inline void dot(Signs signs, int c, int a, int b) {
  State& s = state();
  ++s.tile_ops;
  check_tile(s, c);
  check_tile(s, a);
  check_tile(s, b);
  if (c == a || c == b || a == b) fault("#UD", "a dot product's tiles are not distinct");
  if (s.colsb[c] % 4 || s.colsb[a] % 4 || s.colsb[b] % 4)
    fault("#UD", "a dot product's tile has column bytes that are not a multiple of 4");
  const int M = s.rows[c], K = s.colsb[a] / 4, N = s.colsb[c] / 4;
  if (s.rows[a] != M) fault("#UD", "the destination's rows differ from the first source's");
  if (s.colsb[b] != s.colsb[c])
    fault("#UD", "the destination's column bytes differ from the second source's");
  if (s.rows[b] != K)
    fault("#UD", "the second source's rows differ from the first source's column dwords");
  const bool a_signed = signs == Signs::kSignedUnsigned || signs == Signs::kSignedSigned;
  const bool b_signed = signs == Signs::kUnsignedSigned || signs == Signs::kSignedSigned;
  for (int m = 0; m < M; ++m) {
    uint32_t* out = reinterpret_cast<uint32_t*>(s.data[c][m]);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (N == 16) {  // a full row: 16 dwords at once, the same exact sums
      __m512i acc = _mm512_loadu_si512(out);
      for (int k = 0; k < K; ++k) {
        const __m512i bk = _mm512_loadu_si512(s.data[b][k]);
        int32_t a4;
        std::memcpy(&a4, s.data[a][m] + 4 * k, 4);
        const __m512i ak = _mm512_set1_epi32(a4);
        if (signs == Signs::kSignedUnsigned) {
          acc = _mm512_dpbusd_epi32(acc, bk, ak);  // u8 (B) x s8 (A)
        } else if (signs == Signs::kUnsignedSigned) {
          acc = _mm512_dpbusd_epi32(acc, ak, bk);  // u8 (A) x s8 (B)
        } else {  // widen to int16: each product and each pair's sum exact in int32
          const auto widen = [&](__m512i v, bool is_signed, bool high) {
            const __m256i half = high ? _mm512_extracti64x4_epi64(v, 1)
                                      : _mm512_castsi512_si256(v);
            return is_signed ? _mm512_cvtepi8_epi16(half) : _mm512_cvtepu8_epi16(half);
          };
          for (int high = 0; high < 2; ++high) {
            // bytes 4n+i of 8 dwords (32 bytes) as int16, times A's 4 bytes repeated
            const __m512i prod = _mm512_madd_epi16(widen(bk, b_signed, high),
                                                   widen(ak, a_signed, high));
            // prod's dword j is bytes 2j, 2j+1 summed: add the two halves of each output
            const __m512i pairs = _mm512_add_epi32(
                prod, _mm512_srli_epi64(prod, 32));
            const __m512i sums = _mm512_maskz_compress_epi32(0x5555, pairs);  // 8 outputs
            const __m512i placed = high ? _mm512_alignr_epi32(sums, _mm512_setzero_si512(), 8)
                                        : sums;
            acc = _mm512_add_epi32(acc, _mm512_maskz_mov_epi32(high ? 0xFF00 : 0x00FF, placed));
          }
        }
      }
      _mm512_storeu_si512(out, acc);
      continue;
    }
#endif
    for (int n = 0; n < N; ++n) {
      uint32_t sum = out[n];
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < 4; ++i)
          sum += uint32_t(byte_value(s.data[a][m][4 * k + i], a_signed) *
                          byte_value(s.data[b][k][4 * n + i], b_signed));
      out[n] = sum;
    }
  }
}

}  // namespace amx_emu

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
namespace amx_native {

using amx_tile_config::TileConfig;

inline void compiler_barrier() { asm volatile("" ::: "memory"); }

inline void load_config(const TileConfig& cfg) {
  static thread_local TileConfig held;
  held = cfg;
  compiler_barrier();
  _tile_loadconfig(&held);
  compiler_barrier();
}

inline void release() { _tile_release(); }

// GCC's `_tile_*` paste their tile arguments into the instruction's text, so a tile number
// must be a literal there: each template dispatches to the literal at compile time.
#define NANOSERVE_TILE_CASES(T, CALL) \
  if constexpr (T == 0) CALL(0);         \
  else if constexpr (T == 1) CALL(1);    \
  else if constexpr (T == 2) CALL(2);    \
  else if constexpr (T == 3) CALL(3);    \
  else if constexpr (T == 4) CALL(4);    \
  else if constexpr (T == 5) CALL(5);    \
  else if constexpr (T == 6) CALL(6);    \
  else CALL(7)

template <int T>
inline void load(const void* base, int64_t stride) {
  compiler_barrier();  // the source's bytes are written before the load reads them
#define NANOSERVE_LOAD(t) _tile_loadd(t, base, stride)
  NANOSERVE_TILE_CASES(T, NANOSERVE_LOAD);
#undef NANOSERVE_LOAD
}

template <int T>
inline void store(void* base, int64_t stride) {
#define NANOSERVE_STORE(t) _tile_stored(t, base, stride)
  NANOSERVE_TILE_CASES(T, NANOSERVE_STORE);
#undef NANOSERVE_STORE
  compiler_barrier();
}

template <int T>
inline void zero() {
#define NANOSERVE_ZERO(t) _tile_zero(t)
  NANOSERVE_TILE_CASES(T, NANOSERVE_ZERO);
#undef NANOSERVE_ZERO
}

// The kernels use two sets of dot-product tiles: (0, 1, 2) and (3, 4, 5).
template <int C, int A, int B>
inline void dot_signed_unsigned() {
  static_assert((C == 0 && A == 1 && B == 2) || (C == 3 && A == 4 && B == 5),
                "tiles (0, 1, 2) or (3, 4, 5)");
  if constexpr (C == 0) _tile_dpbsud(0, 1, 2);
  else _tile_dpbsud(3, 4, 5);
}

template <int C, int A, int B>
inline void dot_signed_signed() {
  static_assert((C == 0 && A == 1 && B == 2) || (C == 3 && A == 4 && B == 5),
                "tiles (0, 1, 2) or (3, 4, 5)");
  if constexpr (C == 0) _tile_dpbssd(0, 1, 2);
  else _tile_dpbssd(3, 4, 5);
}

// XCR0's tile bits, the palette CPUID leaf 0x1D reports, and the kernel's permission for this
// process: "" when tiles can run, else why not.
inline const char* not_ready() {
  uint32_t eax, ebx, ecx, edx;
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return "CPUID lacks AMX-TILE or AMX-INT8";
  uint32_t xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0)";
  __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0x1D), "c"(0));
  if (eax < 1) return "CPUID leaf 0x1D reports no tile palette (a hypervisor that hides it)";
  constexpr long kRequestPermission = 0x1023, kGetPermission = 0x1022, kTileData = 18;
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0)
    return "the kernel refused the tile data permission (arch_prctl)";
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetPermission, &granted) != 0 ||
      !(granted & (1ul << kTileData)))
    return "the kernel did not grant the tile data permission";
  return "";
}

}  // namespace amx_native
#endif

// The emulator through the native API's shape (tile numbers as template arguments), so a kernel
// is written once against `amx_tiles`.
namespace amx_emu_api {

using amx_tile_config::TileConfig;

inline void load_config(const TileConfig& cfg) { amx_emu::load_config(cfg); }
inline void release() { amx_emu::release(); }

template <int T>
inline void load(const void* base, int64_t stride) { amx_emu::load(T, base, stride); }

template <int T>
inline void store(void* base, int64_t stride) { amx_emu::store(T, base, stride); }

template <int T>
inline void zero() { amx_emu::zero(T); }

template <int C, int A, int B>
inline void dot_signed_unsigned() { amx_emu::dot(amx_emu::Signs::kSignedUnsigned, C, A, B); }

template <int C, int A, int B>
inline void dot_signed_signed() { amx_emu::dot(amx_emu::Signs::kSignedSigned, C, A, B); }

}  // namespace amx_emu_api

#if defined(NANOSERVE_AMX_EMU)
namespace amx_tiles = amx_emu_api;
#elif defined(__AMX_TILE__) && defined(__AMX_INT8__)
namespace amx_tiles = amx_native;
#endif
