// The activation rows one call of a tile kernel serves: matmul_tiles.h's (8 outputs a row) and
// matmul_pairs_avx512.h's (16). One definition, so both walk the rows alike.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace tile_rows {

constexpr int TILE_M = 4;  // activation rows that share one unpacked weight block

struct RowPtrs {
  const int8_t* q[TILE_M];
  const float* d[TILE_M];
  const float* s[TILE_M];
  float* y[TILE_M];  // where the row's outputs go
  const int32_t* offset[TILE_M];  // block_offsets's for the row, where a kernel asks for them
};

// Rows r0 .. r0 + R - 1 of quantize_row's q [M, K], d and s [M, K / 32]; row r's outputs at
// y_of(r) (r counted from r0); `offsets`: block_offsets's, where the kernel takes them.
template <typename OutputOf>
inline RowPtrs rows_at(const int8_t* q, const float* d, const float* s, int64_t K, int64_t r0,
                       int R, OutputOf y_of, const int32_t* offsets = nullptr) {
  const int64_t KB = K / 32;
  RowPtrs rows;
  for (int r = 0; r < R; ++r) {
    rows.q[r] = q + (r0 + r) * K;
    rows.d[r] = d + (r0 + r) * KB;
    rows.s[r] = s + (r0 + r) * KB;
    rows.y[r] = y_of(r);
    rows.offset[r] = offsets == nullptr ? nullptr : offsets + (r0 + r) * KB;
  }
  return rows;
}

// -128 times the sums of q [M, K]'s blocks of 32 int8 values, [M, K / 32] (each value + 128
// is unsigned for the byte sums), where a kernel takes Q8_0's weights unsigned (matmul_tiles.h's
// s8_group): the block dot's chain starts from it, so the sums it adds are the exact sign-form
// ones. Once a call, not once per group of outputs.
inline std::vector<int32_t> block_offsets(const int8_t* q, int64_t M, int64_t K) {
  std::vector<int32_t> offsets(M * (K / 32));
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (size_t i = 0; i < offsets.size(); ++i) {
    const __m256i v = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * 32)), flip);
    const __m256i eights = _mm256_sad_epu8(v, _mm256_setzero_si256());  // four sums of 8
    __m128i total = _mm_add_epi64(_mm256_castsi256_si128(eights),
                                  _mm256_extracti128_si256(eights, 1));
    total = _mm_add_epi64(total, _mm_unpackhi_epi64(total, total));
    offsets[i] = -128 * (int32_t(_mm_cvtsi128_si64(total)) - 32 * 128);
  }
  return offsets;
}

}  // namespace tile_rows
