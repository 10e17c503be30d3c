// eeserve CPU kernels: linear layers and de-quantization on weights kept in GGUF block formats.
//
// Contract:
// - gguf_dequantize(w, type, k): w uint8 [N, row_bytes], each row K / QK blocks of ggml type
//   `type` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K: gguf_blocks.h) -> float32 [N, k], equal to
//   gguf.quants.dequantize bit for bit.
// - gguf_linear(x, w, type, out): x [M, K] float32, w as above -> writes out [M, N] (float32, unit
//   column stride, any row stride: a column slice of a wider output) = x @ dequantize(w)^T, the
//   weights de-quantized exactly as gguf_dequantize does, activations and sums float32 (no
//   activation rounding), so it equals F.linear on the de-quantized weights up to summation
//   order.
// - gguf_stacked_linear(x, blocks, parts, out): the same for parts stacked along the output (a
//   flat uint8 buffer and its parts table, gguf_linear.h), in one parallel region; gguf_linear is
//   its one-part case, and decode_stack and the layer ops call the same tile function.
//   Registered as torch.ops.eeserve.gguf_dequantize / gguf_linear / gguf_stacked_linear.
//
// Why two loops: at few rows a step reads the blocks once (~1/5 of float32's bytes) and decodes
// them once; each group of 32 weights is decoded in registers and used at once by every row
// (rows_direct). Exact float weights cost ~4-5 vector operations per 16 of them, so with ample
// bandwidth the decoding, not the reading, bounds the step (2-core Zen 4 VM at one row: 24 GB/s
// of blocks where float32 reads 47 GB/s). From FEW + 1 rows on, decoding the same weights for every row
// would bound the step by arithmetic: a tile of TN output channels is decoded once into a small
// per-thread float buffer (in L1/L2) and every row reads it from there (rows_tiled). With
// AVX-512 that tile is laid out as the float32 kernel's (f32_ops.cpp) and multiplied by it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "linear_tiles.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace eeserve_gguf;

constexpr int64_t FEW = 8;  // rows_direct up to this many rows
constexpr int64_t PF = 4096;  // bytes ahead of the direct loop's weights that are prefetched
#if defined(__AVX512F__)
constexpr int64_t TN = 32;  // channels per decoded tile: one tile of the float32 kernel
// Channels at once in rows_direct for MT rows: CH * MT accumulators + NW weights of 32 registers.
template <int MT> constexpr int CH = MT <= 4 ? 4 : 2;
#else
constexpr int64_t TN = 16;  // channels per decoded tile of rows_tiled
template <int MT> constexpr int CH = MT <= 4 ? 2 : 1;  // of 16 registers
constexpr int MR = 2;
constexpr int CT = 4;
#endif

struct Args {
  const float* x;   // [M, K]
  const uint8_t* w; // [N, row_bytes]
  float* y;         // [M, ldy]
  int64_t M, K, N, row_bytes, ldy;
};

// Channel n's group j (weights 32 j .. 32 j + 32) into registers.
template <class F>
inline void decode_group(const Args& a, int64_t n, int64_t j, V* w) {
  const int64_t per = F::QK / GROUP;
  F::decode(a.w + n * a.row_bytes + (j / per) * F::TYPE_SIZE, static_cast<int>(j % per), w);
}

// Channels [n0, n0 + C) for MT rows, weights decoded in registers once per group for all rows.
// The tile's rows are one contiguous run of bytes, and the next tiles' follow: each group step
// prefetches its share of the run PF bytes ahead into L2 (without it a core read the blocks at
// ~8 GB/s, latency-bound; the hint is harmless past the end).
template <class F, int C, int MT>
void direct_tile(const Args& a, int64_t n0) {
  V acc[C][MT];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MT; ++m) acc[c][m] = zero();
  const int64_t groups = a.K / GROUP, step = (C * a.row_bytes + groups - 1) / groups;
  const char* ahead = reinterpret_cast<const char*>(a.w + n0 * a.row_bytes) + PF;
  for (int64_t j = 0; j < groups; ++j) {
    for (int64_t b = j * step; b < (j + 1) * step; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    for (int c = 0; c < C; ++c) {
      V w[NW];
      decode_group<F>(a, n0 + c, j, w);
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < NW; ++v) acc[c][m] = fmadd(ldf(a.x + m * a.K + j * GROUP + v * L), w[v], acc[c][m]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MT; ++m) a.y[m * a.ldy + n0 + c] = hsum(acc[c][m]);
}

template <class F, int MT>
void rows_direct(const Args& a, int64_t lo, int64_t hi) {
  int64_t n = lo;
  for (; n + CH<MT> <= hi; n += CH<MT>) direct_tile<F, CH<MT>, MT>(a, n);
  for (; n < hi; ++n) direct_tile<F, 1, MT>(a, n);
}

#if defined(__AVX512F__)
// 16 rows of 16 floats -> their transpose (unpack within 128-bit lanes, then lanes across).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// Channels [n0, n0 + 16) (zero past N) decoded into the float32 kernel's layout: buf [K, 16],
// a column of the block the 16 channels' weights at one input.
template <class F>
void decode_block16(const Args& a, int64_t n0, float* buf) {
  alignas(64) float rows[16][GROUP];
  for (int64_t j = 0; j < a.K / GROUP; ++j) {
    for (int c = 0; c < 16; ++c) {
      V w[NW];
      if (n0 + c < a.N) decode_group<F>(a, n0 + c, j, w);
      for (int v = 0; v < NW; ++v) stf(rows[c] + v * L, n0 + c < a.N ? w[v] : zero());
    }
    for (int h = 0; h < GROUP / 16; ++h) {
      __m512 r[16];
      for (int c = 0; c < 16; ++c) r[c] = _mm512_load_ps(rows[c] + 16 * h);
      transpose16(r);
      for (int k = 0; k < 16; ++k) _mm512_storeu_ps(buf + (j * GROUP + 16 * h + k) * 16, r[k]);
    }
  }
}

// From FEW + 1 rows: each tile of 32 channels decoded once into the float32 kernel's layout
// (2 blocks of [K, 16], in L2) and multiplied by that kernel's own register tiles (f32_tiles),
// which need no horizontal sums.
template <class F>
void rows_tiled(const Args& a, int64_t lo, int64_t hi) {
  // This thread's decoded tile and its output, kept across calls: decode_stack calls this per task.
  thread_local std::vector<float> buf, y;
  buf.resize(2 * a.K * 16), y.resize(a.M * TN);
  const eeserve_linear::F32Args f{a.x, buf.data(), nullptr, y.data(), a.M, a.K, TN};
  for (int64_t n0 = lo; n0 < hi; n0 += TN) {
    decode_block16<F>(a, n0, buf.data());
    decode_block16<F>(a, n0 + 16, buf.data() + a.K * 16);
    eeserve_linear::f32_tiles(f, 0, 1);
    const int64_t chans = std::min(TN, hi - n0);
    for (int64_t m = 0; m < a.M; ++m)
      std::copy(y.data() + m * TN, y.data() + m * TN + chans, a.y + m * a.ldy + n0);
  }
}
#else
// Rows [m0, m0 + RT) against channels [c0, c0 + C) of the decoded tile buf [TN, K] (whose
// channel 0 is output n0).
template <int RT, int C>
inline void buffer_tile(const Args& a, const float* buf, int64_t m0, int64_t n0, int64_t c0) {
  V acc[RT][C];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t k = 0; k < a.K; k += L) {
    V w[C];
    for (int c = 0; c < C; ++c) w[c] = ldf(buf + (c0 + c) * a.K + k);
    for (int r = 0; r < RT; ++r) {
      const V xv = ldf(a.x + (m0 + r) * a.K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < C; ++c) a.y[(m0 + r) * a.ldy + n0 + c0 + c] = hsum(acc[r][c]);
}

template <int RT>
void buffer_rows(const Args& a, const float* buf, int64_t m0, int64_t n0, int64_t chans) {
  int64_t c = 0;
  for (; c + CT <= chans; c += CT) buffer_tile<RT, CT>(a, buf, m0, n0, c);
  for (; c < chans; ++c) buffer_tile<RT, 1>(a, buf, m0, n0, c);
}

// The last M % MR rows: one pass with exactly that many (R counts down to it).
template <int R>
void buffer_rest(const Args& a, const float* buf, int64_t m0, int64_t rows, int64_t n0, int64_t chans) {
  if constexpr (R > 0) {
    if (rows == R) return buffer_rows<R>(a, buf, m0, n0, chans);
    buffer_rest<R - 1>(a, buf, m0, rows, n0, chans);
  }
}

template <class F>
void rows_tiled(const Args& a, int64_t lo, int64_t hi) {
  thread_local std::vector<float> buf;  // this thread's decoded tile: TN channels of K weights
  buf.resize(TN * a.K);
  for (int64_t n0 = lo; n0 < hi; n0 += TN) {
    const int64_t chans = std::min(TN, hi - n0);
    for (int64_t c = 0; c < chans; ++c)
      for (int64_t j = 0; j < a.K / GROUP; ++j) {
        V w[NW];
        decode_group<F>(a, n0 + c, j, w);
        for (int v = 0; v < NW; ++v) stf(buf.data() + c * a.K + j * GROUP + v * L, w[v]);
      }
    int64_t m = 0;
    for (; m + MR <= a.M; m += MR) buffer_rows<MR>(a, buf.data(), m, n0, chans);
    if (m < a.M) buffer_rest<MR - 1>(a, buf.data(), m, a.M - m, n0, chans);
  }
}
#endif

// Channels [lo, hi) of every row: decoded in registers up to FEW rows, through a tile above.
template <class F>
void channels(const Args& a, int64_t lo, int64_t hi) {
  if (a.M > FEW) return rows_tiled<F>(a, lo, hi);
  switch (a.M) {
    case 1: return rows_direct<F, 1>(a, lo, hi);
    case 2: return rows_direct<F, 2>(a, lo, hi);
    case 3: return rows_direct<F, 3>(a, lo, hi);
    case 4: return rows_direct<F, 4>(a, lo, hi);
    case 5: return rows_direct<F, 5>(a, lo, hi);
    case 6: return rows_direct<F, 6>(a, lo, hi);
    case 7: return rows_direct<F, 7>(a, lo, hi);
    default: return rows_direct<F, 8>(a, lo, hi);
  }
  static_assert(FEW <= 8, "rows_direct is instantiated for 1..8 rows");
}

template <class F>
void run_dequantize(const Args& a, float* out) {
  at::parallel_for(0, a.N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n)
      for (int64_t j = 0; j < a.K / GROUP; ++j) {
        V w[NW];
        decode_group<F>(a, n, j, w);
        for (int v = 0; v < NW; ++v) stf(out + n * a.K + j * GROUP + v * L, w[v]);
      }
  });
}

// Calls fn with the Format struct of ggml type `type` (a clear error for any other).
template <class Fn>
void with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case Q4_0: return fn(FQ4_0{});
    case Q4_1: return fn(FQ4_1{});
    case Q5_0: return fn(FQ5_0{});
    case Q5_1: return fn(FQ5_1{});
    case Q8_0: return fn(FQ8_0{});
    case Q4_K: return fn(FQ4_K{});
    case Q6_K: return fn(FQ6_K{});
    default: TORCH_CHECK(false, "gguf: ggml type ", type, " is not supported (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K)");
  }
}

template <class F>
void check_rows(const at::Tensor& w, int64_t k) {
  TORCH_CHECK(k > 0 && k % F::QK == 0, "gguf: K = ", k, " is not a multiple of the block's ", F::QK);
  TORCH_CHECK(w.size(1) == k / F::QK * F::TYPE_SIZE, "gguf: a row of ", k, " weights is ",
              k / F::QK * F::TYPE_SIZE, " bytes, w has ", w.size(1));
}

void check_blocks(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf: w must be contiguous uint8 [N, row_bytes]");
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  check_blocks(w);
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(at::kFloat));
  with_format(type, [&](auto f) {
    using F = decltype(f);
    check_rows<F>(w, k);
    const Args a{nullptr, w.data_ptr<uint8_t>(), nullptr, 0, k, w.size(0), w.size(1), 0};
    run_dequantize<F>(a, out.data_ptr<float>());
  });
  return out;
}

// The parts' tiles [lo, hi) for the rows of x [M, K] into y [M, ldy].
void tiles_of(const eeserve_gguf_linear::Stacked& s, const float* x, int64_t M, float* y, int64_t ldy, int64_t lo,
              int64_t hi) {
  using eeserve_gguf_linear::TILE;
  for (const auto& p : s.parts) {
    const int64_t t0 = std::max(lo, p.first_tile), t1 = std::min(hi, p.first_tile + (p.rows + TILE - 1) / TILE);
    if (t0 >= t1) continue;
    const Args a{x, p.w, y + p.col, M, s.K, p.rows, p.row_bytes, ldy};
    const int64_t c0 = (t0 - p.first_tile) * TILE, c1 = std::min(p.rows, (t1 - p.first_tile) * TILE);
    with_format(p.type, [&](auto f) { channels<decltype(f)>(a, c0, c1); });
  }
}

// out [M, N] (unit column stride) = x [M, K] times the stacked parts, one parallel region.
void run_stacked(const eeserve_gguf_linear::Stacked& s, const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == s.K, "gguf_linear: x float32 [M, ",
              s.K, "]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == s.N,
              "gguf_linear: out float32 [M, ", s.N, "] with unit column stride");
  if (x.size(0) == 0) return;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t M = x.size(0), ldy = out.stride(0);
  at::parallel_for(0, s.tiles, 1, [&](int64_t lo, int64_t hi) { tiles_of(s, xp, M, y, ldy, lo, hi); });
}

void gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, at::Tensor out) {
  check_blocks(w);
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x float32 [M, K]");
  const at::Tensor parts = at::tensor({type, w.size(0)}, at::kLong).view({1, 2});
  run_stacked(eeserve_gguf_linear::read_stacked(w, parts, x.size(1)), x, out);
}

void gguf_stacked_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2, "gguf_stacked_linear: x float32 [M, K]");
  run_stacked(eeserve_gguf_linear::read_stacked(blocks, parts, x.size(1)), x, out);
}

}  // namespace

namespace eeserve_gguf_linear {

Stacked read_stacked(const at::Tensor& blocks, const at::Tensor& parts, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "gguf: blocks must be contiguous uint8");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 2 && parts.size(0) > 0 &&
                  parts.is_contiguous(),
              "gguf: parts int64 [P, 2] (ggml type, rows)");
  Stacked s;
  s.K = k;
  const int64_t* t = parts.data_ptr<int64_t>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  int64_t bytes = 0;
  for (int64_t i = 0; i < parts.size(0); ++i) {
    Part p{w + bytes, t[2 * i], t[2 * i + 1], 0, s.N, s.tiles};
    with_format(p.type, [&](auto f) {
      using F = decltype(f);
      TORCH_CHECK(k > 0 && k % F::QK == 0, "gguf: K = ", k, " is not a multiple of the block's ", F::QK);
      p.row_bytes = k / F::QK * F::TYPE_SIZE;
    });
    TORCH_CHECK(p.rows > 0, "gguf: a part of ", p.rows, " rows");
    bytes += p.rows * p.row_bytes, s.N += p.rows, s.tiles += (p.rows + TILE - 1) / TILE;
    s.parts.push_back(p);
  }
  TORCH_CHECK(blocks.numel() == bytes, "gguf: the parts' rows are ", bytes, " bytes, blocks has ", blocks.numel());
  return s;
}

void stacked_tiles(const Stacked& s, const float* x, int64_t M, float* y, int64_t ldy, int64_t lo, int64_t hi) {
  tiles_of(s, x, M, y, ldy, lo, hi);
}

}  // namespace eeserve_gguf_linear

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("gguf_dequantize(Tensor w, int type, int k) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor w, int type, Tensor(a!) out) -> ()");
  m.def("gguf_stacked_linear(Tensor x, Tensor blocks, Tensor parts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_stacked_linear", &gguf_stacked_linear);
}
