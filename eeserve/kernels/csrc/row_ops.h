// eeserve CPU kernels: the per-row arithmetic of the glue ops, shared by cpu_ops.cpp (rms_norm,
// rotary_, silu_mul) and decode_stack.cpp, so that both compute a row alike.
//
// Contract: each function reads one row in T (float32, bfloat16 or float16), computes in float32
// and rounds to T where HF transformers' arithmetic rounds. rms_norm_row: w * (x * rsqrt(mean(x^2)
// + eps)) over D values. rotate_heads: HF's rotate-half in place on `heads` contiguous heads of
// size D with the row's cos/sin [D]. silu_mul_row: silu(gate) * up from a row [gate I | up I];
// gelu_tanh_mul_row: the same with PyTorch's tanh-approximate GELU (Gemma's GeGLU).

#pragma once

#include <cmath>
#include <cstdint>

namespace eeserve_rows {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t d = 0; d < D; ++d) ss += to_f(x[d]) * to_f(x[d]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(to_f(w[d]) * round_to<T>(to_f(x[d]) * r));
}

template <typename T>
inline void rotate_heads(T* x, const T* c, const T* s, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * D;
    for (int64_t d = 0; d < half; ++d) {
      const float a = to_f(v[d]), b = to_f(v[d + half]);
      const float lo = round_to<T>(a * to_f(c[d])) + round_to<T>(-b * to_f(s[d]));
      const float hi = round_to<T>(b * to_f(c[d + half])) + round_to<T>(a * to_f(s[d + half]));
      v[d] = static_cast<T>(lo);
      v[d + half] = static_cast<T>(hi);
    }
  }
}

template <typename T>
inline void silu_mul_row(const T* gate_up, T* out, int64_t I) {
  const T* u = gate_up + I;
  for (int64_t d = 0; d < I; ++d) {
    const float a = to_f(gate_up[d]);
    out[d] = static_cast<T>(round_to<T>(a / (1.f + std::exp(-a))) * to_f(u[d]));
  }
}

template <typename T>
inline void gelu_tanh_mul_row(const T* gate_up, T* out, int64_t I) {
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
  const T* u = gate_up + I;
  for (int64_t d = 0; d < I; ++d) {
    const float a = to_f(gate_up[d]);
    const float g = 0.5f * a * (1.f + std::tanh(k0 * (a + k1 * a * a * a)));
    out[d] = static_cast<T>(round_to<T>(g) * to_f(u[d]));
  }
}

}  // namespace eeserve_rows
