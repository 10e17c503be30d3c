// eeserve CPU kernel internals: the data of one decode_stack pass (decode_stack.cpp), its
// projections' arguments and their tasks. Included by decode_stack.cpp only.
//
// Contract: a Proj is one packed projection (float32 [tiles * 2, K, 16], or int8 with scales, as
// linear_tiles.h computes them); a Pass holds the call's shapes, per-row buffers, layers and exit
// checks; a Phase is one step of the walk (a layer's or a check's), whose tasks the threads claim.

#pragma once

#include <ATen/ATen.h>

#include "linear_tiles.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace eeserve_stack {

using eeserve_linear::CHUNK;
using eeserve_linear::TILE;
constexpr int64_t PER_LAYER = 11;  // tensors per layer in `weights`

// One projection: float32 ([tiles * 2, K, 16]) or int8 ([tiles * 2, Kp / 2, 16, 2] with scales).
struct Proj {
  const void* w = nullptr;
  const float* scale = nullptr;  // nullptr: float32
  const float* bias = nullptr;
  int64_t n = 0, k = 0, kp = 0, tiles = 0, groups = 0;
};

struct Layer {
  const float* norm1;
  const float* norm2;
  Proj qkv, o, gate_up, down;
  float* kc;  // [slots, Hkv, hd]
  float* vc;
};

// An exit check after a layer of the pass: its measure's confidence per row (decode_stack_checked).
enum class Measure { ShortlistMaxProb = 0, ShortlistMargin = 1, Classifier = 2 };

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
  int64_t R, D, H, Hkv, hd, I, T, tile_tasks_div;
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
  const float *cos, *sin;
  const int64_t *slot_mapping, *row_slots, *row_lens;
  std::vector<int64_t> first;  // row r's attention tasks: [first[r], first[r + 1])
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
  if (p.scale != nullptr) {
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

inline std::vector<Layer> read_layers(const c10::List<c10::optional<at::Tensor>>& weights, const at::Tensor& k_pool,
                               const at::Tensor& v_pool, int64_t first_layer, int64_t D, int64_t H,
                               int64_t Hkv, int64_t hd, int64_t I) {
  const int64_t L = static_cast<int64_t>(weights.size()) / PER_LAYER;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * PER_LAYER,
              "decode_stack: weights hold 11 tensors per layer");
  TORCH_CHECK(first_layer >= 0 && first_layer + L <= k_pool.size(0), "decode_stack: layers past the pool");
  const int64_t layer_elems = k_pool.size(1) * Hkv * hd;
  std::vector<Layer> layers;
  for (int64_t l = 0; l < L; ++l) {
    auto arg = [&](int64_t j) { return c10::optional<at::Tensor>(weights.get(l * PER_LAYER + j)); };
    const auto n1 = arg(0), n2 = arg(1);
    TORCH_CHECK(n1.has_value() && n2.has_value() && n1->numel() == D && n2->numel() == D &&
                    n1->scalar_type() == at::kFloat && n1->is_contiguous() && n2->is_contiguous(),
                "decode_stack: norm weights [D] float32");
    Layer y{n1->data_ptr<float>(), n2->data_ptr<float>(),
            make_proj(arg(2), arg(3), arg(4), (H + 2 * Hkv) * hd, D), make_proj(arg(5), arg(6), {}, D, H * hd),
            make_proj(arg(7), arg(8), {}, 2 * I, D), make_proj(arg(9), arg(10), {}, D, I),
            k_pool.data_ptr<float>() + (first_layer + l) * layer_elems,
            v_pool.data_ptr<float>() + (first_layer + l) * layer_elems};
    layers.push_back(y);
  }
  return layers;
}

inline void check_rows(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                const at::Tensor& v_pool, const at::Tensor& slot_mapping, const at::Tensor& row_slots,
                const at::Tensor& row_lens, int64_t H, int64_t Hkv) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "decode_stack: h [R, D] float32");
  const int64_t R = h.size(0);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "decode_stack: K/V pools [layers, slots, Hkv, hd] float32, contiguous");
  const int64_t hd = k_pool.size(3);
  TORCH_CHECK(k_pool.size(2) == Hkv && H % Hkv == 0 && hd % 2 == 0, "decode_stack: head shapes do not match");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == R && cos.size(1) == hd &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "decode_stack: cos/sin [R, hd] float32");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && row_slots.scalar_type() == at::kLong &&
                  row_lens.scalar_type() == at::kLong && slot_mapping.is_contiguous() && row_slots.is_contiguous() &&
                  row_lens.is_contiguous(),
              "decode_stack: slot_mapping, row_slots and row_lens must be contiguous int64");
  TORCH_CHECK(slot_mapping.numel() == R && row_slots.dim() == 2 && row_slots.size(0) == R && row_lens.numel() == R,
              "decode_stack: one slot, slot row and length per row");
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const int64_t* ln = row_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sm[r] >= 0 && sm[r] < k_pool.size(1), "decode_stack: slot ", sm[r], " outside the pool");
    TORCH_CHECK(ln[r] >= 1 && ln[r] <= row_slots.size(1), "decode_stack: row length ", ln[r], " outside [1, T]");
  }
}

}  // namespace eeserve_stack
