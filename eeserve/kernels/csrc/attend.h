// eeserve CPU kernels: the pieces of paged decode attention, shared by cpu_ops.cpp's
// decode_attention and decode_stack.cpp.
//
// Contract: a query row attends to the positions at slots sl[0, len) of the KV pool [slots,
// Hkv, D]. attend_positions computes one task, positions [t0, t1), for all H query heads into a
// partial per head (max score, exp-sum, unnormalised weighted sum of values [D]);
// merge_partials combines a row's partials, in order, into its output [H, D]. The query qf is
// float32 and already scaled.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace eeserve_attend {

// DC: the head size when known at compile time (the loops unroll into vector code), 0 for any.
template <int64_t DC>
inline float dot(const float* a, const float* b, int64_t D) {
  if constexpr (DC > 0) D = DC;
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

template <int64_t DC>
inline void axpy(float p, const float* x, float* y, int64_t D) {
  if constexpr (DC > 0) D = DC;
  for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(src[d]);
    return buf;
  }
}

// Blocks of one context lie anywhere in the pool: the hardware prefetcher cannot see the next one
// coming, so ask for the row a few positions ahead.
template <typename T>
inline void prefetch_row(const T* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < elems * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

constexpr int64_t kPrefetchAhead = 8;

// A task is KSPLIT consecutive positions of one row, for all its heads (each key row read once
// for every query head that shares it): the task's scores, their max and exp-sum, and its
// unnormalised weighted sum of values go to a partial, and the row's partials are merged in
// order. A row's tasks depend on its length only, so its result does not depend on what else is
// in the batch (a verification's rows equal the same positions decoded one by one), and batch 1
// spreads its context over every core.
constexpr int64_t KSPLIT = 32;

// One task: positions [t0, t1) of the row whose slots are sl; P: per head (max, sum, acc[D]).
template <typename T, int64_t DC>
void attend_positions(const float* qf, const T* kc, const T* vc, const int64_t* sl, int64_t t0,
                      int64_t t1, int64_t len, int64_t H, int64_t Hkv, int64_t D, float* scores,
                      float* buf, float* P) {
  const int64_t G = H / Hkv, n = t1 - t0;  // G: query heads per K/V head (GQA)
  for (int64_t t = t0; t < t1; ++t) {
    if (t + kPrefetchAhead < len) {
      prefetch_row(kc + sl[t + kPrefetchAhead] * Hkv * D, Hkv * D);
      prefetch_row(vc + sl[t + kPrefetchAhead] * Hkv * D, Hkv * D);
    }
    const T* row = kc + sl[t] * Hkv * D;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const float* k = as_float<T>(row + kh * D, buf, D);
      for (int64_t g = 0; g < G; ++g)
        scores[(kh * G + g) * KSPLIT + t - t0] = dot<DC>(qf + (kh * G + g) * D, k, D);
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    float* sc = scores + i * KSPLIT;
    const float mx = *std::max_element(sc, sc + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    P[i * (D + 2)] = mx;
    P[i * (D + 2) + 1] = sum;
    std::fill(P + i * (D + 2) + 2, P + (i + 1) * (D + 2), 0.f);
  }
  for (int64_t t = t0; t < t1; ++t) {
    const T* row = vc + sl[t] * Hkv * D;
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const float* v = as_float<T>(row + kh * D, buf, D);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = kh * G + g;
        axpy<DC>(scores[i * KSPLIT + t - t0], v, P + i * (D + 2) + 2, D);
      }
    }
  }
}

// A row's n partials P [n, H, D + 2] (in task order) -> out [H, D]; o: scratch [D].
template <typename T, int64_t DC>
void merge_partials(const float* part, int64_t n, int64_t H, int64_t D, float* o, T* out) {
  const int64_t W = D + 2;
  for (int64_t i = 0; i < H; ++i) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, part[(j * H + i) * W]);
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* P = part + (j * H + i) * W;
      const float c = std::exp(P[0] - mx);
      sum += c * P[1];
      axpy<DC>(c, P + 2, o, D);
    }
    const float inv = 1.f / sum;
    T* dst = out + i * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
  }
}

}  // namespace eeserve_attend
