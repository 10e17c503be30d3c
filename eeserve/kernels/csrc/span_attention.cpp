// eeserve CPU kernel: causal attention of one sequence's span of queries over its paged context.
//
// Contract: q [n, H, D] (heads contiguous, rows may be strided); k_cache, v_cache [slots, Hkv, D]
// (contiguous); slots [T] int64, the slots of the sequence's positions 0..T-1; positions [n]
// int64, each query's position (< T). Query i attends to positions 0..positions[i]. Returns
// [n, H, D] in q's dtype (float32, bfloat16 or float16; computed in float32), equal to SDPA with
// the causal mask up to float summation order. Registered as torch.ops.eeserve.span_attention.
//
// Why hand-written: a prompt (or a chunk of one over its cached prefix) spends a third to a half
// of its prefill in attention once its context passes a few hundred positions, and CPU SDPA ran
// that at ~120 GFLOP/s on two cores against ~430 for the projections: it gathers the context out
// of the pool, repeats K/V for every query head of a group, and computes masked-out blocks of a
// chunk. Here a task is one K/V head and a tile of query rows; each block of keys is gathered once
// for the tile's rows times the query heads that share it (GQA), both products run as register
// tiles, softmax is online (one pass over the keys), and blocks past a tile's last position are
// never read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "paged_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KB = 64;  // keys per block
constexpr int64_t QR = 16;  // query rows per task (each with the G query heads of one K/V head)
constexpr int64_t KT = 8;   // keys per register tile of the scores
// Masked scores: finite, because -ffast-math assumes no infinities; exp(kMasked - m) is 0.
constexpr float kMasked = -1e30f;

struct SpanArgs {
  int64_t n, H, Hkv, D, q_stride;
  const int64_t* slots;
  const int64_t* pos;
  float scale;
};

// Layouts of a task with QV query vectors (rows x heads of the group), padded to QVp (a multiple
// of 16): Qt [D][QVp] the scaled queries transposed, St [KB][QVp] one block's scores transposed
// (so that softmax runs across query vectors, contiguous), acc [QVp][D]. krow/vrow: the block's
// key and value rows (pointers into the pool, or into a float copy of them).

// St[t][qc..] = K[t] . Q[qc..] for the KT keys from t0 and NQ * 16 query vectors from qc.
template <int NQ>
inline void scores_tile(const float* Qt, int64_t QVp, const float* const* krow, int64_t t0,
                        int64_t qc, float* St, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc[KT][NQ];
  for (int k = 0; k < KT; ++k)
    for (int i = 0; i < NQ; ++i) acc[k][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NQ];
    for (int i = 0; i < NQ; ++i) qv[i] = _mm512_loadu_ps(Qt + d * QVp + qc + 16 * i);
#pragma GCC unroll 8
    for (int k = 0; k < KT; ++k) {
      const __m512 kb = _mm512_set1_ps(krow[t0 + k][d]);
      for (int i = 0; i < NQ; ++i) acc[k][i] = _mm512_fmadd_ps(kb, qv[i], acc[k][i]);
    }
  }
  for (int k = 0; k < KT; ++k)
    for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(St + (t0 + k) * QVp + qc + 16 * i, acc[k][i]);
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2's 16 registers: 4 keys x 16 query vectors (two halves of 8) at a time.
  for (int i = 0; i < NQ; ++i)
    for (int kg = 0; kg < KT; kg += 4) {
      __m256 acc[4][2];
      for (int k = 0; k < 4; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const float* qd = Qt + d * QVp + qc + 16 * i;
        const __m256 lo = _mm256_loadu_ps(qd), hi = _mm256_loadu_ps(qd + 8);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256 kb = _mm256_broadcast_ss(krow[t0 + kg + k] + d);
          acc[k][0] = _mm256_fmadd_ps(kb, lo, acc[k][0]);
          acc[k][1] = _mm256_fmadd_ps(kb, hi, acc[k][1]);
        }
      }
      for (int k = 0; k < 4; ++k) {
        float* dst = St + (t0 + kg + k) * QVp + qc + 16 * i;
        _mm256_storeu_ps(dst, acc[k][0]);
        _mm256_storeu_ps(dst + 8, acc[k][1]);
      }
    }
#else
  for (int k = 0; k < KT; ++k)
    for (int64_t j = 0; j < NQ * 16; ++j) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += krow[t0 + k][d] * Qt[d * QVp + qc + j];
      St[(t0 + k) * QVp + qc + j] = s;
    }
#endif
}

inline void block_scores(const float* Qt, int64_t QVp, const float* const* krow, float* St,
                         int64_t D) {
  for (int64_t t0 = 0; t0 < KB; t0 += KT) {
    int64_t qc = 0;
    for (; qc + 48 <= QVp; qc += 48) scores_tile<3>(Qt, QVp, krow, t0, qc, St, D);
    if (QVp - qc == 32) scores_tile<2>(Qt, QVp, krow, t0, qc, St, D);
    if (QVp - qc == 16) scores_tile<1>(Qt, QVp, krow, t0, qc, St, D);
  }
}

// acc[r] += sum_t St[t][r] V[t] for R query vectors from r0 over the block's kn keys, D = DV * 16.
template <int DV, int R>
inline void values_tile(const float* St, int64_t QVp, const float* const* vrow, int64_t kn,
                        int64_t r0, float* acc) {
  constexpr int64_t D = DV * 16;
#if defined(__AVX512F__)
  __m512 o[R][DV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < DV; ++i) o[r][i] = _mm512_loadu_ps(acc + (r0 + r) * D + 16 * i);
  for (int64_t t = 0; t < kn; ++t) {
    __m512 v[DV];
    for (int i = 0; i < DV; ++i) v[i] = _mm512_loadu_ps(vrow[t] + 16 * i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(St[t * QVp + r0 + r]);
      for (int i = 0; i < DV; ++i) o[r][i] = _mm512_fmadd_ps(p, v[i], o[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < DV; ++i) _mm512_storeu_ps(acc + (r0 + r) * D + 16 * i, o[r][i]);
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2's 16 registers: 64 dims of R rows at a time (8 halves of 8 lanes per row).
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    constexpr int W = DV * 2 < 8 ? DV * 2 : 8;  // halves of 8 in this 64-dim slice
    __m256 o[R][W];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) o[r][j] = _mm256_loadu_ps(acc + (r0 + r) * D + d0 + 8 * j);
    for (int64_t t = 0; t < kn; ++t) {
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_broadcast_ss(St + t * QVp + r0 + r);
#pragma GCC unroll 8
      for (int j = 0; j < W; ++j) {
        const __m256 v = _mm256_loadu_ps(vrow[t] + d0 + 8 * j);
        for (int r = 0; r < R; ++r) o[r][j] = _mm256_fmadd_ps(p[r], v, o[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + (r0 + r) * D + d0 + 8 * j, o[r][j]);
  }
#else
  for (int64_t t = 0; t < kn; ++t)
    for (int r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) acc[(r0 + r) * D + d] += St[t * QVp + r0 + r] * vrow[t][d];
#endif
}

// DV: D / 16 when the register tiles apply (D = 64 or 128), 0 for any other head size.
template <int DV>
inline void block_values(const float* St, int64_t QVp, const float* const* vrow, int64_t kn,
                         float* acc, int64_t QV, int64_t D) {
  if constexpr (DV > 0) {
#if defined(__AVX512F__)
    constexpr int R = 24 / DV;  // accumulators: R * DV of the 32 vector registers
#else
    constexpr int R = 1;  // AVX2: one row's 64-dim slice is 8 of the 16 registers
#endif
    int64_t r = 0;
    for (; r + R <= QV; r += R) values_tile<DV, R>(St, QVp, vrow, kn, r, acc);
    for (; r < QV; ++r) values_tile<DV, 1>(St, QVp, vrow, kn, r, acc);
  } else {
    for (int64_t t = 0; t < kn; ++t)
      for (int64_t r = 0; r < QV; ++r)
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] += St[t * QVp + r] * vrow[t][d];
  }
}

// Points krow/vrow at the key and value rows of K/V head h for positions k0..k0+kn-1 (in the
// pool for float32, else converted into kbuf/vbuf); rows past kn point at zeros.
template <typename T>
void block_rows(const SpanArgs& a, const T* kc, const T* vc, int64_t h, int64_t k0, int64_t kn,
                const float* zero, float* kbuf, float* vbuf, const float** krow,
                const float** vrow) {
  const int64_t D = a.D;
  for (int64_t t = 0; t < KB; ++t) {
    if (t >= kn) {
      krow[t] = vrow[t] = zero;
      continue;
    }
    const int64_t off = (a.slots[k0 + t] * a.Hkv + h) * D;
    if constexpr (std::is_same_v<T, float>) {
      krow[t] = kc + off;
      vrow[t] = vc + off;
    } else {
      for (int64_t d = 0; d < D; ++d) {
        kbuf[t * D + d] = static_cast<float>(kc[off + d]);
        vbuf[t * D + d] = static_cast<float>(vc[off + d]);
      }
      krow[t] = kbuf + t * D;
      vrow[t] = vbuf + t * D;
    }
  }
}

// Online softmax over one block's scores St [KB][QVp] (keys k0.. of which kn exist): masks keys
// past each query's position, turns the scores into weights exp(s - m), and rescales the running
// max m, sum l and the accumulators acc [QV][D] to the new max.
struct Softmax {
  int64_t QV, QVp, D;
  std::vector<float> m, l, mx, corr, qpos;

  void update(float* St, int64_t k0, int64_t kn, bool diagonal, float* acc) {
    if (diagonal)
      for (int64_t t = 0; t < KB; ++t) {
        float* s = St + t * QVp;
        const float kpos = static_cast<float>(k0 + t);
        for (int64_t qv = 0; qv < QVp; ++qv) s[qv] = kpos > qpos[qv] ? kMasked : s[qv];
      }
    for (int64_t qv = 0; qv < QVp; ++qv) mx[qv] = m[qv];
    for (int64_t t = 0; t < kn; ++t)
      for (int64_t qv = 0; qv < QVp; ++qv) mx[qv] = std::max(mx[qv], St[t * QVp + qv]);
    for (int64_t qv = 0; qv < QVp; ++qv) {
      corr[qv] = std::exp(m[qv] - mx[qv]);
      l[qv] *= corr[qv];
      m[qv] = mx[qv];
    }
    for (int64_t t = 0; t < kn; ++t) {
      float* s = St + t * QVp;
      for (int64_t qv = 0; qv < QVp; ++qv) {
        s[qv] = std::exp(s[qv] - mx[qv]);
        l[qv] += s[qv];
      }
    }
    for (int64_t qv = 0; qv < QV; ++qv)
      for (int64_t d = 0; d < D; ++d) acc[qv * D + d] *= corr[qv];
  }
};

// One task: K/V head h against query rows r0..r1 (their G heads each), online softmax over key
// blocks up to the rows' last position.
template <typename T, int DV>
void span_task(const SpanArgs& a, const T* q, const T* kc, const T* vc, T* out, int64_t h,
               int64_t r0, int64_t r1) {
  const int64_t G = a.H / a.Hkv, D = a.D, QV = (r1 - r0) * G, QVp = (QV + 15) / 16 * 16;
  std::vector<float> Qt(D * QVp, 0.f), St(KB * QVp), acc(QVp * D, 0.f), zero(D, 0.f);
  std::vector<float> kbuf(std::is_same_v<T, float> ? 0 : KB * D), vbuf(kbuf.size());
  Softmax sm{QV, QVp, D, std::vector<float>(QVp, kMasked), std::vector<float>(QVp, 0.f),
             std::vector<float>(QVp), std::vector<float>(QVp), std::vector<float>(QVp)};
  const float* krow[KB];
  const float* vrow[KB];
  const int64_t lo = *std::min_element(a.pos + r0, a.pos + r1);
  const int64_t hi = *std::max_element(a.pos + r0, a.pos + r1);
  for (int64_t qv = 0; qv < QVp; ++qv) {
    // Padding lanes copy the last row's position: their (zero) scores stay finite.
    const int64_t r = qv < QV ? r0 + qv / G : r1 - 1, g = qv % G;
    sm.qpos[qv] = static_cast<float>(a.pos[r]);
    if (qv >= QV) continue;
    const T* src = q + r * a.q_stride + (h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) Qt[d * QVp + qv] = static_cast<float>(src[d]) * a.scale;
  }
  for (int64_t k0 = 0; k0 <= hi; k0 += KB) {
    const int64_t kn = std::min(KB, hi + 1 - k0);
    block_rows<T>(a, kc, vc, h, k0, kn, zero.data(), kbuf.data(), vbuf.data(), krow, vrow);
    block_scores(Qt.data(), QVp, krow, St.data(), D);
    // Some key of the block lies past some query: mask those.
    sm.update(St.data(), k0, kn, k0 + KB - 1 > lo, acc.data());
    block_values<DV>(St.data(), QVp, vrow, kn, acc.data(), QV, D);
  }
  for (int64_t qv = 0; qv < QV; ++qv) {
    const int64_t r = r0 + qv / G, g = qv % G;
    const float inv = 1.f / sm.l[qv];
    T* dst = out + (r * a.H + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[qv * D + d] * inv);
  }
}

template <typename T, int DV>
void span_attention_kernel(const SpanArgs& a, const T* q, const T* kc, const T* vc, T* out) {
  const int64_t tiles = (a.n + QR - 1) / QR, tasks = tiles * a.Hkv;
  // Threads take contiguous ranges of tasks, K/V head by K/V head (a head's context stays in the
  // core's cache across its tiles); within a head, tiles alternate first/last so that every
  // range mixes early (short-context) and late (long-context) rows of a causal prompt.
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, i = task % tiles;
      const int64_t tile = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
      span_task<T, DV>(a, q, kc, vc, out, h, tile * QR, std::min(a.n, (tile + 1) * QR));
    }
  });
}

at::Tensor span_attention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slots,
                          const at::Tensor& positions, double scale) {
  eeserve_checks::check_paged_attention(q, k_cache, v_cache, slots, positions,
                                        "slots and positions");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(positions.numel() == n, "one position per query row");
  auto sl = slots.contiguous();
  auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < sl.numel(), "a query position lies outside its context");
  auto out = at::empty({n, H, D}, q.options());
  const SpanArgs a{n, H, Hkv, D, q.stride(0), sl.data_ptr<int64_t>(), p,
                   static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "span_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(a, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
             v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
    };
    if (D == 64) {
      run(span_attention_kernel<scalar_t, 4>);
    } else if (D == 128) {
      run(span_attention_kernel<scalar_t, 8>);
    } else if (D == 256) {  // Gemma 3
      run(span_attention_kernel<scalar_t, 16>);
    } else {
      run(span_attention_kernel<scalar_t, 0>);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("span_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("span_attention", &span_attention); }
