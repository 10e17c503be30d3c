// eeserve CPU kernel internals: the exit checks of decode_stack_checked (decode_stack.cpp), read
// from the op's arguments and computed per task between the layers. Included by decode_stack.cpp
// only.
//
// Contract: read_checks turns the op's check arguments into Checks (validated); check_task runs
// task t of a check's phase: the tuned head's adapter tiles, the unit RMS norm per row, the
// shortlist rows' tiles, or the confidence per row (a shortlist's softmax top probability or
// margin, or a classifier's sigmoid), which raises the pass's `stopped` flag when a row reaches
// its threshold.

#pragma once

#include <ATen/ATen.h>

#include "row_ops.h"
#include "stack_pass.h"

#include <cmath>
#include <limits>
#include <vector>

namespace eeserve_stack {

// The confidence arithmetic of the kernel's measures, once (measures.confidence is Python's;
// tests/test_fused.py holds each against it). A row's shortlist confidence from its K logits:
// the softmax's top probability, or its margin over the second, in two passes over the row.
inline float shortlist_conf(const float* x, int64_t K, bool margin) {
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

// A row's classifier confidence: the sigmoid of its probe logit w . x + b.
inline float classifier_conf(const float* x, const float* w, float b, int64_t D) {
  float dot = b;
  for (int64_t d = 0; d < D; ++d) dot += x[d] * w[d];
  return 1.f / (1.f + std::exp(-dot));
}

// Task t (a row, or tiles of a projection) of a check's step. The check reads hout, the output
// of its layer, and leaves it as it is.
inline void check_task(const Pass& ps, const Phase& ph, int64_t t) {
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
  const float conf = ps.measure == Measure::Classifier
                         ? classifier_conf(x, c.probe, c.probe_bias, D)
                         : shortlist_conf(ps.ck_logits + t * c.rows.n, c.rows.n, ps.measure == Measure::ShortlistMargin);
  c.conf[t] = conf;
  if (conf >= c.threshold[t]) ps.stopped.store(ph.check, std::memory_order_relaxed);
}

// The checks of decode_stack_checked: CheckW::count tensors each in `w`, in stack_layout.h's order
// (a shortlist reads pre_*, norm, rows_*; a classifier probe_w [D], probe_b [1]), one eps each.
inline std::vector<Check> read_checks(at::IntArrayRef after, at::ArrayRef<double> eps,
                                      const c10::List<c10::optional<at::Tensor>>& w, Measure m, int64_t K,
                                      const at::Tensor& thresholds, at::Tensor& conf, int64_t L, int64_t D) {
  const int64_t C = static_cast<int64_t>(after.size()), n = CheckW::count;
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == C && static_cast<int64_t>(w.size()) == n * C,
              "decode_stack_checked: one eps and ", n, " tensors per check");
  TORCH_CHECK(thresholds.scalar_type() == at::kFloat && thresholds.is_contiguous() && thresholds.dim() == 2 &&
                  thresholds.size(0) == C && thresholds.size(1) == conf.size(1),
              "decode_stack_checked: thresholds [checks, R] float32");
  std::vector<Check> checks(C);
  for (int64_t c = 0; c < C; ++c) {
    auto arg = [&](int64_t j) { return c10::optional<at::Tensor>(w.get(n * c + j)); };
    TORCH_CHECK(after[c] >= 0 && after[c] < L && (c == 0 || after[c] > after[c - 1]),
                "decode_stack_checked: check layers increasing, within the call's layers");
    Check& k = checks[c];
    k.after = after[c], k.eps = static_cast<float>(eps[c]);
    k.threshold = thresholds.data_ptr<float>() + c * conf.size(1), k.conf = conf.data_ptr<float>() + c * conf.size(1);
    if (m == Measure::Classifier) {
      const auto pw = arg(CheckW::probe_w), pb = arg(CheckW::probe_b);
      TORCH_CHECK(pw.has_value() && pb.has_value() && pw->numel() == D && pb->numel() == 1 &&
                      pw->scalar_type() == at::kFloat && pw->is_contiguous() && pb->scalar_type() == at::kFloat,
                  "decode_stack_checked: a classifier's weight [D] and bias [1], float32");
      k.probe = pw->data_ptr<float>(), k.probe_bias = *pb->data_ptr<float>();  // no dispatch per step
      continue;
    }
    if (arg(CheckW::pre_w).has_value())
      k.pre = make_proj(arg(CheckW::pre_w), arg(CheckW::pre_s), arg(CheckW::pre_b), D, D);
    const auto nw = arg(CheckW::norm);
    TORCH_CHECK(nw.has_value() && nw->numel() == D && nw->scalar_type() == at::kFloat && nw->is_contiguous(),
                "decode_stack_checked: a norm weight [D] float32");
    k.norm = nw->data_ptr<float>();
    k.rows = make_proj(arg(CheckW::rows_w), arg(CheckW::rows_s), {}, K, D);
  }
  return checks;
}

}  // namespace eeserve_stack
