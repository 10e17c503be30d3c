// eeserve CPU kernels: the loop around a linear kernel's register tile, shared by f32_ops.cpp and
// int8_ops.cpp.
//
// Contract: a Kernel type provides Kernel::MR (rows per full tile), a nested Args with the fields
// y (float output [M, N]), bias (float [N] or nullptr), M and N, and
// template <int MRT> static void tile(const Args&, int64_t m0, int64_t n0, float out[MRT][32]),
// computing rows m0..m0+MRT against output channels n0..n0+32. channel_tile runs every row of x
// against one tile of 32 output channels (its weights stay in L1 across the row tiles), storing
// with bias and clipping to N.

#pragma once

#include <algorithm>
#include <cstdint>

namespace eeserve_tiles {

constexpr int64_t TILE_N = 32;

template <class Kernel, int MRT>
inline void rows_tile(const typename Kernel::Args& a, int64_t m0, int64_t n0) {
  float out[MRT][TILE_N];
  Kernel::template tile<MRT>(a, m0, n0, out);
  const int64_t n_end = std::min<int64_t>(n0 + TILE_N, a.N);
  for (int m = 0; m < MRT; ++m) {
    float* y = a.y + (m0 + m) * a.N;
    for (int64_t n = n0; n < n_end; ++n) y[n] = out[m][n - n0] + (a.bias ? a.bias[n] : 0.f);
  }
}

// The last M % MR rows: one tile of exactly that many rows (R counts down to it).
template <class Kernel, int R>
inline void rows_rest(const typename Kernel::Args& a, int64_t m0, int64_t rows, int64_t n0) {
  if constexpr (R > 0) {
    if (rows == R) return rows_tile<Kernel, R>(a, m0, n0);
    rows_rest<Kernel, R - 1>(a, m0, rows, n0);
  }
}

template <class Kernel>
inline void channel_tile(const typename Kernel::Args& a, int64_t n0) {
  int64_t m = 0;
  for (; m + Kernel::MR <= a.M; m += Kernel::MR) rows_tile<Kernel, Kernel::MR>(a, m, n0);
  if (m < a.M) rows_rest<Kernel, Kernel::MR - 1>(a, m, a.M - m, n0);
}

}  // namespace eeserve_tiles
