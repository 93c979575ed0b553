// The activation rows one call of a tile kernel serves: matmul_tiles.h's (8 outputs a row) and
// matmul_pairs_avx512.h's (16). One definition, so both walk the rows alike.
#pragma once

#include <cstdint>

namespace tile_rows {

constexpr int TILE_M = 4;  // activation rows that share one unpacked weight block

struct RowPtrs {
  const int8_t* q[TILE_M];
  const float* d[TILE_M];
  const float* s[TILE_M];
  float* y[TILE_M];  // where the row's outputs go
};

// Rows r0 .. r0 + R - 1 of quantize_row's q [M, K], d and s [M, K / 32]; row r's outputs at
// y_of(r) (r counted from r0).
template <typename OutputOf>
inline RowPtrs rows_at(const int8_t* q, const float* d, const float* s, int64_t K, int64_t r0,
                       int R, OutputOf y_of) {
  const int64_t KB = K / 32;
  RowPtrs rows;
  for (int r = 0; r < R; ++r) {
    rows.q[r] = q + (r0 + r) * K;
    rows.d[r] = d + (r0 + r) * KB;
    rows.s[r] = s + (r0 + r) * KB;
    rows.y[r] = y_of(r);
  }
  return rows;
}

}  // namespace tile_rows
