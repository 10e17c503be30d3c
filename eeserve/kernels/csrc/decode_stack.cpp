// eeserve CPU kernel: a range of Llama decoder layers for a pass of decode rows, in one call and
// one parallel region.
//
// Contract: decode_stack(h [R, D] float32, weights, eps, cos, sin [R, hd], k_pool, v_pool
// [layers, slots, Hkv, hd], first_layer, slot_mapping [R], row_slots [R, T], row_lens [R],
// num_heads, num_kv_heads, intermediate, scale) -> the output [R, D] of layers first_layer ..
// first_layer + L - 1, where weights holds, per layer, the 11 tensors (norm1, norm2, qkv_w,
// qkv_s, qkv_b, o_w, o_s, gate_up_w, gate_up_s, down_w, down_s) that decoder_layer
// (layer_ops.cpp) takes, a projection's scale None when it is float32. Every row attends
// row-wise: row r is one query at its sequence's next position, over row_slots[r, :row_lens[r]]
// (its own slot last), and its new K/V go to slot_mapping[r] of each layer's pool. The result is
// decoder_layer's, layer after layer, with the same linear tiles (linear_tiles.h), attention tasks
// (attend.h) and row arithmetic (row_ops.h): equal up to float summation order.
//
// Why: a decode step's layer is ~15 small steps around 4 projections. As separate ops each costs
// a dispatch, an allocation, and for the projections a parallel region that wakes the other
// core and waits for it: 30-80 us a layer, ~25% of an int8 batch-1 decode step on the 2-core
// machine (docs/cpu-performance.md). Here the threads enter once and walk one fixed list of
// phases; a phase is a set of tasks (tiles of a projection, rows, attention chunks) that the
// threads claim from an atomic counter, and a thread that runs out of tasks waits until the
// phase's tasks are done. Claims are dynamic, so any number of threads (one included) finishes
// the list, and the core that finished the glue early starts streaming the next weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attend.h"
#include "linear_tiles.h"
#include "row_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

namespace {

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

enum class Step { In, Qkv, Rope, Attend, Merge, O, Mid, GateUp, Act, Down, Out };

struct Phase {
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
  Step step = Step::In;
  int64_t layer = 0, tasks = 0;
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
};

Proj make_proj(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& s,
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
void stage_row(const Pass& ps, const Proj& p, const float* x, int64_t r) {
  if (p.scale != nullptr)
    eeserve_linear::int8_quantize_rows(x, 1, p.k, p.kp, ps.xq + r * p.kp, ps.xs + r * (p.kp / CHUNK));
  else if (x != ps.xn + r * p.k)
    std::copy(x, x + p.k, ps.xn + r * p.k);
}

// Tiles of projection p for every row: task t of the phase.
void project_task(const Pass& ps, const Proj& p, float* y, int64_t t) {
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

int64_t project_tasks(const Pass& ps, const Proj& p) {
  const int64_t per = (p.tiles + ps.tile_tasks_div - 1) / ps.tile_tasks_div;
  return (p.tiles + per - 1) / per;
}

// Row r: rotate its query and key heads (HF's rotate-half), write its K/V, scale its query.
void rope_row(const Pass& ps, const Layer& L, int64_t r) {
  const int64_t hd = ps.hd;
  float* row = ps.qkv + r * (ps.H + 2 * ps.Hkv) * hd;
  eeserve_rows::rotate_heads<float>(row, ps.cos + r * hd, ps.sin + r * hd, ps.H + ps.Hkv, hd);
  const int64_t kv = ps.Hkv * hd, slot = ps.slot_mapping[r];
  std::copy(row + ps.H * hd, row + ps.H * hd + kv, L.kc + slot * kv);
  std::copy(row + ps.H * hd + kv, row + ps.H * hd + 2 * kv, L.vc + slot * kv);
  for (int64_t i = 0; i < ps.H * hd; ++i) ps.q[r * ps.H * hd + i] = row[i] * ps.scale;
}

// Scratch that one thread keeps for the whole call.
struct Scratch {
  std::vector<float> scores, buf, o;
};

template <int64_t DC>
void attend_task(const Pass& ps, const Layer& L, int64_t task, Scratch& sc) {
  const int64_t r = std::upper_bound(ps.first.begin(), ps.first.end(), task) - ps.first.begin() - 1;
  const int64_t len = ps.row_lens[r], t0 = (task - ps.first[r]) * eeserve_attend::KSPLIT;
  const int64_t t1 = std::min(len, t0 + eeserve_attend::KSPLIT);
  eeserve_attend::attend_positions<float, DC>(ps.q + r * ps.H * ps.hd, L.kc, L.vc, ps.row_slots + r * ps.T, t0,
                                              t1, len, ps.H, ps.Hkv, ps.hd, sc.scores.data(), sc.buf.data(),
                                              ps.part + task * ps.H * (ps.hd + 2));
}

template <int64_t DC>
void merge_row(const Pass& ps, int64_t r, Scratch& sc) {
  const int64_t n = ps.first[r + 1] - ps.first[r];
  eeserve_attend::merge_partials<float, DC>(ps.part + ps.first[r] * ps.H * (ps.hd + 2), n, ps.H, ps.hd,
                                            sc.o.data(), ps.att + r * ps.H * ps.hd);
}

void add_rows(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// The rows' input of layer l: the pass's h, or the previous layer's down(...) + mid.
const float* layer_input(const Pass& ps, int64_t l) { return l == 0 ? ps.h : ps.hout; }

template <int64_t DC>
void run_task(const Pass& ps, const Phase& ph, int64_t t, Scratch& sc) {
  const Layer& L = ps.layers[ph.layer];
  const int64_t D = ps.D, I = ps.I, Hd = ps.H * ps.hd;
  switch (ph.step) {
    case Step::In:  // t: a row
      if (ph.layer > 0) add_rows(ps.proj + t * D, ps.mid + t * D, ps.hout + t * D, D);
      eeserve_rows::rms_norm_row<float>(layer_input(ps, ph.layer) + t * D, L.norm1, ps.xn + t * D, D, ps.eps);
      return stage_row(ps, L.qkv, ps.xn + t * D, t);
    case Step::Qkv: return project_task(ps, L.qkv, ps.qkv, t);
    case Step::Rope: return rope_row(ps, L, t);
    case Step::Attend: return attend_task<DC>(ps, L, t, sc);
    case Step::Merge: merge_row<DC>(ps, t, sc); return stage_row(ps, L.o, ps.att + t * Hd, t);
    case Step::O: return project_task(ps, L.o, ps.proj, t);
    case Step::Mid:
      add_rows(ps.proj + t * D, layer_input(ps, ph.layer) + t * D, ps.mid + t * D, D);
      eeserve_rows::rms_norm_row<float>(ps.mid + t * D, L.norm2, ps.xn + t * D, D, ps.eps);
      return stage_row(ps, L.gate_up, ps.xn + t * D, t);
    case Step::GateUp: return project_task(ps, L.gate_up, ps.proj, t);
    case Step::Act:
      eeserve_rows::silu_mul_row<float>(ps.proj + t * 2 * I, ps.xn + t * I, I);
      return stage_row(ps, L.down, ps.xn + t * I, t);
    case Step::Down: return project_task(ps, L.down, ps.proj, t);
    case Step::Out: return add_rows(ps.proj + t * D, ps.mid + t * D, ps.hout + t * D, D);
  }
}

// One thread's walk through the phases (every thread runs it; see the file's comment).
template <int64_t DC>
void walk(const Pass& ps, Phase* phases, int64_t n_phases) {
  Scratch sc{std::vector<float>(ps.H * eeserve_attend::KSPLIT), std::vector<float>(ps.hd),
             std::vector<float>(ps.hd)};
  for (int64_t i = 0; i < n_phases; ++i) {
    Phase& ph = phases[i];
    for (int64_t t; (t = ph.next.fetch_add(1, std::memory_order_relaxed)) < ph.tasks;) {
      run_task<DC>(ps, ph, t, sc);
      ph.done.fetch_add(1, std::memory_order_release);
    }
    // Spin: a phase's last tasks take microseconds. Past a few thousand pauses the thread that
    // holds one was likely descheduled (more threads than cores), so give it the core.
    for (int spins = 0; ph.done.load(std::memory_order_acquire) < ph.tasks; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }
}

// The phases of layers [0, L): In, Qkv, Rope, Attend, Merge, O, Mid, GateUp, Act, Down per
// layer, then Out.
std::unique_ptr<Phase[]> plan(const Pass& ps, int64_t& n) {
  const int64_t L = static_cast<int64_t>(ps.layers.size()), R = ps.R;
  n = 10 * L + 1;
  std::unique_ptr<Phase[]> phases(new Phase[n]);
  int64_t i = 0;
  auto add = [&](Step s, int64_t l, int64_t tasks) {
    phases[i].step = s, phases[i].layer = l, phases[i].tasks = tasks;
    ++i;
  };
  for (int64_t l = 0; l < L; ++l) {
    const Layer& y = ps.layers[l];
    add(Step::In, l, R);
    add(Step::Qkv, l, project_tasks(ps, y.qkv));
    add(Step::Rope, l, R);
    add(Step::Attend, l, ps.first[R]);
    add(Step::Merge, l, R);
    add(Step::O, l, project_tasks(ps, y.o));
    add(Step::Mid, l, R);
    add(Step::GateUp, l, project_tasks(ps, y.gate_up));
    add(Step::Act, l, R);
    add(Step::Down, l, project_tasks(ps, y.down));
  }
  add(Step::Out, L - 1, R);
  return phases;
}

std::vector<Layer> read_layers(const c10::List<c10::optional<at::Tensor>>& weights, const at::Tensor& k_pool,
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

void check_rows(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
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

at::Tensor decode_stack(const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, int64_t first_layer, const at::Tensor& slot_mapping,
                        const at::Tensor& row_slots, const at::Tensor& row_lens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t intermediate, double scale) {
  check_rows(h, cos, sin, k_pool, v_pool, slot_mapping, row_slots, row_lens, num_heads, num_kv_heads);
  const int64_t R = h.size(0), D = h.size(1), H = num_heads, Hkv = num_kv_heads, hd = k_pool.size(3);
  const int64_t I = intermediate, Kmax = (std::max({D, H * hd, I}) + CHUNK - 1) / CHUNK * CHUNK;
  Pass ps{R, D, H, Hkv, hd, I, row_slots.size(1), 4 * std::max<int64_t>(1, at::get_num_threads()),
          static_cast<float>(eps), static_cast<float>(scale)};
  ps.layers = read_layers(weights, k_pool, v_pool, first_layer, D, H, Hkv, hd, I);
  ps.first.assign(R + 1, 0);
  const int64_t* ln = row_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) ps.first[r + 1] = ps.first[r] + (ln[r] + eeserve_attend::KSPLIT - 1) / eeserve_attend::KSPLIT;
  at::Tensor out = at::empty({R, D}, h.options());
  at::Tensor fbuf = at::empty({R * (Kmax + Kmax / CHUNK + (H + 2 * Hkv) * hd + 2 * H * hd + D + std::max(D, 2 * I)) +
                                   ps.first[R] * H * (hd + 2)},
                              h.options());
  at::Tensor qbuf = at::empty({R * Kmax}, h.options().dtype(at::kShort));
  float* f = fbuf.data_ptr<float>();
  auto take = [&](int64_t n) { float* p = f; f += n; return p; };
  ps.h = h.data_ptr<float>(), ps.hout = out.data_ptr<float>();
  ps.xn = take(R * Kmax), ps.xs = take(R * Kmax / CHUNK), ps.qkv = take(R * (H + 2 * Hkv) * hd);
  ps.q = take(R * H * hd), ps.att = take(R * H * hd), ps.mid = take(R * D), ps.proj = take(R * std::max(D, 2 * I));
  ps.part = take(ps.first[R] * H * (hd + 2));
  ps.xq = qbuf.data_ptr<int16_t>();
  ps.cos = cos.data_ptr<float>(), ps.sin = sin.data_ptr<float>();
  ps.slot_mapping = slot_mapping.data_ptr<int64_t>(), ps.row_slots = row_slots.data_ptr<int64_t>();
  ps.row_lens = ln;
  int64_t n = 0;
  const std::unique_ptr<Phase[]> phases = plan(ps, n);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (hd == 64) return walk<64>(ps, phases.get(), n);
    if (hd == 128) return walk<128>(ps, phases.get(), n);
    walk<0>(ps, phases.get(), n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def(
      "decode_stack(Tensor h, Tensor?[] weights, float eps, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
      "Tensor(b!) v_pool, int first_layer, Tensor slot_mapping, Tensor row_slots, Tensor row_lens, "
      "int num_heads, int num_kv_heads, int intermediate, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) { m.impl("decode_stack", &decode_stack); }
