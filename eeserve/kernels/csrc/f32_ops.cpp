// eeserve CPU kernel: float32 linear for decode-sized row counts, y = x @ w^T + bias.
//
// Contract: x [M, K] float32 (contiguous rows); w the float32 weight [N, K] re-laid by
// eeserve/kernels/packing.py as [2 * ceil(N / 32), K, 16] (16 output channels side by side per
// input, zero past N); bias [N] float32 or absent; n = N. Returns [M, N] float32, equal to
// F.linear up to float summation order. Registered as torch.ops.eeserve.f32_linear.
//
// Why hand-written: a decode step reads every weight once, so at a few rows a linear is bound by
// memory, and oneDNN's packed float32 kernel read the default model's smaller projections at
// 19-30 GB/s of the ~45 GB/s that two cores can stream (docs/cpu-performance.md). Here each tile
// of 32 output channels streams its weights once for all rows, with software prefetch ahead of
// the stream; the same register tiling as the int8 kernel (int8_ops.cpp). AVX-512 and AVX2 (with
// FMA) each have their register tile; other CPUs run a plain loop that the compiler vectorises.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_tiles.h"
#include "tile_loop.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t CB = 16;  // output channels per block of the packed layout
constexpr int NV = 2;       // channel blocks per register tile (32 outputs)
#if defined(__AVX512F__)
constexpr int ROWS = 12;  // rows per tile: 2 * 12 accumulators + 2 weights of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int ROWS = 6;  // 2 * 6 accumulators + 2 weights + 1 input of 16 registers
#else
constexpr int ROWS = 12;
#endif
constexpr int64_t PF = 2048;  // bytes ahead of the current input that each block is prefetched

using LinearArgs = eeserve_linear::F32Args;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2's tile: the two blocks of 16 channels one after the other, each as two 8-lane halves, so
// that 6 rows' accumulators fit the 16 registers and a block's weights, read from L2 once per 6
// rows, serve 12 FMAs per input. One row alone keeps two accumulator sets over alternate inputs
// (4 independent FMA chains would leave the FMA latency exposed).
template <int MRT>
inline void avx2_tile(int64_t K, const float* w, const float* x, float out[MRT][NV * CB]) {
  constexpr int S = MRT == 1 ? 2 : 1;
  for (int v = 0; v < NV; ++v) {
    const float* wb = w + v * K * CB;
    __m256 acc[S][MRT][2];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < MRT; ++m) acc[s][m][0] = acc[s][m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + S <= K; k += S) {
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        const float* wk = wb + (k + s) * CB;  // one cache line per input
        _mm_prefetch(reinterpret_cast<const char*>(wk) + PF, _MM_HINT_T0);
        const __m256 lo = _mm256_loadu_ps(wk), hi = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 6
        for (int m = 0; m < MRT; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * K + k + s);
          acc[s][m][0] = _mm256_fmadd_ps(xv, lo, acc[s][m][0]);
          acc[s][m][1] = _mm256_fmadd_ps(xv, hi, acc[s][m][1]);
        }
      }
    }
    for (; k < K; ++k) {
      const __m256 lo = _mm256_loadu_ps(wb + k * CB), hi = _mm256_loadu_ps(wb + k * CB + 8);
      for (int m = 0; m < MRT; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
        acc[0][m][0] = _mm256_fmadd_ps(xv, lo, acc[0][m][0]);
        acc[0][m][1] = _mm256_fmadd_ps(xv, hi, acc[0][m][1]);
      }
    }
    for (int m = 0; m < MRT; ++m)
      for (int half = 0; half < 2; ++half) {
        __m256 sum = acc[0][m][half];
        for (int s = 1; s < S; ++s) sum = _mm256_add_ps(sum, acc[s][m][half]);
        _mm256_storeu_ps(out[m] + v * CB + 8 * half, sum);
      }
  }
}
#endif

// The register tile that tile_loop.h runs over rows and channels: out[m][v*16 + c] for MRT
// rows from m0 and the NV channel blocks from n0.
struct Kernel {
  using Args = LinearArgs;
  static constexpr int MR = ROWS;

  template <int MRT>
  static void tile(const Args& a, int64_t m0, int64_t n0, float out[MRT][NV * CB]) {
    const int64_t K = a.K;
    const float* w = a.w + n0 * K;  // NV blocks of [K, 16]
    const float* x = a.x + m0 * K;
#if defined(__AVX512F__)
    // Few rows leave too few independent FMA chains to hide their latency: then S accumulator
    // sets take turns over k and are summed at the end.
    constexpr int S = MRT == 1 ? 4 : (MRT == 2 ? 2 : 1);
    __m512 acc[S][MRT][NV];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < MRT; ++m)
        for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + S <= K; k += S) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        __m512 wv[NV];
        for (int v = 0; v < NV; ++v) {
          const float* wk = w + (v * K + k + s) * CB;  // one cache line per input and block
          _mm_prefetch(reinterpret_cast<const char*>(wk) + PF, _MM_HINT_T0);
          wv[v] = _mm512_loadu_ps(wk);
        }
#pragma GCC unroll 12
        for (int m = 0; m < MRT; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * K + k + s]);
          for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_fmadd_ps(xv, wv[v], acc[s][m][v]);
        }
      }
    }
    for (; k < K; ++k)
      for (int v = 0; v < NV; ++v) {
        const __m512 wv = _mm512_loadu_ps(w + (v * K + k) * CB);
        for (int m = 0; m < MRT; ++m)
          acc[0][m][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[0][m][v]);
      }
    for (int m = 0; m < MRT; ++m)
      for (int v = 0; v < NV; ++v) {
        __m512 sum = acc[0][m][v];
        for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[s][m][v]);
        _mm512_storeu_ps(out[m] + v * CB, sum);
      }
#elif defined(__AVX2__) && defined(__FMA__)
    avx2_tile<MRT>(K, w, x, out);
#else
    for (int m = 0; m < MRT; ++m)
      for (int i = 0; i < NV * CB; ++i) out[m][i] = 0.f;
    for (int64_t k = 0; k < K; ++k)
      for (int m = 0; m < MRT; ++m) {
        const float xk = x[m * K + k];
        for (int v = 0; v < NV; ++v)
          for (int i = 0; i < CB; ++i) out[m][v * CB + i] += xk * w[(v * K + k) * CB + i];
      }
#endif
  }
};

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == CB && x.size(1) == w.size(1),
              "f32_linear: x [M, K], w [blocks, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_linear: float32 x and contiguous float32 w");
  TORCH_CHECK(n > 0 && w.size(0) == (n + NV * CB - 1) / (NV * CB) * NV, "f32_linear: w [2 * ceil(N / 32), K, 16]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n}, xc.options());
  const LinearArgs a{xc.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), M, K, n};
  at::parallel_for(0, w.size(0) / NV, 1, [&](int64_t lo, int64_t hi) { eeserve_linear::f32_tiles(a, lo, hi); });
  return y;
}

}  // namespace

// Every range of tiles runs through this one compiled body, in a worker or inline (one thread,
// or one tile): with -ffast-math the loop inlined at two call sites could be compiled to two
// summation orders, and an output's value must not depend on how many tiles the call has
// (kernels/screened_head.py recomputes a few tiles of the LM head and needs the same bits).
__attribute__((noinline)) void eeserve_linear::f32_tiles(const F32Args& a, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t < hi; ++t) eeserve_tiles::channel_tile<Kernel>(a, t * NV * CB);
}

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("f32_linear", &f32_linear); }
