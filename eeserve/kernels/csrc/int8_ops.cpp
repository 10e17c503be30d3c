// eeserve CPU kernel: weight-only int8 linear, y = x @ (w * scale[:, None])^T + bias.
//
// Contract: x [M, K] float32 or bfloat16; w the int8 weight [N, K] re-laid by
// eeserve/kernels/quant.py as [2 * ceil(N / 32), Kp / 2, 16, 2] (Kp = K rounded up to 32; per
// block of 16 output channels, the pairs of consecutive inputs side by side; zero past N and K);
// scale the float32 weight scales, [2 * ceil(N / 32), groups, 16] the same way, groups == Kp / 32
// (a scale per 32 inputs) or 1 (per channel); bias [N] float32 or absent; n = N. Returns [M, N]
// in x's dtype. Registered as torch.ops.eeserve.int8_linear (native.py builds it with cpu_ops.cpp).
//
// Arithmetic: each row of x is split into chunks of 32 inputs, and each chunk is rounded to int16
// with its own scale (amax / 32767: a relative error of at most 2^-16 of the chunk's largest
// value, ~250x finer than bfloat16 and far below the weights' own int8 rounding). A chunk's dot
// products are exact int32 sums (32 * 127 * 32767 < 2^31), scaled once by weight scale times
// activation scale and summed in float32. So the result is F.linear(x, q * scale) up to that
// 16-bit rounding of x and float summation order.
//
// Why this arithmetic, measured on the 2-core AVX-512 machine (docs/cpu-performance.md): widening
// each int8 weight to float32 for an FMA costs three vector instructions per 16 weights, so the
// previous kernel ran at 10-13 GB/s of weights per core: compute-bound, below the memory bus.
// With int16 activations one VNNI instruction (vpdpwssd) multiplies 32 weights, widened to int16
// once for all rows of the tile. With AVX2 instead, vpmaddwd multiplies and pair-sums 16 of them
// at a time; elsewhere a plain loop does the same integer arithmetic (the compiler vectorises
// it). Chunk sums are exact integers in every path and scaled alike, so the result does not
// depend on the CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_tiles.h"
#include "tile_loop.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t CB = 16;     // output channels per block of the packed layout
constexpr int NV = 2;          // channel blocks per register tile (32 outputs)
using eeserve_linear::CHUNK;  // inputs per activation scale (and per weight group)
constexpr int64_t PAIRS = CHUNK / 2;
// Bytes ahead of the current chunk that each block's next weights are prefetched from. AVX2's
// tile: 2 KB into L1 was 15% faster at 1 row and 30-45% at 8 rows than the hardware prefetcher
// alone (0, 512 B-8 KB tried). AVX-512's: 4 KB into L2, carried on into the next tile's blocks,
// read the LM head 25-35% faster at 1 row and ~25% at 8 rows than 2 KB into L1 on a Zen 4 (where
// L1 prefetches took miss slots the demand loads needed and ran slower than none at all).
constexpr int64_t PF = 2048;
constexpr int64_t PF_L2 = 4096;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int ROWS = 6;  // rows per tile: 2 * 6 int32 + 2 * 6 float accumulators + 2 weights
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int ROWS = 6;  // 2 * 6 int32 accumulators + 2 weight halves + 1 input of 16 registers
#else
constexpr int ROWS = 6;
#endif

// Row m of x -> xq[m] (int16, Kp) and xs[m] (one scale per chunk of 32; zero past K).
void quantize_row(const float* x, int64_t K, int64_t Kp, int16_t* xq, float* xs) {
  for (int64_t c = 0; c < Kp / CHUNK; ++c) {
    const int64_t k0 = c * CHUNK, k1 = std::min(K, k0 + CHUNK);
    float amax = 0.f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
    xs[c] = s;
    for (int64_t k = k0; k < k1; ++k)
      xq[k] = static_cast<int16_t>(std::nearbyint(std::min(32767.f, std::max(-32767.f, x[k] * inv))));
    for (int64_t k = std::max(k0, k1); k < k0 + CHUNK; ++k) xq[k] = 0;
  }
}

using LinearArgs = eeserve_linear::Int8Args;

// One chunk's worth of block bytes from offset `off` of the block at `blk` into L2; past the
// block's end the stream goes on in the same block of the next tiles (NV blocks further each),
// so a tile's first chunks are already on their way when it starts. Block sizes are multiples of
// a chunk's bytes, so the chunk lies in one tile.
inline void prefetch_l2(const int8_t* blk, int64_t blk_bytes, int64_t off) {
  while (off >= blk_bytes) {  // at most a few steps: the distance is a few KB
    blk += NV * blk_bytes;
    off -= blk_bytes;
  }
  for (int64_t b = off; b < off + PAIRS * 2 * CB; b += 64)  // a hint: past the end is harmless
    _mm_prefetch(reinterpret_cast<const char*>(blk + b), _MM_HINT_T1);
}

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
// AVX2's tile: a block's 16 channels are two halves of 8; per pair of inputs, vpmaddwd multiplies
// a half's 8 (w0, w1) pairs, widened to int16, by the row's (x0, x1) and sums each pair into its
// channel's int32 lane. The two blocks go one after the other, so that 6 rows' accumulators fit
// the 16 registers and each widened weight serves 6 rows. A chunk's sums are exact; then scaled
// into float totals as AVX-512's are.
template <int MRT>
inline void avx2_tile(const LinearArgs& a, int64_t chunks, int64_t blk_bytes, const int8_t* w, const float* sc,
                      const int16_t* xq, const float* xs, float out[MRT][NV * CB]) {
  const int64_t Kp = a.Kp;
  for (int v = 0; v < NV; ++v) {
    const int8_t* wb = w + v * blk_bytes;
    __m256 total[MRT][2];
    for (int m = 0; m < MRT; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m256i acc[MRT][2];
      for (int m = 0; m < MRT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      const int64_t p0 = c * PAIRS;
      for (int64_t ahead = PF; ahead < PF + PAIRS * 2 * CB; ahead += 64)  // a later chunk
        _mm_prefetch(reinterpret_cast<const char*>(wb + p0 * 2 * CB + ahead), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int64_t p = 0; p < PAIRS; ++p) {
        const int8_t* wp = wb + (p0 + p) * 2 * CB;
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
#pragma GCC unroll 6
        for (int m = 0; m < MRT; ++m) {
          int32_t pair;
          std::memcpy(&pair, xq + m * Kp + (p0 + p) * 2, sizeof pair);
          const __m256i xv = _mm256_set1_epi32(pair);
          acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(lo, xv));
          acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(hi, xv));
        }
      }
      const int64_t g = a.groups == 1 ? 0 : c;
      for (int half = 0; half < 2; ++half) {
        const __m256 swv = _mm256_loadu_ps(sc + (v * a.groups + g) * CB + 8 * half);
        for (int m = 0; m < MRT; ++m) {
          const __m256 f = _mm256_mul_ps(swv, _mm256_set1_ps(xs[m * chunks + c]));
          total[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][half]), f, total[m][half]);
        }
      }
    }
    for (int m = 0; m < MRT; ++m)
      for (int half = 0; half < 2; ++half) _mm256_storeu_ps(out[m] + v * CB + 8 * half, total[m][half]);
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
    const int64_t Kp = a.Kp, chunks = Kp / CHUNK, blk_bytes = Kp * CB;
    const int8_t* w = a.w + n0 * Kp;                 // NV blocks of Kp * 16 bytes
    const float* sc = a.scale + n0 * a.groups;       // NV blocks of groups * 16 scales
    const int16_t* xq = a.xq + m0 * Kp;
    const float* xs = a.xs + m0 * chunks;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // Few rows leave too few independent accumulation chains to hide vpdpwssd's latency: then S
    // accumulator sets take turns over the chunk's pairs and are summed at its end.
    constexpr int S = MRT == 1 ? 4 : (MRT == 2 ? 2 : 1);
    __m512 total[MRT][NV];
    for (int m = 0; m < MRT; ++m)
      for (int v = 0; v < NV; ++v) total[m][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i acc[S][MRT][NV];
      for (int s = 0; s < S; ++s)
        for (int m = 0; m < MRT; ++m)
          for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_setzero_si512();
      const int64_t p0 = c * PAIRS;
      if (m0 == 0)  // later row tiles find this tile's weights in cache
        for (int v = 0; v < NV; ++v) prefetch_l2(w + v * blk_bytes, blk_bytes, p0 * 2 * CB + PF_L2);
      for (int64_t p = 0; p < PAIRS; p += S) {
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) {
          __m512i wv[NV];
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v)
            wv[v] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(w + v * blk_bytes + (p0 + p + s) * 2 * CB)));
#pragma GCC unroll 6
          for (int m = 0; m < MRT; ++m) {
            int32_t pair;
            std::memcpy(&pair, xq + m * Kp + (p0 + p + s) * 2, sizeof pair);
            const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
            for (int v = 0; v < NV; ++v) acc[s][m][v] = _mm512_dpwssd_epi32(acc[s][m][v], wv[v], xv);
          }
        }
      }
      const int64_t g = a.groups == 1 ? 0 : c;
      for (int v = 0; v < NV; ++v) {
        const __m512 swv = _mm512_loadu_ps(sc + (v * a.groups + g) * CB);
        for (int m = 0; m < MRT; ++m) {
          __m512i sum = acc[0][m][v];
          for (int s = 1; s < S; ++s) sum = _mm512_add_epi32(sum, acc[s][m][v]);
          const __m512 f = _mm512_mul_ps(swv, _mm512_set1_ps(xs[m * chunks + c]));
          total[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, total[m][v]);
        }
      }
    }
    for (int m = 0; m < MRT; ++m)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[m] + v * CB, total[m][v]);
#elif defined(__AVX2__) && defined(__FMA__)
    avx2_tile<MRT>(a, chunks, blk_bytes, w, sc, xq, xs, out);
#else
    for (int m = 0; m < MRT; ++m)
      for (int i = 0; i < NV * CB; ++i) out[m][i] = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t acc[MRT][NV * CB] = {};
      for (int64_t p = c * PAIRS; p < (c + 1) * PAIRS; ++p)
        for (int m = 0; m < MRT; ++m) {
          const int32_t x0 = xq[m * Kp + 2 * p], x1 = xq[m * Kp + 2 * p + 1];
          for (int v = 0; v < NV; ++v)
            for (int i = 0; i < CB; ++i) {
              const int8_t* wp = w + v * blk_bytes + (p * CB + i) * 2;
              acc[m][v * CB + i] += x0 * wp[0] + x1 * wp[1];
            }
        }
      const int64_t g = a.groups == 1 ? 0 : c;
      for (int m = 0; m < MRT; ++m)
        for (int v = 0; v < NV; ++v)
          for (int i = 0; i < CB; ++i)
            out[m][v * CB + i] += static_cast<float>(acc[m][v * CB + i]) *
                                  (sc[(v * a.groups + g) * CB + i] * xs[m * chunks + c]);
    }
#endif
  }
};

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 4 && w.size(2) == CB && w.size(3) == 2,
              "int8_linear: x [M, K], w [blocks, Kp / 2, 16, 2]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_linear: w must be contiguous int8");
  const int64_t N = n, K = x.size(1), Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  TORCH_CHECK(w.size(1) * 2 == Kp, "int8_linear: w holds ", w.size(1) * 2, " inputs, x ", K);
  TORCH_CHECK(N > 0 && w.size(0) == (N + NV * CB - 1) / (NV * CB) * NV,
              "int8_linear: w [2 * ceil(N / 32), Kp / 2, 16, 2]");
  const int64_t groups = scale.dim() == 3 ? scale.size(1) : 0;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && groups > 0 && scale.size(0) == w.size(0) &&
                  scale.size(2) == CB && (groups == 1 || (groups * CHUNK == K)),
              "int8_linear: scale [blocks, groups, 16] float32, groups 1 or K / 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sc = scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t M = x.size(0);
  at::Tensor xq = at::empty({M, Kp}, xf.options().dtype(at::kShort));
  at::Tensor xs = at::empty({M, Kp / CHUNK}, xf.options());
  eeserve_linear::int8_quantize_rows(xf.data_ptr<float>(), M, K, Kp, xq.data_ptr<int16_t>(), xs.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, xf.options());
  const LinearArgs a{xq.data_ptr<int16_t>(), xs.data_ptr<float>(), w.data_ptr<int8_t>(), sc.data_ptr<float>(),
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, Kp, N, groups};
  const int64_t tiles = w.size(0) / NV;
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) { eeserve_linear::int8_tiles(a, lo, hi); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

namespace eeserve_linear {

void int8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int16_t* xq, float* xs) {
  for (int64_t m = 0; m < M; ++m)  // M * K values: small next to the weights
    quantize_row(x + m * K, K, Kp, xq + m * Kp, xs + m * (Kp / CHUNK));
}

__attribute__((noinline)) void int8_tiles(const Int8Args& a, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t < hi; ++t) eeserve_tiles::channel_tile<Kernel>(a, t * NV * CB);
}

}  // namespace eeserve_linear

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("int8_linear", &int8_linear); }
