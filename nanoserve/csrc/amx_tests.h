// The amx tiers' Python entry points besides the matmul (quant_matmul.cpp defines them in a
// module built for `amx` or `amx-emu`):
//
//   amx_not_ready()      "" where tiles can run (the amx tier's CPUID, XCR0, palette and
//                        permission checks: amx_shim.h); always "" in amx-emu
//   tile_conformance(n)  "" where n random tile programs (shapes, bytes, the three signedness
//                        kinds) give the same bytes through the real instructions and through
//                        the emulator, else the first difference; "" in amx-emu (nothing to
//                        compare); native.py runs it before the amx tier is used
//   emu_*                the emulator's operations one at a time, with tile numbers as
//                        arguments, for its own tests (tests/model/test_amx_shim.py)
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <random>
#include <string>

#include "amx_shim.h"

namespace amx_tests {

namespace py = pybind11;
using amx_tile_config::TileConfig;

inline amx_emu::Signs signs_of(const std::string& kind) {
  if (kind == "su") return amx_emu::Signs::kSignedUnsigned;
  if (kind == "us") return amx_emu::Signs::kUnsignedSigned;
  if (kind == "ss") return amx_emu::Signs::kSignedSigned;
  TORCH_CHECK(kind == "uu", "emu_dot: kind is su, us, ss or uu, got ", kind);
  return amx_emu::Signs::kUnsignedUnsigned;
}

// The bytes a load or store at `offset` with `stride` touches: rows x colsb within `buffer`.
inline uint8_t* checked(const at::Tensor& buffer, int tile, int64_t offset, int64_t stride) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.is_contiguous() && buffer.dim() == 1,
              "the buffer must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(tile >= 0 && tile < amx_tile_config::kTiles, "no tile ", tile);
  const amx_emu::State& s = amx_emu::state();
  const int64_t rows = s.rows[tile], colsb = s.colsb[tile];
  if (rows > 0) {
    const int64_t first = offset + std::min<int64_t>(0, (rows - 1) * stride);
    const int64_t last = offset + std::max<int64_t>(0, (rows - 1) * stride) + colsb;
    TORCH_CHECK(first >= 0 && last <= buffer.numel(), "the tile's rows fall outside the buffer");
  }
  return buffer.data_ptr<uint8_t>() + offset;
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// One random program through both back ends: C (rows x N dwords) += A (rows x K dwords) x B
// (K rows x N dwords) of random bytes, stored; "" when the bytes agree.
inline std::string one_program(std::mt19937& rng) {
  const int rows = 1 + int(rng() % 16), k = 1 + int(rng() % 16), n = 1 + int(rng() % 16);
  const int kind = int(rng() % 3);
  TileConfig cfg;
  cfg.set(0, rows, 4 * n);
  cfg.set(1, rows, 4 * k);
  cfg.set(2, k, 4 * n);
  alignas(64) uint8_t a[16 * 64], b[16 * 64], c[16 * 64], native_out[16 * 64] = {},
      emulated_out[16 * 64] = {};
  for (auto* bytes : {a, b, c})
    for (int i = 0; i < 16 * 64; ++i) bytes[i] = uint8_t(rng());
  amx_native::load_config(cfg);
  amx_native::load<0>(c, 64);
  amx_native::load<1>(a, 64);
  amx_native::load<2>(b, 64);
  if (kind == 0) amx_native::dot_signed_unsigned<0, 1, 2>();
  else if (kind == 1) amx_native::dot_signed_signed<0, 1, 2>();
  else _tile_dpbusd(0, 1, 2);
  amx_native::store<0>(native_out, 64);
  amx_native::release();
  amx_emu::load_config(cfg);
  amx_emu::load(0, c, 64);
  amx_emu::load(1, a, 64);
  amx_emu::load(2, b, 64);
  amx_emu::dot(kind == 0 ? amx_emu::Signs::kSignedUnsigned
               : kind == 1 ? amx_emu::Signs::kSignedSigned : amx_emu::Signs::kUnsignedSigned,
               0, 1, 2);
  amx_emu::store(0, emulated_out, 64);
  amx_emu::release();
  if (std::memcmp(native_out, emulated_out, sizeof(native_out)) != 0)
    return "tile dot product " + std::to_string(kind) + " on " + std::to_string(rows) + "x" +
           std::to_string(k) + "x" + std::to_string(n) + " differs from the emulator's";
  return "";
}
#endif

inline void define(py::module_& m) {
  m.def("amx_not_ready", [] {
#if defined(NANOSERVE_AMX_EMU)
    return std::string();
#else
    return std::string(amx_native::not_ready());
#endif
  }, "\"\" where tiles can run here, else why not");
  m.def("tile_conformance", [](int64_t programs, int64_t seed) {
#if defined(NANOSERVE_AMX_EMU)
    (void)programs, (void)seed;
    return std::string();
#else
    std::mt19937 rng(static_cast<uint32_t>(seed));
    for (int64_t i = 0; i < programs; ++i) {
      std::string difference = one_program(rng);
      if (!difference.empty()) return difference;
    }
    return std::string();
#endif
  }, py::arg("programs") = 200, py::arg("seed") = 0,
        "random tile programs through the real instructions and the emulator: the first "
        "difference, or \"\"");
  m.def("emu_load_config", [](const at::Tensor& config) {
    TORCH_CHECK(config.scalar_type() == at::kByte && config.numel() == 64 &&
                    config.is_contiguous(), "emu_load_config: 64 contiguous uint8 bytes");
    TileConfig cfg;
    std::memcpy(&cfg, config.data_ptr<uint8_t>(), 64);
    amx_emu::load_config(cfg);
  });
  m.def("emu_load", [](int tile, const at::Tensor& src, int64_t offset, int64_t stride) {
    amx_emu::load(tile, checked(src, tile, offset, stride), stride);
  });
  m.def("emu_store", [](int tile, at::Tensor dst, int64_t offset, int64_t stride) {
    amx_emu::store(tile, checked(dst, tile, offset, stride), stride);
  });
  m.def("emu_zero", [](int tile) { amx_emu::zero(tile); });
  m.def("emu_dot", [](const std::string& kind, int c, int a, int b) {
    amx_emu::dot(signs_of(kind), c, a, b);
  });
  m.def("emu_release", [] { amx_emu::release(); });
  m.def("emu_tile", [](int tile) {
    TORCH_CHECK(tile >= 0 && tile < amx_tile_config::kTiles, "no tile ", tile);
    at::Tensor out = at::empty({16, 64}, at::kByte);
    std::memcpy(out.data_ptr<uint8_t>(), amx_emu::state().data[tile], 16 * 64);
    return out;
  }, "a tile's 16 x 64 bytes, as the emulator holds them");
  m.def("emu_tile_ops", [] { return amx_emu::state().tile_ops; },
        "the tile operations this thread has emulated");
}

}  // namespace amx_tests
