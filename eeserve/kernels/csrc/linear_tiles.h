// eeserve CPU kernels: the linear kernels' tile loops, callable from other kernels.
//
// Contract: int8_tiles(a, lo, hi) computes output channels [32 lo, 32 hi) of every row of the
// int8 linear (int8_ops.cpp's layout and arithmetic, rows already rounded by int8_quantize_rows);
// f32_tiles the same for the float32 linear (f32_ops.cpp). Each writes a.y [M, N] with the bias
// added. Both are compiled once, in their own files: every caller (the ops themselves and
// decode_stack.cpp) runs the same code, so a channel's value does not depend on who computed it.

#pragma once

#include <cstdint>

namespace eeserve_linear {

constexpr int64_t TILE = 32;   // output channels per tile
constexpr int64_t CHUNK = 32;  // inputs per activation scale of the int8 kernel

struct Int8Args {
  const int16_t* xq;   // [M, Kp] activations rounded to int16
  const float* xs;     // [M, Kp / 32] their scales
  const int8_t* w;     // [blocks, Kp / 2, 16, 2]
  const float* scale;  // [blocks, groups, 16]
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N]
  int64_t M, Kp, N, groups;
};

struct F32Args {
  const float* x;     // [M, K]
  const float* w;     // [blocks, K, 16]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, K, N;
};

// Rows x [M, K] -> xq [M, Kp] and xs [M, Kp / 32] (Kp = K rounded up to 32).
void int8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* xs);
void int8_tiles(const Int8Args& a, int64_t lo, int64_t hi);
void f32_tiles(const F32Args& a, int64_t lo, int64_t hi);

}  // namespace eeserve_linear
