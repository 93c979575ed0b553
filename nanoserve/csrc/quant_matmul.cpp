// Matmuls straight from GGUF quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
// MXFP4), AVX2 + FMA + F16C;
// built again for each wider tier (native.py: avxvnni, avx512, amx), whose dot products and
// kernels (tier_*.h, matmul_pairs_avx512.h, matmul_amx.h) give the same bits from the same
// packed layout.
//
// y[M, N] = x[M, K] @ W[N, K]^T. W is repacked once, at load, into tiles of 8 output rows
// interleaved 4 bytes at a time, so that one 32-bit lane of a 256-bit register belongs to one
// output row: a block of 32 inputs times 8 rows is 8 `maddubs` whose sum is already the 8 dot
// products (no horizontal sums), then one int32 -> float conversion and one FMA with the
// 8 row scales times the activation scale. The activations are quantized once per call, per row
// into int8 blocks of 32 with a scale d_a and a scaled sum s_a = d_a * sum(q_a) (Q8_1-like);
// `w = d*q + m` formats (Q4_0, Q4_1, Q4_K and the 5-bit ones) add their offset term as m * s_a.
// MXFP4 keeps its 4-bit codes and looks their int8 values up per block (a byte shuffle), then
// multiplies them as Q8_0's.
// Each unpacked weight block serves up to 4 activation rows (TILE_M); threads split the
// output rows (at::parallel_for over 8-row groups).
//
// Packed block layouts: gguf_blocks.h.
//
// The 4- and 5-bit layouts also have a wide form (`widen`): the same block with its 128 nibble
// bytes (and 32 bytes of 5th bits) spread to 256 bytes, one value per byte in the order the
// kernel unpacks them (wq[0..7] in matmul_tiles.h), so a block is 8 loads instead of 4 loads
// and 12 shifts and masks (and 23 more for the 5th bits). Twice the bytes,
// for ~8% more multiply-adds per second where the kernel is bound by arithmetic, not memory:
// many activation rows (figures in quant_linear.py, which decides when a weight keeps one).
// The figures that chose this design are in nanoserve/model/quant_linear.py.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "gguf_blocks.h"
#include "instruction_peak.h"
#include "matmul_tiles.h"

namespace {

using namespace gguf_blocks;
using namespace matmul_tiles;

struct Acts {
  at::Tensor q, d, s;  // [M, K] int8, [M, K / 32] f32, [M, K / 32] f32
};

Acts quantize_acts(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  Acts a{at::empty({M, K}, at::kChar), at::empty({M, K / QK}, at::kFloat),
         at::empty({M, K / QK}, at::kFloat)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.q.data_ptr<int8_t>();
  float *dp = a.d.data_ptr<float>(), *sp = a.s.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * K, K, qp + r * K, dp + r * (K / QK), sp + r * (K / QK));
  });
  return a;
}

template <Layout L, bool Wide = false>
void matmul_layout(const uint8_t* packed, const Acts& acts, int64_t M, int64_t N, int64_t K,
                   float* y) {
  const int64_t G = (N + TILE_N - 1) / TILE_N;
  const int64_t group_bytes = K / QK * block_bytes<L, Wide>();
  const schedule::Schedule& plan = schedule::current();
  // at least the schedule's grain of weights per task (16 KB unless tuned), so that small
  // layers do not pay for a thread wake-up
  const int64_t grain =
      std::max<int64_t>(1, plan.grain_bytes / (group_bytes * std::max<int64_t>(1, M)));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    const int8_t* q = acts.q.data_ptr<int8_t>();
    const float *d = acts.d.data_ptr<float>(), *s = acts.s.data_ptr<float>();
    if (M < plan.wide_min_rows)
      matmul_groups<L, Wide, true>(packed, q, d, s, M, N, K, y, g0, g1);
    else matmul_groups<L, Wide, false>(packed, q, d, s, M, N, K, y, g0, g1);
  });
}

}  // namespace

// ---- Python entry points ------------------------------------------------------------------------

at::Tensor repack(const at::Tensor& raw, int64_t ggml_type, int64_t N, int64_t K) {
  check_raw(raw, ggml_type, N, K);
  const Layout layout = type_info(ggml_type).layout;
  const int64_t KB = K / QK, G = (N + TILE_N - 1) / TILE_N, bpb = packed_block_bytes(layout);
  const int64_t row_bytes = raw_row_bytes(ggml_type, K);
  at::Tensor packed = at::zeros({G, KB * bpb}, at::kByte);  // rows past N stay zero
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    Block32 blk;
    for (int64_t g = g0; g < g1; ++g)
      for (int i = 0; i < TILE_N && g * TILE_N + i < N; ++i)
        for (int64_t b = 0; b < KB; ++b) {
          const uint8_t* row = src + (g * TILE_N + i) * row_bytes;
          if (layout == Layout::L4F) {
            pack_mxfp4_block(row, b, i, dst + (g * KB + b) * bpb);
            continue;
          }
          decode_block(ggml_type, row, b, blk);
          pack_block(layout, blk, i, dst + (g * KB + b) * bpb);
        }
  });
  return packed;
}

// The wide form of a 4- or 5-bit packed weight (see the top of this file): the same blocks,
// each value in a byte of its own.
at::Tensor widen(const at::Tensor& packed, int64_t ggml_type, int64_t N, int64_t K) {
  check_packed(packed, ggml_type, N, K);
  const Layout layout = type_info(ggml_type).layout;
  TORCH_CHECK(is_unsigned(layout),
              "quant_matmul: only 4- and 5-bit formats (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) widen");
  const int64_t blocks = (N + TILE_N - 1) / TILE_N * (K / QK);
  const int64_t head = qs_offset(layout), bpb = packed_block_bytes(layout);
  at::Tensor wide = at::empty({blocks, head + 256}, at::kByte);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = wide.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* in = src + b * bpb;
      uint8_t* out = dst + b * (head + 256);
      std::memcpy(out, in, head);
      for (int64_t i = 0; i < 128; ++i) {  // as u4_group unpacks: low nibbles, then high
        const int t = int(i / 32);  // byte i holds inputs 4t+c (low) and 16+4t+c (high)
        const uint8_t high = is_u5(layout) ? in[high_bits_offset(layout) + i % 32] : 0;
        out[head + i] = uint8_t((in[head + i] & 0xF) | (((high >> t) & 1) << 4));
        out[head + 128 + i] = uint8_t((in[head + i] >> 4) | (((high >> (t + 4)) & 1) << 4));
      }
    }
  });
  return wide;
}

at::Tensor packed_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                         int64_t N, int64_t K, const std::optional<at::Tensor>& wide) {
  check_packed(packed, ggml_type, N, K);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) == K && x.is_contiguous(),
              "quant_matmul: x must be a contiguous float32 CPU tensor [M, ", K, "]");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, at::kFloat);
  if (M == 0) return y;
  const Acts acts = quantize_acts(x);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const Layout layout = type_info(ggml_type).layout;
  if (wide && M >= schedule::current().wide_min_rows && is_unsigned(layout)) {
    TORCH_CHECK(wide->device().is_cpu() && wide->scalar_type() == at::kByte &&
                    wide->is_contiguous() &&
                    wide->numel() == packed.numel() / packed_block_bytes(layout) *
                                         (qs_offset(layout) + 256),
                "quant_matmul: `wide` must be this packed weight's `widen` form");
    const uint8_t* ww = wide->data_ptr<uint8_t>();
    switch (layout) {
      case Layout::U4H: matmul_layout<Layout::U4H, true>(ww, acts, M, N, K, yp); break;
      case Layout::U4F: matmul_layout<Layout::U4F, true>(ww, acts, M, N, K, yp); break;
      case Layout::U5H: matmul_layout<Layout::U5H, true>(ww, acts, M, N, K, yp); break;
      default: matmul_layout<Layout::U5F, true>(ww, acts, M, N, K, yp); break;
    }
    return y;
  }
  switch (layout) {
    case Layout::U4H: matmul_layout<Layout::U4H>(w, acts, M, N, K, yp); break;
    case Layout::U4F: matmul_layout<Layout::U4F>(w, acts, M, N, K, yp); break;
    case Layout::U5H: matmul_layout<Layout::U5H>(w, acts, M, N, K, yp); break;
    case Layout::U5F: matmul_layout<Layout::U5F>(w, acts, M, N, K, yp); break;
    case Layout::S8H: matmul_layout<Layout::S8H>(w, acts, M, N, K, yp); break;
    case Layout::S8F2: matmul_layout<Layout::S8F2>(w, acts, M, N, K, yp); break;
    case Layout::L4F: matmul_layout<Layout::L4F>(w, acts, M, N, K, yp); break;
  }
  return y;
}

// Row ids for an embedding lookup: a contiguous 1-D int64 tensor, each in [0, N).
static const int64_t* checked_ids(const at::Tensor& ids, int64_t N) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "quant_rows: ids must be a contiguous 1-D int64 tensor");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(idp[r] >= 0 && idp[r] < N, "quant_rows: row id ", idp[r], " is outside [0, ", N, ")");
  return idp;
}

at::Tensor packed_rows(const at::Tensor& packed, int64_t ggml_type, const at::Tensor& ids,
                       int64_t N, int64_t K) {
  check_packed(packed, ggml_type, N, K);
  const Layout layout = type_info(ggml_type).layout;
  const int64_t KB = K / QK, bpb = packed_block_bytes(layout), num_ids = ids.size(0);
  const int64_t* idp = checked_ids(ids, N);
  at::Tensor out = at::empty({num_ids, K}, at::kFloat);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_ids, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = idp[r] / TILE_N;
      for (int64_t b = 0; b < KB; ++b)
        unpack_row(layout, w + (g * KB + b) * bpb, int(idp[r] % TILE_N), op + r * K + b * QK);
    }
  });
  return out;
}

at::Tensor quant_rows(const at::Tensor& raw, int64_t ggml_type, const at::Tensor& ids, int64_t K) {
  const int64_t row_bytes = raw_row_bytes(ggml_type, K);
  TORCH_CHECK(raw.numel() % row_bytes == 0, "quant_rows: the raw weight is not whole rows of ", K);
  const int64_t N = raw.numel() / row_bytes;
  check_raw(raw, ggml_type, N, K);
  const int64_t num_ids = ids.size(0);
  const int64_t* idp = checked_ids(ids, N);
  at::Tensor out = at::empty({num_ids, K}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_ids, 16, [&](int64_t r0, int64_t r1) {
    Block32 blk;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < K / QK; ++b) {
        decode_block(ggml_type, src + idp[r] * row_bytes, b, blk);
        float* o = op + r * K + b * QK;
        for (int e = 0; e < QK; ++e) o[e] = blk.d[e / 16] * float(blk.q[e]) + blk.m;
      }
  });
  return out;
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& raw, int64_t ggml_type, int64_t N,
                        int64_t K) {
  return packed_matmul(x, repack(raw, ggml_type, N, K), ggml_type, N, K, std::nullopt);
}

// The matmul as a dispatcher op too, for native code that chains the kernels (decode_layers.cpp).
// Registered when native.py asks, by the one tier the process runs: two tiers' modules may be
// loaded side by side (the tier tests compare them), and an op is defined once.
void register_ops() {
  static torch::Library* defs = nullptr;
  if (defs != nullptr) return;
  defs = new torch::Library(torch::Library::FRAGMENT, "nanoserve", std::nullopt, __FILE__,
                            __LINE__);
  defs->def("packed_matmul(Tensor x, Tensor packed, int ggml_type, int N, int K, Tensor? wide) "
            "-> Tensor");
  auto* impls = new torch::Library(torch::Library::IMPL, "nanoserve", c10::DispatchKey::CPU,
                                   __FILE__, __LINE__);
  impls->impl("packed_matmul", &packed_matmul);
}

#ifdef NANOSERVE_TIER_AMX
#include "amx_tests.h"  // the amx tiers' readiness, conformance and emulator entry points
#endif

#define NANOSERVE_STR(x) #x
#define NANOSERVE_TIER_NAME(x) NANOSERVE_STR(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("repack", &repack, "raw GGUF rows [N, row_bytes] -> the kernel's packed layout", nogil);
  m.def("packed_matmul", &packed_matmul,
        "x [M, K] f32 @ packed weight [N, K]^T -> [M, N]; `wide` (optional): its widen form",
        py::arg("x"), py::arg("packed"), py::arg("ggml_type"), py::arg("N"), py::arg("K"),
        py::arg("wide") = py::none(), nogil);
  m.def("widen", &widen, "a 4- or 5-bit packed weight with each value in a byte (the wide form)",
        nogil);
  m.def("packed_rows", &packed_rows, "rows ids of the packed weight, dequantized -> [len, K]", nogil);
  m.def("quant_matmul", &quant_matmul, "x [M, K] f32 @ raw GGUF weight [N, K]^T -> [M, N]", nogil);
  m.def("quant_rows", &quant_rows, "rows ids of the raw GGUF weight, dequantized -> [len, K]", nogil);
  m.def("kernel_peak", &instruction_peak::kernel_peak,
        "multiply-adds a second of the many-row kernel on data in L1, all threads",
        py::arg("ggml_type"), py::arg("rows"), py::arg("seconds"), nogil);
  m.def("multiply_peak", &instruction_peak::multiply_peak,
        "multiply-adds a second of maddubs chains in registers, all threads",
        py::arg("seconds"), nogil);
  m.def("register_ops", &register_ops, "define nanoserve::packed_matmul as this module's");
  m.def("get_schedule", [] { return schedule::flat(schedule::current()); },
        "this module's kernel schedule, flat (schedule.h)");
  m.def("set_schedule", &schedule::set_flat, "set this module's kernel schedule (flat)");
#ifdef NANOSERVE_TIER_AMX
  amx_tests::define(m);
#endif
  m.attr("cpu_tier") = NANOSERVE_TIER_NAME(NANOSERVE_CPU_TIER);  // the tier it was built for
}
