// eeserve CPU kernel: weight-only int8 linear, y = x @ (w * scale[:, None])^T + bias.
//
// Contract: x [M, K] float32 or bfloat16; w the int8 weight [N, K] re-laid by
// eeserve/kernels/quant.py as [2 * ceil(N / 32), K, 16] (16 output channels side by side per k,
// zero past N); scale the float32 scales of groups of G = K / groups consecutive inputs, laid out
// [2 * ceil(N / 32), groups, 16] the same way; bias [N] float32 or absent; n = N. Returns [M, N] in
// x's dtype. Each group's sum runs in float32 over the exact int8 values and is scaled once, so the
// result equals ``F.linear(x.float(), q.float() * scale_per_weight)`` up to float summation order:
// the activations are never quantised. Registered as torch.ops.eeserve.int8_linear (native.py builds it with
// cpu_ops.cpp).
//
// Why hand-written: decode is memory-bound at small row counts, and int8 weights are a quarter of
// float32's bytes; PyTorch's own int8 weight-only matmul (aten._weight_int8pack_mm) has a vector
// kernel for bfloat16 activations only. The layout makes one k step of a 16-channel block one
// 16-byte load, widened to a float32 vector and multiplied by a broadcast activation: no horizontal
// sums, and the widening is shared by up to MR activation rows (a register tile, like a GEMM
// micro-kernel). AVX-512 where the compiler targets it (-march=native); elsewhere a plain loop over
// the 16 lanes that the compiler vectorises for the machine (AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t CB = 16;  // output channels per block of the packed layout
constexpr int NV = 2;       // channel blocks per register tile (32 outputs)
constexpr int MR = 12;      // activation rows per register tile: 2 * 12 accumulators + 2 weights

// out[m][v*16 + c] = sum_g scale[v][g][c] * sum_{k in group g} x[m, k] * w[v][k][c] for MRT rows
// and NV channel blocks. x rows are K apart; w points at NV consecutive blocks of [K, 16]; sc at
// their scales, [NV][groups][16]; each group is G consecutive k (G * groups == K).
template <int MRT>
inline void tile(const float* x, int64_t K, const int8_t* w, const float* sc, int64_t G,
                 float out[MRT][NV * CB]) {
  const int64_t groups = K / G;
#if defined(__AVX512F__)
  // Few rows leave too few independent FMA chains to hide their latency: then S accumulator sets
  // take turns over k and are summed at the end of each group.
  constexpr int S = MRT == 1 ? 4 : (MRT == 2 ? 2 : 1);
  __m512 total[MRT][NV];
  for (int m = 0; m < MRT; ++m)
    for (int v = 0; v < NV; ++v) total[m][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[S][MRT][NV];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < MRT; ++m)
        for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_setzero_ps();
    const int64_t k_end = (g + 1) * G;
    int64_t k = g * G;
    for (; k + S <= k_end; k += S) {
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        __m512 wv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (v * K + k + s) * CB));
          wv[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        }
#pragma GCC unroll 12
        for (int m = 0; m < MRT; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * K + k + s]);
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_fmadd_ps(xv, wv[v], acc[s][m][v]);
        }
      }
    }
    for (; k < k_end; ++k)  // S > 1 only: the group's last G % S steps
      for (int v = 0; v < NV; ++v) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (v * K + k) * CB));
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        for (int m = 0; m < MRT; ++m)
          acc[0][m][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[0][m][v]);
      }
    for (int v = 0; v < NV; ++v) {
      const __m512 scv = _mm512_loadu_ps(sc + (v * groups + g) * CB);
      for (int m = 0; m < MRT; ++m) {
        __m512 sum = acc[0][m][v];
        for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[s][m][v]);
        total[m][v] = _mm512_fmadd_ps(sum, scv, total[m][v]);
      }
    }
  }
  for (int m = 0; m < MRT; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[m] + v * CB, total[m][v]);
#else
  for (int m = 0; m < MRT; ++m)
    for (int c = 0; c < NV * CB; ++c) out[m][c] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float acc[MRT][NV * CB] = {};
    for (int64_t k = g * G; k < (g + 1) * G; ++k)
      for (int m = 0; m < MRT; ++m) {
        const float xk = x[m * K + k];
        for (int v = 0; v < NV; ++v)
          for (int c = 0; c < CB; ++c)
            acc[m][v * CB + c] += xk * static_cast<float>(w[(v * K + k) * CB + c]);
      }
    for (int m = 0; m < MRT; ++m)
      for (int v = 0; v < NV; ++v)
        for (int c = 0; c < CB; ++c)
          out[m][v * CB + c] += acc[m][v * CB + c] * sc[(v * groups + g) * CB + c];
  }
#endif
}

struct Args {
  const float* x;
  const int8_t* w;
  const float* scale;  // [blocks, groups, 16]
  const float* bias;
  float* y;
  int64_t M, K, N, G;
};

// Rows m0..m0+MRT against output channels n0..n0+32 (clipped to N on store).
template <int MRT>
inline void rows_tile(const Args& a, int64_t m0, int64_t n0) {
  float out[MRT][NV * CB];
  tile<MRT>(a.x + m0 * a.K, a.K, a.w + n0 * a.K, a.scale + n0 * (a.K / a.G), a.G, out);
  const int64_t n_end = std::min<int64_t>(n0 + NV * CB, a.N);
  for (int m = 0; m < MRT; ++m) {
    float* y = a.y + (m0 + m) * a.N;
    for (int64_t n = n0; n < n_end; ++n)
      y[n] = out[m][n - n0] + (a.bias ? a.bias[n] : 0.f);
  }
}

template <int R>
inline void rows_rest(const Args& a, int64_t m0, int64_t rows, int64_t n0) {
  if constexpr (R > 0) {
    if (rows == R) return rows_tile<R>(a, m0, n0);
    rows_rest<R - 1>(a, m0, rows, n0);
  }
}

// Every row of x against one tile of 32 output channels: the tile's weights stay in L1.
void channel_tile(const Args& a, int64_t n0) {
  int64_t m = 0;
  for (; m + MR <= a.M; m += MR) rows_tile<MR>(a, m, n0);
  if (m < a.M) rows_rest<MR - 1>(a, m, a.M - m, n0);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == CB && x.size(1) == w.size(1),
              "int8_linear: x [M, K], w [blocks, K, 16]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_linear: w must be contiguous int8");
  const int64_t N = n, K = x.size(1);
  TORCH_CHECK(N > 0 && w.size(0) == (N + NV * CB - 1) / (NV * CB) * NV,
              "int8_linear: w [2 * ceil(N / 32), K, 16]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 3 && scale.size(0) == w.size(0) &&
                  scale.size(2) == CB && scale.size(1) > 0 && K % scale.size(1) == 0,
              "int8_linear: scale [blocks, groups, 16] float32 with groups dividing K");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sc = scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const Args a{xf.data_ptr<float>(), w.data_ptr<int8_t>(), sc.data_ptr<float>(),
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N,
               K / scale.size(1)};
  const int64_t tiles = w.size(0) / NV;
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) channel_tile(a, t * NV * CB);
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("int8_linear", &int8_linear); }
