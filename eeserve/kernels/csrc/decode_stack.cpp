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
//
// decode_stack_checked adds exit checks between the layers (a shortlist's softmax confidence or
// a classifier probe, per row) and stops after the first check where a row may leave: a decode
// step where nothing exits runs all its layers and checks in one call, without returning to
// Python at each exit layer (docs/early-exit.md, "Cost of a check").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attend.h"
#include "linear_tiles.h"
#include "row_ops.h"
#include "stack_pass.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using namespace eeserve_stack;
using eeserve_linear::CHUNK;
using eeserve_linear::TILE;

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

// A row's confidence from its K shortlist logits: the softmax's top probability, or its margin
// over the second (measures.confidence's arithmetic, in two passes over the row).
float shortlist_conf(const float* x, int64_t K, bool margin) {
  float m1 = -std::numeric_limits<float>::infinity(), m2 = m1;
  for (int64_t k = 0; k < K; ++k) {
    if (x[k] > m1) {
      m2 = m1, m1 = x[k];
    } else if (x[k] > m2) {
      m2 = x[k];
    }
  }
  float sum = 0.f;
  for (int64_t k = 0; k < K; ++k) sum += std::exp(x[k] - m1);
  return margin ? (1.f - std::exp(m2 - m1)) / sum : 1.f / sum;
}

// Task t (a row, or tiles of a projection) of a check's step. The check reads hout, the output
// of its layer, and leaves it as it is.
void check_task(const Pass& ps, const Phase& ph, int64_t t) {
  const Check& c = ps.checks[ph.check];
  const int64_t D = ps.D;
  const float* x = ps.hout + t * D;
  switch (ph.step) {
    case Step::CkStage: return stage_row(ps, c.pre, x, t);
    case Step::CkPre: return project_task(ps, c.pre, ps.ck_y, t);
    case Step::CkNorm:
      eeserve_rows::rms_norm_row<float>(c.pre.n > 0 ? ps.ck_y + t * D : x, c.norm, ps.xn + t * D, D, c.eps);
      return stage_row(ps, c.rows, ps.xn + t * D, t);
    case Step::CkRows: return project_task(ps, c.rows, ps.ck_logits, t);
    default: break;
  }
  float conf;
  if (ps.measure == Measure::Classifier) {
    float dot = c.probe_bias;
    for (int64_t d = 0; d < D; ++d) dot += x[d] * c.probe[d];
    conf = 1.f / (1.f + std::exp(-dot));
  } else {
    conf = shortlist_conf(ps.ck_logits + t * c.rows.n, c.rows.n, ps.measure == Measure::ShortlistMargin);
  }
  c.conf[t] = conf;
  if (conf >= c.threshold[t]) ps.stopped.store(ph.check, std::memory_order_relaxed);
}

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
    add(Step::Attend, l, ps.first[R]);
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

// Reads the call's layers into ps (its checks already there), runs every thread's walk and
// returns the output [R, D]: the last layer's, or that of the layer whose check stopped the pass.
at::Tensor run_stack(Pass& ps, const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights,
                     double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                     const at::Tensor& v_pool, int64_t first_layer, const at::Tensor& slot_mapping,
                     const at::Tensor& row_slots, const at::Tensor& row_lens, int64_t num_heads,
                     int64_t num_kv_heads, int64_t intermediate, double scale, int64_t Kc) {
  check_rows(h, cos, sin, k_pool, v_pool, slot_mapping, row_slots, row_lens, num_heads, num_kv_heads);
  const int64_t R = h.size(0), D = h.size(1), H = num_heads, Hkv = num_kv_heads, hd = k_pool.size(3);
  const int64_t I = intermediate, Kmax = (std::max({D, H * hd, I}) + CHUNK - 1) / CHUNK * CHUNK;
  ps.R = R, ps.D = D, ps.H = H, ps.Hkv = Hkv, ps.hd = hd, ps.I = I, ps.T = row_slots.size(1);
  ps.tile_tasks_div = 4 * std::max<int64_t>(1, at::get_num_threads());
  ps.eps = static_cast<float>(eps), ps.scale = static_cast<float>(scale);
  ps.layers = read_layers(weights, k_pool, v_pool, first_layer, D, H, Hkv, hd, I);
  ps.first.assign(R + 1, 0);
  const int64_t* ln = row_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) ps.first[r + 1] = ps.first[r] + (ln[r] + eeserve_attend::KSPLIT - 1) / eeserve_attend::KSPLIT;
  at::Tensor out = at::empty({R, D}, h.options());
  at::Tensor fbuf = at::empty({R * (Kmax + Kmax / CHUNK + (H + 2 * Hkv) * hd + 2 * H * hd + D + std::max(D, 2 * I)) +
                                   ps.first[R] * H * (hd + 2) + R * (D + Kc)},
                              h.options());
  at::Tensor qbuf = at::empty({R * Kmax}, h.options().dtype(at::kShort));
  float* f = fbuf.data_ptr<float>();
  auto take = [&](int64_t n) { float* p = f; f += n; return p; };
  ps.h = h.data_ptr<float>(), ps.hout = out.data_ptr<float>();
  ps.xn = take(R * Kmax), ps.xs = take(R * Kmax / CHUNK), ps.qkv = take(R * (H + 2 * Hkv) * hd);
  ps.q = take(R * H * hd), ps.att = take(R * H * hd), ps.mid = take(R * D), ps.proj = take(R * std::max(D, 2 * I));
  ps.part = take(ps.first[R] * H * (hd + 2));
  ps.ck_y = take(R * D), ps.ck_logits = take(R * Kc);
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

at::Tensor decode_stack(const at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, int64_t first_layer, const at::Tensor& slot_mapping,
                        const at::Tensor& row_slots, const at::Tensor& row_lens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t intermediate, double scale) {
  Pass ps{};
  return run_stack(ps, h, weights, eps, cos, sin, k_pool, v_pool, first_layer, slot_mapping, row_slots, row_lens,
                   num_heads, num_kv_heads, intermediate, scale, 0);
}

// The checks of decode_stack_checked: 6 tensors each in `weights` (shortlist: pre weight, pre
// scales, pre bias, norm weight, rows weight, rows scales; classifier: weight [D], -, bias [1]).
std::vector<Check> read_checks(at::IntArrayRef after, at::ArrayRef<double> eps,
                               const c10::List<c10::optional<at::Tensor>>& w, Measure m, int64_t K,
                               const at::Tensor& thresholds, at::Tensor& conf, int64_t L, int64_t D) {
  const int64_t C = static_cast<int64_t>(after.size());
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == C && static_cast<int64_t>(w.size()) == 6 * C,
              "decode_stack_checked: one eps and 6 tensors per check");
  TORCH_CHECK(thresholds.scalar_type() == at::kFloat && thresholds.is_contiguous() && thresholds.dim() == 2 &&
                  thresholds.size(0) == C && thresholds.size(1) == conf.size(1),
              "decode_stack_checked: thresholds [checks, R] float32");
  std::vector<Check> checks(C);
  for (int64_t c = 0; c < C; ++c) {
    auto arg = [&](int64_t j) { return c10::optional<at::Tensor>(w.get(6 * c + j)); };
    TORCH_CHECK(after[c] >= 0 && after[c] < L && (c == 0 || after[c] > after[c - 1]),
                "decode_stack_checked: check layers increasing, within the call's layers");
    Check& k = checks[c];
    k.after = after[c], k.eps = static_cast<float>(eps[c]);
    k.threshold = thresholds.data_ptr<float>() + c * conf.size(1), k.conf = conf.data_ptr<float>() + c * conf.size(1);
    if (m == Measure::Classifier) {
      const auto pw = arg(0), pb = arg(2);
      TORCH_CHECK(pw.has_value() && pb.has_value() && pw->numel() == D && pb->numel() == 1 &&
                      pw->scalar_type() == at::kFloat && pw->is_contiguous() && pb->scalar_type() == at::kFloat,
                  "decode_stack_checked: a classifier's weight [D] and bias [1], float32");
      k.probe = pw->data_ptr<float>(), k.probe_bias = *pb->data_ptr<float>();  // no dispatch per step
      continue;
    }
    if (arg(0).has_value()) k.pre = make_proj(arg(0), arg(1), arg(2), D, D);
    const auto nw = arg(3);
    TORCH_CHECK(nw.has_value() && nw->numel() == D && nw->scalar_type() == at::kFloat && nw->is_contiguous(),
                "decode_stack_checked: a norm weight [D] float32");
    k.norm = nw->data_ptr<float>();
    k.rows = make_proj(arg(4), arg(5), {}, K, D);
  }
  return checks;
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
    int64_t num_kv_heads, int64_t intermediate, double scale, at::IntArrayRef check_after,
    at::ArrayRef<double> check_eps, const c10::List<c10::optional<at::Tensor>>& check_weights, int64_t measure,
    int64_t shortlist_rows, const at::Tensor& thresholds) {
  TORCH_CHECK(measure >= 0 && measure <= 2, "decode_stack_checked: measure 0 (max prob), 1 (margin), 2 (classifier)");
  const Measure m = static_cast<Measure>(measure);
  const int64_t K = m == Measure::Classifier ? 0 : shortlist_rows;
  TORCH_CHECK(m == Measure::Classifier || K > 0, "decode_stack_checked: a shortlist needs rows");
  at::Tensor conf = at::full({static_cast<int64_t>(check_after.size()), h.size(0)},
                             std::numeric_limits<float>::quiet_NaN(), h.options());
  Pass ps{};
  ps.measure = m;
  const int64_t L = static_cast<int64_t>(weights.size()) / PER_LAYER;
  ps.checks = read_checks(check_after, check_eps, check_weights, m, K, thresholds, conf, L, h.size(1));
  at::Tensor out = run_stack(ps, h, weights, eps, cos, sin, k_pool, v_pool, first_layer, slot_mapping, row_slots,
                             row_lens, num_heads, num_kv_heads, intermediate, scale, K);
  return {out, conf, ps.stopped.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eeserve, m) {
  m.def(
      "decode_stack(Tensor h, Tensor?[] weights, float eps, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
      "Tensor(b!) v_pool, int first_layer, Tensor slot_mapping, Tensor row_slots, Tensor row_lens, "
      "int num_heads, int num_kv_heads, int intermediate, float scale) -> Tensor");
  m.def(
      "decode_stack_checked(Tensor h, Tensor?[] weights, float eps, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
      "Tensor(b!) v_pool, int first_layer, Tensor slot_mapping, Tensor row_slots, Tensor row_lens, "
      "int num_heads, int num_kv_heads, int intermediate, float scale, int[] check_after, float[] check_eps, "
      "Tensor?[] check_weights, int measure, int shortlist_rows, Tensor thresholds) -> (Tensor, Tensor, int)");
}

TORCH_LIBRARY_IMPL(eeserve, CPU, m) {
  m.impl("decode_stack", &decode_stack);
  m.impl("decode_stack_checked", &decode_stack_checked);
}
