// GGUF block formats and the kernel's packed layout: decoding one block of 32 inputs,
// packing 8 weight rows into one interleaved group block, and the inverse (quant_matmul.cpp
// multiplies the packed form; its repack and widen entry points build it).
//
// Packed block layouts, per 8-row group and per 32 inputs (the Python side only stores them):
//   U4H (Q4_1):       f16 d[8], f16 m[8], 128 bytes of nibbles              160 bytes
//   U4F (Q4_0, Q4_K): f32 d[8], f32 m[8], 128 bytes of nibbles              192 bytes
//   U5H (Q5_1):       U4H's, then 32 bytes of 5th bits                      192 bytes
//   U5F (Q5_0, Q5_K): U4F's, then 32 bytes of 5th bits                      224 bytes
//   S8H (Q8_0):       f16 d[8], 256 int8                                    272 bytes
//   S8F2 (Q6_K):      f32 d[8] for inputs 0-15, f32 d[8] for 16-31, 256 int8 320 bytes
//   L4F (MXFP4):      f32 d[8] = 2^(e-128), 128 bytes of nibbles (codes)      160 bytes
// Nibble byte t*32 + i*4 + c holds row i's input 4t+c (low) and 16+4t+c (high); int8 byte
// t*32 + i*4 + c holds row i's input 4t+c; 5th-bit byte i*4 + c holds, in bit t (0-7), the
// 5th bit of row i's input 4t+c (the kernel ORs it into the value vector of those inputs with
// a shift and a mask). Scales are exact products of the file's scales, so dequantizing the
// packed form equals dequantizing the file (tests check it bit for bit).
// Q4_0 keeps its offset -8d as f32 (exact, and the f16 form would need an overflow check), and
// Q5_0 its offset -16d likewise: d*q + (-16d) is d*(q-16) exactly.
// L4F's nibbles are MXFP4 codes, not values: the kernel looks each up in kMxfp4Values (a byte
// shuffle) and multiplies the signed int8 value as Q8_0's are. Why nibbles and a lookup, not
// S8H's byte a value: a 20B gpt-oss must fit 24 GB, and one row streams the weights (160
// bytes a block against 288); why an f32 scale, not the file's E8M0 byte: 2^(e-128) is exact
// in f32 (e = 0 a subnormal) and then loads as U4F's scales do. The file's 16 nibble bytes are
// already in the U4 order (byte j: input j low, j+16 high), so repacking copies them.
//
// Why the 5-bit types keep a nibble and a bit, not a byte a value (Q5_0 fits S8H exactly):
// one row streams the weights from memory, and S8H reads 272 bytes a block against U5F's 224.
// Measured one thread, one row over 73-89 MB of weights: Q5_0 as U5F 12-18 GMAC/s, Q8_0 (S8H)
// 12.4-12.5; in cache S8H wins at one row (35 against 28: ~24 more instructions a block for
// the 5th bits) and loses from 4 rows on (45 against 54). From 16 rows the wide form (a byte a
// value) is used: 1.45x the nibbles and bits at 64 rows on avx2, 1.17x on avx512.
// Figures: docs/benchmarks.md, "The 5-bit types in the kernel".
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace gguf_blocks {

constexpr int GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8;
constexpr int GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_MXFP4 = 39;
constexpr int QK = 32;     // inputs per kernel block
constexpr int TILE_N = 8;  // output rows interleaved in one packed group

enum class Layout { U4H, U4F, U5H, U5F, S8H, S8F2, L4F };

// MXFP4's values of its 16 codes: 2 * E2M1 (bit 3 the sign), times 2^(e-128) a block.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

struct TypeInfo {
  int block_elems;  // inputs per GGUF block
  int block_bytes;  // bytes per GGUF block
  Layout layout;
};

inline TypeInfo type_info(int64_t ggml_type) {
  switch (ggml_type) {
    case GGML_Q8_0: return {32, 34, Layout::S8H};
    case GGML_Q4_0: return {32, 18, Layout::U4F};
    case GGML_Q4_1: return {32, 20, Layout::U4H};
    case GGML_Q4_K: return {256, 144, Layout::U4F};
    case GGML_Q6_K: return {256, 210, Layout::S8F2};
    case GGML_Q5_0: return {32, 22, Layout::U5F};
    case GGML_Q5_1: return {32, 24, Layout::U5H};
    case GGML_Q5_K: return {256, 176, Layout::U5F};
    case GGML_MXFP4: return {32, 17, Layout::L4F};
    default:
      TORCH_CHECK(false, "quant_matmul: ggml type ", ggml_type,
                  " is not supported (Q8_0=8, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q4_K=12, "
                  "Q5_K=13, Q6_K=14, MXFP4=39)");
  }
}

constexpr int64_t packed_block_bytes(Layout layout) {
  switch (layout) {
    case Layout::U4H: return 160;
    case Layout::U4F: return 192;
    case Layout::U5H: return 192;
    case Layout::U5F: return 224;
    case Layout::S8H: return 272;
    case Layout::L4F: return 160;
    default: return 320;
  }
}

// The kernel schedule's prefetch slot of a layout (schedule.h tunes one per layout): L4F
// streams 160-byte blocks of nibbles as U4H does, and shares its slot.
constexpr int schedule_slot(Layout layout) {
  return layout == Layout::L4F ? int(Layout::U4H) : int(layout);
}

constexpr bool is_u4(Layout layout) { return layout == Layout::U4H || layout == Layout::U4F; }
constexpr bool is_u5(Layout layout) { return layout == Layout::U5H || layout == Layout::U5F; }
// the layouts of w = d*q + m with q >= 0 in nibbles (and 5th bits): the ones with a wide form
constexpr bool is_unsigned(Layout layout) { return is_u4(layout) || is_u5(layout); }
// signed q with one scale a block (Q8_0, MXFP4's looked-up values): where a tier has
// `vpdpbusd`, their products go in the unsigned-weight form (matmul_tiles.h's s8_group)
constexpr bool has_unsigned_form(Layout layout) {
  return layout == Layout::S8H || layout == Layout::L4F;
}
// f16 scales (and offsets) at the block's start, else f32
constexpr bool has_f16_scales(Layout layout) {
  return layout == Layout::U4H || layout == Layout::U5H || layout == Layout::S8H;
}

// A block's bytes before its quantized values: the scales (and offsets).
constexpr int64_t qs_offset(Layout layout) {
  return layout == Layout::U4H || layout == Layout::U5H || layout == Layout::L4F ? 32
         : layout == Layout::S8H                                                 ? 16
                                                                                 : 64;
}

// Where a 5-bit layout's 5th bits start: after the nibbles.
constexpr int64_t high_bits_offset(Layout layout) { return qs_offset(layout) + 128; }

// Bytes per packed block, in the wide form (nibble layouts only) or the plain one.
template <Layout L, bool Wide>
constexpr int64_t block_bytes() {
  return Wide ? qs_offset(L) + 256 : packed_block_bytes(L);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- decoding one GGUF block of 32 inputs -------------------------------------------------------

// One 32-input block in the common form: value e = d[e / 16] * q[e] + m.
struct Block32 {
  int8_t q[QK];     // 0..15 (0..31) for the 4-bit (5-bit) formats, signed for Q8_0 / Q6_K
  float d[2];       // scale of inputs 0-15 and 16-31 (equal except for Q6_K)
  float m;          // offset (0 for the symmetric formats)
  uint8_t d_f16[2]; // the file's f16 scale and offset, for the f16 layouts
  uint8_t m_f16[2];
};

inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Block b of a row of Q4_0, Q4_1, Q5_0 or Q5_1: f16 d, (f16 m), (uint32 qh: input e's 5th bit in
// bit e), 16 bytes of nibbles (inputs 0-15 low, 16-31 high).
inline void decode_q4_q5_block(int64_t type, const uint8_t* row, int64_t b, Block32& out) {
  const bool has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
  const bool has_5th_bit = type == GGML_Q5_0 || type == GGML_Q5_1;
  const uint8_t* blk = row + b * (18 + 2 * has_min + 4 * has_5th_bit);
  const uint8_t* qs = blk + 2 + 2 * has_min + 4 * has_5th_bit;
  const uint32_t qh = has_5th_bit ? uint32_t(load_i32(blk + 2 + 2 * has_min)) : 0;
  std::memcpy(out.d_f16, blk, 2);
  out.d[0] = out.d[1] = f16(blk);
  if (has_min) {
    std::memcpy(out.m_f16, blk + 2, 2);
    out.m = f16(blk + 2);
  } else {  // d * (q - 8) == d * q + (-8 d), all exact in f32 (and -16 d for 5 bits)
    out.m = (has_5th_bit ? -16.f : -8.f) * out.d[0];
  }
  for (int e = 0; e < 16; ++e) {
    out.q[e] = int8_t((qs[e] & 0xF) | (((qh >> e) & 1) << 4));
    out.q[e + 16] = int8_t((qs[e] >> 4) | (((qh >> (e + 16)) & 1) << 4));
  }
}

// Block b of a row of Q4_K or Q5_K: super-blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit
// scales and mins, (Q5_K: 32 bytes qh, sub-block j's 5th bits in bit j), 128 bytes of nibbles).
inline void decode_k_block(int64_t type, const uint8_t* row, int64_t b, Block32& out) {
  const bool has_5th_bit = type == GGML_Q5_K;
  const uint8_t* sb = row + (b / 8) * (has_5th_bit ? 176 : 144);
  const int j = b % 8;
  int sc, mn;
  q4k_scale_min(sb + 4, j, sc, mn);
  out.d[0] = out.d[1] = f16(sb) * float(sc);  // exact: 11 + 6 bits
  out.m = -(f16(sb + 2) * float(mn));
  const uint8_t* qh = sb + 16;
  const uint8_t* qs = sb + (has_5th_bit ? 48 : 16) + (j / 2) * 32;
  const int shift = (j % 2) * 4;
  for (int e = 0; e < QK; ++e) {
    const int high = has_5th_bit ? ((qh[e] >> j) & 1) << 4 : 0;
    out.q[e] = int8_t(((qs[e] >> shift) & 0xF) | high);
  }
}

// MXFP4's E8M0 scale halved, 2^(e-128), exactly (ggml's ggml_e8m0_to_fp32_half: e = 0 and 1
// are subnormals).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// Block b (of 32 inputs) of one weight row's raw GGUF bytes.
inline void decode_block(int64_t type, const uint8_t* row, int64_t b, Block32& out) {
  out.m = 0.f;
  switch (type) {
    case GGML_MXFP4: {  // uint8 e, 16 bytes of codes (inputs 0-15 low, 16-31 high)
      const uint8_t* blk = row + b * 17;
      out.d[0] = out.d[1] = e8m0_half(blk[0]);
      for (int e = 0; e < 16; ++e) {
        out.q[e] = kMxfp4Values[blk[1 + e] & 0xF];
        out.q[e + 16] = kMxfp4Values[blk[1 + e] >> 4];
      }
      return;
    }
    case GGML_Q8_0: {
      const uint8_t* blk = row + b * 34;
      std::memcpy(out.d_f16, blk, 2);
      out.d[0] = out.d[1] = f16(blk);
      std::memcpy(out.q, blk + 2, QK);
      return;
    }
    case GGML_Q4_0:
    case GGML_Q4_1:
    case GGML_Q5_0:
    case GGML_Q5_1:
      return decode_q4_q5_block(type, row, b, out);
    case GGML_Q4_K:
    case GGML_Q5_K:
      return decode_k_block(type, row, b, out);
    case GGML_Q6_K: {
      const uint8_t* sb = row + (b / 8) * 210;
      const int j = b % 8;
      const uint8_t* ql = sb;
      const uint8_t* qh = sb + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
      const float d = f16(sb + 208);
      out.d[0] = d * float(sc[2 * j]);
      out.d[1] = d * float(sc[2 * j + 1]);
      for (int e = 0; e < QK; ++e) {
        const int idx = 32 * j + e, half = idx / 128, r = idx % 128;
        const int lo = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
        const int hi = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 0x3;
        out.q[e] = int8_t((lo | (hi << 4)) - 32);
      }
      return;
    }
    default:
      type_info(type);  // throws
  }
}

// ---- repacking ----------------------------------------------------------------------------------

// Block b of one row into its slot i (0-7) of the packed group block at dst (every layout but
// L4F, whose blocks keep the file's codes: pack_mxfp4_block).
inline void pack_block(Layout layout, const Block32& blk, int i, uint8_t* dst) {
  if (has_f16_scales(layout)) {
    std::memcpy(dst + 2 * i, blk.d_f16, 2);
    if (layout != Layout::S8H) std::memcpy(dst + 16 + 2 * i, blk.m_f16, 2);
  } else {
    std::memcpy(dst + 4 * i, &blk.d[0], 4);
    std::memcpy(dst + 32 + 4 * i, layout == Layout::S8F2 ? &blk.d[1] : &blk.m, 4);
  }
  uint8_t* qs = dst + qs_offset(layout);
  if (is_unsigned(layout)) {
    for (int t = 0; t < 4; ++t)
      for (int c = 0; c < 4; ++c)
        qs[t * 32 + i * 4 + c] =
            uint8_t((blk.q[4 * t + c] & 0xF) | ((blk.q[16 + 4 * t + c] & 0xF) << 4));
  } else {
    for (int t = 0; t < 8; ++t)
      for (int c = 0; c < 4; ++c) qs[t * 32 + i * 4 + c] = uint8_t(blk.q[4 * t + c]);
  }
  if (is_u5(layout)) {
    for (int c = 0; c < 4; ++c) {
      uint8_t bits = 0;
      for (int t = 0; t < 8; ++t) bits |= uint8_t(((blk.q[4 * t + c] >> 4) & 1) << t);
      dst[high_bits_offset(layout) + i * 4 + c] = bits;
    }
  }
}

// Block b of an MXFP4 row into its slot i (0-7) of the L4F group block at dst: the scale, and
// the file's code bytes as they are (byte 4t + c to t*32 + i*4 + c: already the U4 order).
inline void pack_mxfp4_block(const uint8_t* row, int64_t b, int i, uint8_t* dst) {
  const uint8_t* blk = row + b * 17;
  const float d = e8m0_half(blk[0]);
  std::memcpy(dst + 4 * i, &d, 4);
  for (int t = 0; t < 4; ++t)
    std::memcpy(dst + qs_offset(Layout::L4F) + t * 32 + i * 4, blk + 1 + 4 * t, 4);
}

// Row i of a packed group block, dequantized: the exact inverse of pack_block (and of
// pack_mxfp4_block).
inline void unpack_row(Layout layout, const uint8_t* blk, int i, float* out) {
  const uint8_t* qs = blk + qs_offset(layout);
  if (layout == Layout::L4F) {
    float d;
    std::memcpy(&d, blk + 4 * i, 4);
    for (int e = 0; e < 16; ++e) {
      const uint8_t byte = qs[(e / 4) * 32 + i * 4 + e % 4];
      out[e] = d * float(kMxfp4Values[byte & 0xF]);
      out[e + 16] = d * float(kMxfp4Values[byte >> 4]);
    }
    return;
  }
  float d0, d1, m = 0.f;
  if (has_f16_scales(layout)) {
    d0 = d1 = f16(blk + 2 * i);
    if (layout != Layout::S8H) m = f16(blk + 16 + 2 * i);
  } else {
    std::memcpy(&d0, blk + 4 * i, 4);
    std::memcpy(&d1, blk + 32 + 4 * i, 4);
    if (layout != Layout::S8F2) {
      m = d1;
      d1 = d0;
    }
  }
  if (is_unsigned(layout)) {
    const uint8_t* high = blk + high_bits_offset(layout) + i * 4;
    for (int e = 0; e < 16; ++e) {
      const uint8_t byte = qs[(e / 4) * 32 + i * 4 + e % 4];
      int lo = byte & 0xF, hi = byte >> 4;
      if (is_u5(layout)) {  // inputs e and e + 16: bits e / 4 and e / 4 + 4
        lo |= ((high[e % 4] >> (e / 4)) & 1) << 4;
        hi |= ((high[e % 4] >> (e / 4 + 4)) & 1) << 4;
      }
      out[e] = d0 * float(lo) + m;
      out[e + 16] = d0 * float(hi) + m;
    }
  } else {
    for (int e = 0; e < QK; ++e) {
      const int8_t q = int8_t(qs[(e / 4) * 32 + i * 4 + e % 4]);
      out[e] = (e < 16 ? d0 : d1) * float(q);
    }
  }
}

inline void check_shapes(int64_t ggml_type, int64_t N, int64_t K) {
  const TypeInfo info = type_info(ggml_type);
  TORCH_CHECK(N > 0 && K > 0 && K % info.block_elems == 0, "quant_matmul: K=", K,
              " must be a positive multiple of ", info.block_elems, " for ggml type ", ggml_type);
}

inline int64_t raw_row_bytes(int64_t ggml_type, int64_t K) {
  const TypeInfo info = type_info(ggml_type);
  return K / info.block_elems * info.block_bytes;
}

inline void check_raw(const at::Tensor& raw, int64_t ggml_type, int64_t N, int64_t K) {
  check_shapes(ggml_type, N, K);
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "quant_matmul: the raw weight must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(raw.numel() == N * raw_row_bytes(ggml_type, K), "quant_matmul: the raw weight has ",
              raw.numel(), " bytes, but ", N, " rows of ", K, " inputs need ",
              N * raw_row_bytes(ggml_type, K));
}

inline void check_packed(const at::Tensor& packed, int64_t ggml_type, int64_t N, int64_t K) {
  check_shapes(ggml_type, N, K);
  const int64_t expected = (N + TILE_N - 1) / TILE_N * (K / QK) *
                           packed_block_bytes(type_info(ggml_type).layout);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous() && packed.numel() == expected,
              "quant_matmul: the packed weight must be a contiguous CPU uint8 tensor of ", expected,
              " bytes (from repack) for N=", N, ", K=", K);
}

}  // namespace gguf_blocks
