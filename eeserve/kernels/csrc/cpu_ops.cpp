// eeserve CPU kernels: the per-layer glue around the GEMMs, fused into one pass each.
//
// Contract: every op reads contiguous tensors (float32, bfloat16 or float16), computes in float32
// and rounds to the input dtype where the PyTorch reference (HF transformers' arithmetic) rounds,
// so outputs equal the reference up to float summation order. Registered as torch.ops.eeserve.*;
// eeserve/kernels/native.py builds this file once per machine and falls back to PyTorch without it.
//
// Why hand-written: on a 2-core CPU a decode step of the default model spends ~25% of its time
// outside the GEMMs, in ~15 small ATen ops per layer (each a full pass over its tensor plus
// dispatch), and in paged attention's gather, which copies every sequence's context out of the
// KV pool before SDPA reads it again. Here attention reads K/V in place through the slot table.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "attend.h"
#include "row_ops.h"
#include "paged_checks.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

using namespace eeserve_attend;
using namespace eeserve_rows;

// ---- paged decode attention -----------------------------------------------------------------
// q [R, H, D] (heads contiguous, rows may be strided); k_cache, v_cache [slots, Hkv, D];
// slots [R, T]: row r attends to the positions at slots[r, :lens[r]] (its sequence up to its own
// position; lens >= 1). Returns [R, H, D]. One query per row: decode steps, owed positions.
// K/V are read in place through the slot table: no gathered copy of the context.

template <typename T, int64_t DC>
void decode_attention_kernel(const T* q, int64_t q_stride, const T* kc, const T* vc,
                             const int64_t* slots, const int64_t* lens, T* out, int64_t S,
                             int64_t H, int64_t Hkv, int64_t D, int64_t Tmax, float scale) {
  std::vector<int64_t> first(S + 1, 0);  // row s's tasks: [first[s], first[s + 1])
  for (int64_t s = 0; s < S; ++s) first[s + 1] = first[s] + (lens[s] + KSPLIT - 1) / KSPLIT;
  const int64_t W = D + 2;
  std::vector<float> part(first[S] * H * W);  // per task and head: max, sum, acc[D]
  at::parallel_for(0, first[S], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), scores(H * KSPLIT), buf(D);
    int64_t row = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      if (s != row) {  // tasks of one row are consecutive: its scaled query is made once
        row = s;
        for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[s * q_stride + i]) * scale;
      }
      const int64_t t0 = (task - first[s]) * KSPLIT, t1 = std::min(lens[s], t0 + KSPLIT);
      attend_positions<T, DC>(qf.data(), kc, vc, slots + s * Tmax, t0, t1, lens[s], H, Hkv, D,
                              scores.data(), buf.data(), part.data() + task * H * W);
    }
  });
  std::vector<float> o(D);
  for (int64_t s = 0; s < S; ++s)
    merge_partials<T, DC>(part.data() + first[s] * H * W, first[s + 1] - first[s], H, D, o.data(), out + s * H * D);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lens, double scale) {
  eeserve_checks::check_paged_attention(q, k_cache, v_cache, slots, lens, "slots and lens");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(slots.size(0) == S && lens.size(0) == S, "one slot row and length per query row");
  auto sl = slots.contiguous();
  auto ln = lens.contiguous();
  auto out = at::empty({S, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
             v_cache.data_ptr<scalar_t>(),
             sl.data_ptr<int64_t>(), ln.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), S, H, Hkv,
             D, sl.size(1), static_cast<float>(scale));
    };
    if (D == 64) {
      run(decode_attention_kernel<scalar_t, 64>);
    } else if (D == 128) {
      run(decode_attention_kernel<scalar_t, 128>);
    } else if (D == 96) {
      run(decode_attention_kernel<scalar_t, 96>);
    } else if (D == 256) {  // Gemma 3
      run(decode_attention_kernel<scalar_t, 256>);
    } else {
      run(decode_attention_kernel<scalar_t, 0>);
    }
  });
  return out;
}

// ---- RMSNorm --------------------------------------------------------------------------------
// HF: weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype); x [N, D], weight [D].
template <typename T>
void rms_norm_kernel(const T* x, const T* w, T* out, int64_t N, int64_t D, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rms_norm_row<T>(x + i * D, w, out + i * D, D, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  auto xc = x.contiguous();
  const int64_t D = xc.size(-1), N = xc.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(weight.numel() == D, "weight must have the last dimension's size");
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), N, D, static_cast<float>(eps));
  });
  return out;
}

// ---- rotary embedding, in place ---------------------------------------------------------------
// x [N, heads, D] (rows may be strided: a view of the first heads of a fused projection);
// cos, sin [N, D]. HF's rotate-half: x * cos + rotate_half(x) * sin, each product rounded.
template <typename T>
void rotary_kernel(T* x, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t D,
                   int64_t row_stride) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rotate_heads<T>(x + i * row_stride, cos + i * D, sin + i * D, heads, D);
  });
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [N, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == x.size(2) &&
                  cos.size(0) == x.size(0) && sin.sizes() == cos.sizes(),
              "cos/sin must be [N, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "x, cos and sin must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                            sin.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2),
                            x.stride(0));
  });
}

// ---- GLU activations --------------------------------------------------------------------------
// gate_up [N, 2I] (gate first) -> act(gate) * up [N, I], act's output rounded as in HF: SiLU
// (SwiGLU) or tanh GELU (GeGLU), one row function of row_ops.h each.
template <typename T, void (*Row)(const T*, T*, int64_t)>
void glu_kernel(const T* gu, T* out, int64_t N, int64_t I) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) Row(gu + i * 2 * I, out + i * I, I);
  });
}

template <bool Gelu>
at::Tensor glu(const at::Tensor& gate_up) {
  auto gu = gate_up.contiguous();
  const int64_t two_i = gu.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even");
  auto sizes = gu.sizes().vec();
  sizes.back() = two_i / 2;
  auto out = at::empty(sizes, gu.options());
  const int64_t N = gu.numel() / std::max<int64_t>(two_i, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "glu", [&] {
    if constexpr (Gelu) {
      glu_kernel<scalar_t, gelu_tanh_mul_row<scalar_t>>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, two_i / 2);
    } else {
      glu_kernel<scalar_t, silu_mul_row<scalar_t>>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), N, two_i / 2);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return glu<false>(gate_up); }
at::Tensor gelu_mul(const at::Tensor& gate_up) { return glu<true>(gate_up); }

}  // namespace

TORCH_LIBRARY(eeserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_mul", &gelu_mul);
}
