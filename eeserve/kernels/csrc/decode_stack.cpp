// eeserve CPU kernel: a range of decoder layers (Llama or Gemma 3) for a pass of decode rows, in one
// call and one parallel region.
//
// Contract: decode_stack(h [R, D] float32, weights, eps, cos, sin [R, hd], k_pool, v_pool
// [layers, slots, Hkv, hd], first_layer, slot_mapping [R], row_slots [R, T], row_lens [R],
// num_heads, num_kv_heads, intermediate, scale, arch, local_layers, local_cos, local_sin,
// local_slots, local_lens) -> the output [R, D] of layers first_layer .. first_layer + L - 1.
// arch 0 (Llama): weights holds, per layer, the tensors of stack_layout.h's Llama table (norm1,
// norm2, qkv_w, qkv_s, qkv_b, o_w, o_s, gate_up_w, gate_up_s, down_w, down_s: decoder_layer's,
// layer_ops.cpp), and the local arguments are empty. arch 1 (Gemma 3): those of its Gemma 3 table
// (gemma3_layer's: in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm, q_norm, k_norm, then the four
// projections' weight and scale); local_layers[l] says whether layer l of the call is a
// sliding-window layer, which rotates with local_cos/local_sin and attends over
// local_slots[r, :local_lens[r]] (the window). stack_layout() returns those tables by name.
// A projection's scale is None when it is float32. Every row attends row-wise: row r is one query
// at its sequence's next position, over row_slots[r, :row_lens[r]] (its own slot last), and its
// new K/V go to slot_mapping[r] of each layer's pool. The result is decoder_layer's (or
// gemma3_layer's), layer after layer, with the same linear tiles (linear_tiles.h), attention tasks
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
//
// decode_stack_checked adds exit checks between the layers (a shortlist's softmax confidence or
// a classifier probe, per row; a check's tensors and the measure codes in stack_layout.h) and
// stops after the first check where a row may leave: a decode step where nothing exits runs all
// its layers and checks in one call, without returning to Python at each exit layer
// (docs/early-exit.md, "Cost of a check").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attend.h"
#include "linear_tiles.h"
#include "row_ops.h"
#include "stack_checks.h"
#include "stack_layout.h"
#include "stack_pass.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using namespace eeserve_stack;
using eeserve_linear::CHUNK;
using eeserve_linear::TILE;

const Context& context(const Pass& ps, const Layer& L) { return L.local ? ps.local : ps.global; }

// Row r: norm its query and key heads (Gemma 3), rotate them (HF's rotate-half), write its K/V,
// scale its query.
void rope_row(const Pass& ps, const Layer& L, int64_t r) {
  const int64_t hd = ps.hd;
  float* row = ps.qkv + r * (ps.H + 2 * ps.Hkv) * hd;
  if (L.q_norm != nullptr)  // the query heads, then the key heads
    for (int64_t i = 0; i < ps.H + ps.Hkv; ++i)
      eeserve_rows::rms_norm_row<float>(row + i * hd, i < ps.H ? L.q_norm : L.k_norm, row + i * hd, hd, ps.eps);
  const Context& c = context(ps, L);
  eeserve_rows::rotate_heads<float>(row, c.cos + r * hd, c.sin + r * hd, ps.H + ps.Hkv, hd);
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
  const Context& c = context(ps, L);
  const int64_t r = std::upper_bound(c.first.begin(), c.first.end(), task) - c.first.begin() - 1;
  const int64_t len = c.lens[r], t0 = (task - c.first[r]) * eeserve_attend::KSPLIT;
  const int64_t t1 = std::min(len, t0 + eeserve_attend::KSPLIT);
  eeserve_attend::attend_positions<float, DC>(ps.q + r * ps.H * ps.hd, L.kc, L.vc, c.slots + r * c.T, t0, t1, len,
                                              ps.H, ps.Hkv, ps.hd, sc.scores.data(), sc.buf.data(),
                                              ps.part + task * ps.H * (ps.hd + 2));
}

template <int64_t DC>
void merge_row(const Pass& ps, const Layer& L, int64_t r, Scratch& sc) {
  const Context& c = context(ps, L);
  const int64_t n = c.first[r + 1] - c.first[r];
  eeserve_attend::merge_partials<float, DC>(ps.part + c.first[r] * ps.H * (ps.hd + 2), n, ps.H, ps.hd,
                                            sc.o.data(), ps.att + r * ps.H * ps.hd);
}

void add_rows(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// A projection's output row y added to the residual row r: out = y + r, or with Gemma 3's output
// norm w, out = norm(y) + r. y stays as it is (a check's Out and the next layer's In both write
// the same out from it); out must not alias r.
void residual_row(const Pass& ps, const float* w, const float* y, const float* r, float* out) {
  if (w == nullptr) return add_rows(y, r, out, ps.D);
  eeserve_rows::rms_norm_row<float>(y, w, out, ps.D, ps.eps);
  for (int64_t i = 0; i < ps.D; ++i) out[i] += r[i];
}

// The rows' input of layer l: the pass's h, or the previous layer's down(...) + mid.
const float* layer_input(const Pass& ps, int64_t l) { return l == 0 ? ps.h : ps.hout; }

template <int64_t DC>
void run_task(const Pass& ps, const Phase& ph, int64_t t, Scratch& sc) {
  const Layer& L = ps.layers[ph.layer];
  const int64_t D = ps.D, I = ps.I, Hd = ps.H * ps.hd;
  switch (ph.step) {
    case Step::In:  // t: a row
      if (ph.layer > 0)
        residual_row(ps, ps.layers[ph.layer - 1].mlp_out_norm, ps.proj + t * D, ps.mid + t * D, ps.hout + t * D);
      eeserve_rows::rms_norm_row<float>(layer_input(ps, ph.layer) + t * D, L.norm1, ps.xn + t * D, D, ps.eps);
      return stage_row(ps, L.qkv, ps.xn + t * D, t);
    case Step::Qkv: return project_task(ps, L.qkv, ps.qkv, t);
    case Step::Rope: return rope_row(ps, L, t);
    case Step::Attend: return attend_task<DC>(ps, L, t, sc);
    case Step::Merge: merge_row<DC>(ps, L, t, sc); return stage_row(ps, L.o, ps.att + t * Hd, t);
    case Step::O: return project_task(ps, L.o, ps.proj, t);
    case Step::Mid:
      residual_row(ps, L.attn_out_norm, ps.proj + t * D, layer_input(ps, ph.layer) + t * D, ps.mid + t * D);
      eeserve_rows::rms_norm_row<float>(ps.mid + t * D, L.norm2, ps.xn + t * D, D, ps.eps);
      return stage_row(ps, L.gate_up, ps.xn + t * D, t);
    case Step::GateUp: return project_task(ps, L.gate_up, ps.proj, t);
    case Step::Act:
      if (ps.arch == Arch::Gemma3)
        eeserve_rows::gelu_tanh_mul_row<float>(ps.proj + t * 2 * I, ps.xn + t * I, I);
      else
        eeserve_rows::silu_mul_row<float>(ps.proj + t * 2 * I, ps.xn + t * I, I);
      return stage_row(ps, L.down, ps.xn + t * I, t);
    case Step::Down: return project_task(ps, L.down, ps.proj, t);
    case Step::Out: return residual_row(ps, L.mlp_out_norm, ps.proj + t * D, ps.mid + t * D, ps.hout + t * D);
    case Step::CkStage:
    case Step::CkPre:
    case Step::CkNorm:
    case Step::CkRows:
    case Step::CkConf: return check_task(ps, ph, t);
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
    // Every thread reads the same flag: its last writer finished before the phase did.
    if (ph.step == Step::CkConf && ps.stopped.load(std::memory_order_relaxed) >= 0) return;
  }
}

// The phases of layers [0, L): In, Qkv, Rope, Attend, Merge, O, Mid, GateUp, Act, Down per
// layer; after a layer that a check reads, Out and the check's steps; Out after the last layer.
std::unique_ptr<Phase[]> plan(const Pass& ps, int64_t& n) {
  const int64_t L = static_cast<int64_t>(ps.layers.size()), R = ps.R;
  const int64_t C = static_cast<int64_t>(ps.checks.size());
  std::unique_ptr<Phase[]> phases(new Phase[10 * L + 1 + 6 * C]);
  int64_t i = 0;
  auto add = [&](Step s, int64_t l, int64_t tasks, int64_t check = -1) {
    phases[i].step = s, phases[i].layer = l, phases[i].tasks = tasks, phases[i].check = check;
    ++i;
  };
  int64_t c = 0;
  bool out = false;  // hout holds the last planned layer's output
  for (int64_t l = 0; l < L; ++l) {
    const Layer& y = ps.layers[l];
    add(Step::In, l, R);
    add(Step::Qkv, l, project_tasks(ps, y.qkv));
    add(Step::Rope, l, R);
    add(Step::Attend, l, context(ps, y).first[R]);
    add(Step::Merge, l, R);
    add(Step::O, l, project_tasks(ps, y.o));
    add(Step::Mid, l, R);
    add(Step::GateUp, l, project_tasks(ps, y.gate_up));
    add(Step::Act, l, R);
    add(Step::Down, l, project_tasks(ps, y.down));
    out = false;
    for (; c < C && ps.checks[c].after == l; ++c) {
      const Check& k = ps.checks[c];
      if (!out) add(Step::Out, l, R), out = true;
      if (ps.measure != Measure::Classifier) {
        if (k.pre.n > 0) add(Step::CkStage, l, R, c), add(Step::CkPre, l, project_tasks(ps, k.pre), c);
        add(Step::CkNorm, l, R, c);
        add(Step::CkRows, l, project_tasks(ps, k.rows), c);
      }
      add(Step::CkConf, l, R, c);
    }
  }
  if (!out) add(Step::Out, L - 1, R);
  n = i;
  return phases;
}

// decode_stack's arguments (decode_stack_checked's first ones), as the op receives them.
struct StackArgs {
  const at::Tensor& h;
  const c10::List<c10::optional<at::Tensor>>& weights;
  double eps;
  const at::Tensor &cos, &sin, &k_pool, &v_pool;
  int64_t first_layer;
  const at::Tensor &slot_mapping, &row_slots, &row_lens;
  int64_t num_heads, num_kv_heads, intermediate;
  double scale;
  Arch arch;
  at::IntArrayRef local_layers;
  const c10::optional<at::Tensor>&local_cos, &local_sin, &local_slots, &local_lens;
};

// Reads the call's rows and layers into ps (its checks already there), runs every thread's walk
// and returns the output [R, D]: the last layer's, or that of the layer whose check stopped the
// pass. Kc: the checks' shortlist rows (0 without).
at::Tensor run_stack(Pass& ps, const StackArgs& a, int64_t Kc) {
  const at::Tensor& h = a.h;
  check_rows(h, a.k_pool, a.v_pool, a.slot_mapping, a.num_heads, a.num_kv_heads);
  const int64_t R = h.size(0), D = h.size(1), H = a.num_heads, Hkv = a.num_kv_heads, hd = a.k_pool.size(3);
  const int64_t I = a.intermediate, Kmax = (std::max({D, H * hd, I}) + CHUNK - 1) / CHUNK * CHUNK;
  ps.R = R, ps.D = D, ps.H = H, ps.Hkv = Hkv, ps.hd = hd, ps.I = I;
  ps.tile_tasks_div = 4 * std::max<int64_t>(1, at::get_num_threads());
  ps.eps = static_cast<float>(a.eps), ps.scale = static_cast<float>(a.scale);
  ps.arch = a.arch;
  ps.layers = read_layers(a.weights, ps.arch, a.local_layers, a.k_pool, a.v_pool, a.first_layer, D, H, Hkv, hd, I);
  ps.global = read_context(a.cos, a.sin, a.row_slots, a.row_lens, R, hd, eeserve_attend::KSPLIT);
  int64_t tasks = ps.global.first[R];
  if (std::any_of(ps.layers.begin(), ps.layers.end(), [](const Layer& y) { return y.local; })) {
    TORCH_CHECK(a.local_cos && a.local_sin && a.local_slots && a.local_lens,
                "decode_stack: local layers need their rotary tables, slots and lengths");
    ps.local = read_context(*a.local_cos, *a.local_sin, *a.local_slots, *a.local_lens, R, hd, eeserve_attend::KSPLIT);
    tasks = std::max(tasks, ps.local.first[R]);
  }
  at::Tensor out = at::empty({R, D}, h.options());
  at::Tensor fbuf = at::empty({R * (Kmax + Kmax / CHUNK + (H + 2 * Hkv) * hd + 2 * H * hd + D + std::max(D, 2 * I)) +
                                   tasks * H * (hd + 2) + R * (D + Kc)},
                              h.options());
  at::Tensor qbuf = at::empty({R * Kmax}, h.options().dtype(at::kShort));
  float* f = fbuf.data_ptr<float>();
  auto take = [&](int64_t n) { float* p = f; f += n; return p; };
  ps.h = h.data_ptr<float>(), ps.hout = out.data_ptr<float>();
  ps.xn = take(R * Kmax), ps.xs = take(R * Kmax / CHUNK), ps.qkv = take(R * (H + 2 * Hkv) * hd);
  ps.q = take(R * H * hd), ps.att = take(R * H * hd), ps.mid = take(R * D), ps.proj = take(R * std::max(D, 2 * I));
  ps.part = take(tasks * H * (hd + 2));
  ps.ck_y = take(R * D), ps.ck_logits = take(R * Kc);
  ps.xq = qbuf.data_ptr<int16_t>();
  ps.slot_mapping = a.slot_mapping.data_ptr<int64_t>();
  int64_t n = 0;
  const std::unique_ptr<Phase[]> phases = plan(ps, n);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    if (hd == 64) return walk<64>(ps, phases.get(), n);
    if (hd == 128) return walk<128>(ps, phases.get(), n);
    if (hd == 256) return walk<256>(ps, phases.get(), n);
    walk<0>(ps, phases.get(), n);
  });
  return out;
}

at::Tensor decode_stack(const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, int64_t first_layer, const at::Tensor& slot_mapping,
                        const at::Tensor& row_slots, const at::Tensor& row_lens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t intermediate, double scale, int64_t arch,
                        at::IntArrayRef local_layers, const c10::optional<at::Tensor>& local_cos,
                        const c10::optional<at::Tensor>& local_sin, const c10::optional<at::Tensor>& local_slots,
                        const c10::optional<at::Tensor>& local_lens) {
  Pass ps{};
  const StackArgs a{h, weights, eps, cos, sin, k_pool, v_pool, first_layer, slot_mapping, row_slots, row_lens,
                    num_heads, num_kv_heads, intermediate, scale, read_arch(arch), local_layers, local_cos, local_sin,
                    local_slots, local_lens};
  return run_stack(ps, a, 0);
}

// decode_stack with exit checks between its layers: check c reads the output of layer
// check_after[c] (0-based in the call) and writes the rows' confidence to conf[c]; the pass stops
// after the first check where a row's confidence reaches its threshold (-inf: stop there; +inf or
// NaN: never). Returns (the output of the last layer run, conf [checks, R] with NaN for the checks
// not reached, the check that stopped the pass or -1).
std::tuple<at::Tensor, at::Tensor, int64_t> decode_stack_checked(
    const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, double eps, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t first_layer,
    const at::Tensor& slot_mapping, const at::Tensor& row_slots, const at::Tensor& row_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t intermediate, double scale, int64_t arch, at::IntArrayRef local_layers,
    const c10::optional<at::Tensor>& local_cos, const c10::optional<at::Tensor>& local_sin,
    const c10::optional<at::Tensor>& local_slots, const c10::optional<at::Tensor>& local_lens,
    at::IntArrayRef check_after, at::ArrayRef<double> check_eps,
    const c10::List<c10::optional<at::Tensor>>& check_weights, int64_t measure, int64_t shortlist_rows,
    const at::Tensor& thresholds) {
  TORCH_CHECK(measure >= 0 && measure < static_cast<int64_t>(Measure::count),
              "decode_stack_checked: a measure code of stack_layout()'s measures");
  const Arch ar = read_arch(arch);
  const Measure m = static_cast<Measure>(measure);
  const int64_t K = m == Measure::Classifier ? 0 : shortlist_rows;
  TORCH_CHECK(m == Measure::Classifier || K > 0, "decode_stack_checked: a shortlist needs rows");
  at::Tensor conf = at::full({static_cast<int64_t>(check_after.size()), h.size(0)},
                             std::numeric_limits<float>::quiet_NaN(), h.options());
  Pass ps{};
  ps.measure = m;
  const int64_t L = static_cast<int64_t>(weights.size()) / per_layer(ar);
  ps.checks = read_checks(check_after, check_eps, check_weights, m, K, thresholds, conf, L, h.size(1));
  const StackArgs a{h, weights, eps, cos, sin, k_pool, v_pool, first_layer, slot_mapping, row_slots, row_lens,
                    num_heads, num_kv_heads, intermediate, scale, ar, local_layers, local_cos, local_sin,
                    local_slots, local_lens};
  at::Tensor out = run_stack(ps, a, K);
  return {out, conf, ps.stopped.load()};
}

// The names of the tables in stack_layout.h, in their order: (layer types, a Llama layer's
// tensors, a Gemma 3 layer's, a check's, measures). kernels/fused.py checks its own against them.
template <size_t N>
c10::List<std::string> names(const char* const (&table)[N]) {
  c10::List<std::string> out;
  for (const char* name : table) out.push_back(name);
  return out;
}

std::tuple<c10::List<std::string>, c10::List<std::string>, c10::List<std::string>, c10::List<std::string>,
           c10::List<std::string>>
stack_layout() {
  return {names(ARCH_NAMES), names(LLAMA_TENSORS), names(GEMMA3_TENSORS), names(CHECK_TENSORS), names(MEASURE_NAMES)};
}

}  // namespace

// The arguments decode_stack and decode_stack_checked share.
#define EESERVE_STACK_ARGS                                                                                  \
  "Tensor h, Tensor?[] weights, float eps, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, " \
  "int first_layer, Tensor slot_mapping, Tensor row_slots, Tensor row_lens, int num_heads, "               \
  "int num_kv_heads, int intermediate, float scale, int arch, int[] local_layers, Tensor? local_cos, "      \
  "Tensor? local_sin, Tensor? local_slots, Tensor? local_lens"

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def("decode_stack(" EESERVE_STACK_ARGS ") -> Tensor");
  m.def("decode_stack_checked(" EESERVE_STACK_ARGS
        ", int[] check_after, float[] check_eps, Tensor?[] check_weights, int measure, int shortlist_rows, "
        "Tensor thresholds) -> (Tensor, Tensor, int)");
  // No tensor argument to dispatch on: one kernel for every backend.
  m.def("stack_layout() -> (str[] archs, str[] llama, str[] gemma3, str[] check, str[] measures)", &stack_layout);
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("decode_stack", &decode_stack);
  m.impl("decode_stack_checked", &decode_stack_checked);
}
