// eeserve CPU kernels: the GGUF block linear (gguf_ops.cpp) as other kernels call it.
//
// Contract: a Stacked projection is one or more parts stacked along the output, each a run of rows
// of one ggml type (a fused qkv or gate/up projection may mix formats: Q4_K_M files keep some
// rows in Q6_K), all of K inputs, their bytes one after another in one uint8 buffer. The parts
// table is int64 [P, 2]: (ggml type, rows) per part. read_stacked checks such a pair and returns
// its parts; stacked_tiles(s, x, M, y, ldy, lo, hi) computes output channels of tiles [lo, hi)
// (32 channels a tile, numbered part after part, each part's last tile clipped to its rows) for
// the M rows of x [M, K] into y [M, ldy] at the parts' columns, weights de-quantized exactly as
// gguf_dequantize does, float32 arithmetic, no bias. gguf_stacked_linear, decode_stack and the
// layer ops all run this one function, so a channel's value does not depend on who computed it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace eeserve_gguf_linear {

constexpr int64_t TILE = 32;  // output channels per tile (the float32 and int8 kernels' too)

struct Part {
  const uint8_t* w;   // [rows, row_bytes]
  int64_t type;       // ggml type
  int64_t rows, row_bytes;
  int64_t col;         // its first output channel
  int64_t first_tile;  // its first tile in the projection's numbering
};

struct Stacked {
  std::vector<Part> parts;
  int64_t K = 0, N = 0, tiles = 0;
};

// blocks: contiguous uint8 holding the parts' rows in order; parts: int64 [P, 2] (type, rows).
Stacked read_stacked(const at::Tensor& blocks, const at::Tensor& parts, int64_t k);

void stacked_tiles(const Stacked& s, const float* x, int64_t M, float* y, int64_t ldy, int64_t lo, int64_t hi);

}  // namespace eeserve_gguf_linear
