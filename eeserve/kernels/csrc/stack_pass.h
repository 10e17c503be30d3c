// eeserve CPU kernel internals: the data of one decode_stack pass (decode_stack.cpp), its
// projections' arguments and their tasks. Included by decode_stack.cpp only.
//
// Contract: a Proj is one projection: float32 [tiles * 2, K, 16] or int8 with scales (as
// linear_tiles.h computes them), or GGUF blocks with their parts table (gguf_linear.h); a Layer is one decoder layer of either architecture (Llama, or
// Gemma 3 with its q/k norms, output norms and local flag); a Pass holds the call's shapes,
// per-row buffers, the rows' contexts (global, and the local layers' windowed ones), layers and
// exit checks; a Phase is one step of the walk (a layer's or a check's), whose tasks the threads
// claim.

#pragma once

#include <ATen/ATen.h>

#include "gguf_linear.h"
#include "linear_tiles.h"
#include "stack_layout.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace eeserve_stack {

using eeserve_linear::CHUNK;
using eeserve_linear::TILE;
inline Arch read_arch(int64_t a) {
  TORCH_CHECK(a >= 0 && a < static_cast<int64_t>(Arch::count), "decode_stack: arch 0 (Llama) or 1 (Gemma 3)");
  return static_cast<Arch>(a);
}

// One projection: float32 ([tiles * 2, K, 16]), int8 ([tiles * 2, Kp / 2, 16, 2] with scales), or
// GGUF blocks (uint8, its scale slot holding the parts table: gguf_linear.h).
struct Proj {
  const void* w = nullptr;
  const float* scale = nullptr;  // nullptr: float32 or GGUF
  const float* bias = nullptr;
  int64_t n = 0, k = 0, kp = 0, tiles = 0, groups = 0;
  bool gguf = false;
  eeserve_gguf_linear::Stacked blocks;  // its parts, when gguf
};

struct Layer {
  const float* norm1;  // the attention's input norm
  const float* norm2;  // the MLP's input norm
  Proj qkv, o, gate_up, down;
  float* kc;  // [slots, Hkv, hd]
  float* vc;
  // Gemma 3 (nullptr for Llama): per-head q/k norms [hd], the attention's and MLP's output norms.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* attn_out_norm = nullptr;
  const float* mlp_out_norm = nullptr;
  bool local = false;  // a sliding-window layer: the local rotary tables and windowed contexts
};

// How the rows attend in a layer: row r over slots[r, :lens[r]], in attention tasks
// [first[r], first[r + 1]). A pass has one for global layers and one for local layers.
struct Context {
  const float *cos = nullptr, *sin = nullptr;  // [R, hd] the rotary tables
  const int64_t *slots = nullptr, *lens = nullptr;
  int64_t T = 0;
  std::vector<int64_t> first;
};

// An exit check after a layer of the pass: its measure's confidence per row (decode_stack_checked;
// the measures in stack_layout.h).
struct Check {
  int64_t after = 0;           // the layer (0-based in the call) whose output it reads
  float eps = 0.f;             // its RMS norm's
  Proj pre;                    // shortlist: the head's linear adapter (n == 0: none)
  const float* norm = nullptr;  // shortlist: the norm's weight [D]
  Proj rows;                   // shortlist: its LM-head rows [K, D]
  const float* probe = nullptr;  // classifier: weight [D]
  float probe_bias = 0.f;
  const float* threshold = nullptr;  // [R]: row r stops the pass when its confidence reaches it
  float* conf = nullptr;             // [R] the rows' confidence (written by the check)
};

enum class Step { In, Qkv, Rope, Attend, Merge, O, Mid, GateUp, Act, Down, Out, CkStage, CkPre, CkNorm, CkRows, CkConf };

struct Phase {
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
  Step step = Step::In;
  int64_t layer = 0, tasks = 0;
  int64_t check = -1;  // the check a check step computes
};

// Per-call buffers (rows of the pass) and shapes.
struct Pass {
  int64_t R, D, H, Hkv, hd, I, tile_tasks_div;
  float eps, scale;
  const float* h;  // [R, D] input
  float* hout;     // [R, D] residual stream between layers, then the output
  float* xn;       // [R, Kmax] the next projection's float input
  int16_t* xq;     // [R, Kmax] and its int16 rounding
  float* xs;       // [R, Kmax / 32]
  float* qkv;      // [R, (H + 2 Hkv) hd]
  float* q;        // [R, H hd] the rotated query, scaled
  float* att;      // [R, H hd]
  float* mid;      // [R, D]
  float* proj;     // [R, max(D, 2 I)] a projection's output
  float* part;     // [attention tasks, H, hd + 2]
  const int64_t* slot_mapping;
  Arch arch = Arch::Llama;
  Context global, local;  // local: the local layers' (Gemma 3; unused by Llama)
  std::vector<Layer> layers;
  std::vector<Check> checks;
  Measure measure = Measure::Classifier;
  float* ck_y = nullptr;       // [R, D] a check's adapter output
  float* ck_logits = nullptr;  // [R, Kc] its shortlist logits
  mutable std::atomic<int64_t> stopped{-1};  // the check where a row reached its threshold (-1: none)
};

inline Proj make_proj(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& s,
               const c10::optional<at::Tensor>& b, int64_t n, int64_t k) {
  TORCH_CHECK(w.has_value() && w->is_contiguous(), "decode_stack: a projection without its weight");
  Proj p;
  p.n = n, p.k = k, p.w = w->data_ptr();
  if (w->scalar_type() == at::kByte) {  // GGUF blocks: the scale slot holds their parts
    TORCH_CHECK(s.has_value() && !b.has_value(), "decode_stack: GGUF blocks need their parts table, and no bias");
    p.gguf = true, p.kp = k, p.blocks = eeserve_gguf_linear::read_stacked(*w, *s, k), p.tiles = p.blocks.tiles;
    TORCH_CHECK(p.blocks.N == n, "decode_stack: GGUF parts of ", p.blocks.N, " rows for ", n, " outputs");
    return p;
  }
  p.tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(w->size(0) == 2 * p.tiles, "decode_stack: a weight of ", w->size(0), " blocks for ", n, " outputs");
  if (s.has_value()) {
    p.kp = (k + CHUNK - 1) / CHUNK * CHUNK;
    TORCH_CHECK(w->scalar_type() == at::kChar && w->dim() == 4 && w->size(1) * 2 == p.kp,
                "decode_stack: int8 weight [blocks, Kp / 2, 16, 2]");
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 && s->size(0) == w->size(0),
                "decode_stack: int8 scales [blocks, groups, 16] float32");
    p.scale = s->data_ptr<float>(), p.groups = s->size(1);
  } else {
    p.kp = k;
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->dim() == 3 && w->size(1) == k,
                "decode_stack: float32 weight [blocks, K, 16]");
  }
  if (b.has_value()) {
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == n, "decode_stack: bias [N]");
    p.bias = b->data_ptr<float>();
  }
  return p;
}

// x [K] -> the row r of the projection's input (float, and int16 for the int8 kernel).
inline void stage_row(const Pass& ps, const Proj& p, const float* x, int64_t r) {
  if (p.scale != nullptr)
    eeserve_linear::int8_quantize_rows(x, 1, p.k, p.kp, ps.xq + r * p.kp, ps.xs + r * (p.kp / CHUNK));
  else if (x != ps.xn + r * p.k)
    std::copy(x, x + p.k, ps.xn + r * p.k);
}

// Tiles of projection p for every row: task t of the phase.
inline void project_task(const Pass& ps, const Proj& p, float* y, int64_t t) {
  const int64_t per = (p.tiles + ps.tile_tasks_div - 1) / ps.tile_tasks_div;
  const int64_t lo = t * per, hi = std::min(p.tiles, lo + per);
  if (p.gguf) {
    eeserve_gguf_linear::stacked_tiles(p.blocks, ps.xn, ps.R, y, p.n, lo, hi);
  } else if (p.scale != nullptr) {
    const eeserve_linear::Int8Args a{ps.xq, ps.xs, static_cast<const int8_t*>(p.w), p.scale, p.bias, y,
                                     ps.R, p.kp, p.n, p.groups};
    eeserve_linear::int8_tiles(a, lo, hi);
  } else {
    const eeserve_linear::F32Args a{ps.xn, static_cast<const float*>(p.w), p.bias, y, ps.R, p.k, p.n};
    eeserve_linear::f32_tiles(a, lo, hi);
  }
}

inline int64_t project_tasks(const Pass& ps, const Proj& p) {
  const int64_t per = (p.tiles + ps.tile_tasks_div - 1) / ps.tile_tasks_div;
  return (p.tiles + per - 1) / per;
}

inline const float* norm_arg(const c10::optional<at::Tensor>& w, int64_t n) {
  TORCH_CHECK(w.has_value() && w->numel() == n && w->scalar_type() == at::kFloat && w->is_contiguous(),
              "decode_stack: norm weights [", n, "] float32");
  return w->data_ptr<float>();
}

// The call's layers from `weights` (per_layer(arch) tensors each, in stack_layout.h's order);
// local[l]: layer l of the call is a sliding-window layer (Gemma 3; empty for Llama).
inline std::vector<Layer> read_layers(const c10::List<c10::optional<at::Tensor>>& weights, Arch arch,
                                      at::IntArrayRef local, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                      int64_t first_layer, int64_t D, int64_t H, int64_t Hkv, int64_t hd, int64_t I) {
  const int64_t n = per_layer(arch), L = static_cast<int64_t>(weights.size()) / n;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * n, "decode_stack: weights hold ", n,
              " tensors per layer");
  TORCH_CHECK(first_layer >= 0 && first_layer + L <= k_pool.size(0), "decode_stack: layers past the pool");
  TORCH_CHECK(arch == Arch::Gemma3 ? static_cast<int64_t>(local.size()) == L : local.empty(),
              "decode_stack: one local flag per Gemma 3 layer, none for Llama");
  const int64_t layer_elems = k_pool.size(1) * Hkv * hd, qkv = (H + 2 * Hkv) * hd;
  std::vector<Layer> layers;
  for (int64_t l = 0; l < L; ++l) {
    auto arg = [&](int64_t j) { return c10::optional<at::Tensor>(weights.get(l * n + j)); };
    float* kc = k_pool.data_ptr<float>() + (first_layer + l) * layer_elems;
    float* vc = v_pool.data_ptr<float>() + (first_layer + l) * layer_elems;
    if (arch == Arch::Llama) {
      using W = LlamaW;
      layers.push_back(Layer{norm_arg(arg(W::norm1), D), norm_arg(arg(W::norm2), D),
                             make_proj(arg(W::qkv_w), arg(W::qkv_s), arg(W::qkv_b), qkv, D),
                             make_proj(arg(W::o_w), arg(W::o_s), {}, D, H * hd),
                             make_proj(arg(W::gate_up_w), arg(W::gate_up_s), {}, 2 * I, D),
                             make_proj(arg(W::down_w), arg(W::down_s), {}, D, I), kc, vc});
      continue;
    }
    using W = Gemma3W;
    Layer y{norm_arg(arg(W::in_norm), D), norm_arg(arg(W::mlp_in_norm), D),
            make_proj(arg(W::qkv_w), arg(W::qkv_s), {}, qkv, D), make_proj(arg(W::o_w), arg(W::o_s), {}, D, H * hd),
            make_proj(arg(W::gate_up_w), arg(W::gate_up_s), {}, 2 * I, D),
            make_proj(arg(W::down_w), arg(W::down_s), {}, D, I), kc, vc};
    y.attn_out_norm = norm_arg(arg(W::attn_out_norm), D), y.mlp_out_norm = norm_arg(arg(W::mlp_out_norm), D);
    y.q_norm = norm_arg(arg(W::q_norm), hd), y.k_norm = norm_arg(arg(W::k_norm), hd);
    y.local = local[l] != 0;
    layers.push_back(y);
  }
  return layers;
}

inline void check_rows(const at::Tensor& h, const at::Tensor& k_pool, const at::Tensor& v_pool,
                       const at::Tensor& slot_mapping, int64_t H, int64_t Hkv) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "decode_stack: h [R, D] float32");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "decode_stack: K/V pools [layers, slots, Hkv, hd] float32, contiguous");
  TORCH_CHECK(k_pool.size(2) == Hkv && H % Hkv == 0 && k_pool.size(3) % 2 == 0,
              "decode_stack: head shapes do not match");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == h.size(0),
              "decode_stack: slot_mapping, one contiguous int64 per row");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < h.size(0); ++r)
    TORCH_CHECK(sm[r] >= 0 && sm[r] < k_pool.size(1), "decode_stack: slot ", sm[r], " outside the pool");
}

// The rows' context (rotary tables [R, hd], slot rows [R, T], lengths [R]) after checking it,
// with each row's attention tasks of KSPLIT positions.
inline Context read_context(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& row_slots,
                            const at::Tensor& row_lens, int64_t R, int64_t hd, int64_t ksplit) {
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == R && cos.size(1) == hd &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "decode_stack: cos/sin [R, hd] float32");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_lens.scalar_type() == at::kLong &&
                  row_slots.is_contiguous() && row_lens.is_contiguous(),
              "decode_stack: row_slots and row_lens must be contiguous int64");
  TORCH_CHECK(row_slots.dim() == 2 && row_slots.size(0) == R && row_lens.numel() == R,
              "decode_stack: one slot row and length per row");
  Context c;
  c.cos = cos.data_ptr<float>(), c.sin = sin.data_ptr<float>();
  c.slots = row_slots.data_ptr<int64_t>(), c.lens = row_lens.data_ptr<int64_t>(), c.T = row_slots.size(1);
  c.first.assign(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(c.lens[r] >= 1 && c.lens[r] <= c.T, "decode_stack: row length ", c.lens[r], " outside [1, T]");
    c.first[r + 1] = c.first[r] + (c.lens[r] + ksplit - 1) / ksplit;
  }
  return c;
}

}  // namespace eeserve_stack
