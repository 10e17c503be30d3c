"""Threshold calibration with a stated quality guarantee: Learn-then-Test (CALM, Bates et al.).

Contract (pure functions, no torch):
- A *loss* is one number in [0, 1] per calibration prompt (e.g. 1 - ROUGE-L of the early-exit
  text against the full-depth text). Losses of one candidate threshold are assumed i.i.d. draws
  from the traffic the threshold will serve; nothing else is assumed (no monotonicity in the
  threshold is needed for validity).
- ``hoeffding_pvalue``, ``bentkus_pvalue`` and ``hoeffding_bentkus_pvalue`` are valid p-values
  for the null hypothesis "the true mean loss exceeds ``delta``": under the null,
  P(p <= u) <= u for every u in [0, 1].
- ``learn_then_test`` orders the candidates from the most conservative (highest threshold: a row
  exits only when its confidence >= threshold) to the most aggressive, tests them in that fixed
  sequence at level ``epsilon`` each and stops at the first non-rejection. Fixed-sequence testing
  controls the family-wise error rate at ``epsilon``, so with probability >= 1 - epsilon *every*
  rejected candidate, in particular the returned (most aggressive rejected) one, has true mean
  loss <= delta. ``threshold`` is None when even the most conservative candidate is not rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PValueFn = Callable[[float, int, float], float]


def _check(mean_loss: float, n: int, delta: float) -> None:
    if n < 1:
        raise ValueError(f"need at least one calibration loss, got n={n}")
    if not 0.0 <= mean_loss <= 1.0:
        raise ValueError(f"mean loss must be in [0, 1], got {mean_loss}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def hoeffding_pvalue(mean_loss: float, n: int, delta: float) -> float:
    """Additive Hoeffding: P(mean of n losses in [0,1] <= r | true mean >= delta) <=
    exp(-2 n (delta - r)^2)."""
    _check(mean_loss, n, delta)
    if mean_loss >= delta:
        return 1.0
    return math.exp(-2.0 * n * (delta - mean_loss) ** 2)


def _kl_bernoulli(a: float, b: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(b)), with 0 log 0 = 0; b in (0, 1)."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def hoeffding_kl_pvalue(mean_loss: float, n: int, delta: float) -> float:
    """Hoeffding's relative-entropy form: exp(-n KL(min(r, delta) || delta)); tighter than the
    additive form, the same assumptions."""
    _check(mean_loss, n, delta)
    return math.exp(-n * _kl_bernoulli(min(mean_loss, delta), delta))


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space (safe for large n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    logs = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(p)
        + (n - i) * math.log1p(-p)
        for i in range(k + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def bentkus_pvalue(mean_loss: float, n: int, delta: float) -> float:
    """Bentkus (2004): e * P(Binomial(n, delta) <= ceil(n r)), for losses in [0, 1]."""
    _check(mean_loss, n, delta)
    k = math.ceil(n * mean_loss - 1e-12 * n)  # guard float noise in an integral sum
    return min(1.0, math.e * binom_cdf(k, n, delta))


def hoeffding_bentkus_pvalue(mean_loss: float, n: int, delta: float) -> float:
    """The Hoeffding–Bentkus p-value of RCPS/LTT: the smaller of the two valid bounds."""
    return min(hoeffding_kl_pvalue(mean_loss, n, delta), bentkus_pvalue(mean_loss, n, delta))


PVALUES: dict[str, PValueFn] = {
    "hb": hoeffding_bentkus_pvalue,
    "hoeffding": hoeffding_pvalue,
}


@dataclass(frozen=True)
class CandidateRow:
    """One candidate's test: ``tested`` is False after the sequence has stopped."""

    candidate: float
    mean_loss: float
    n: int
    p_value: float
    rejected: bool
    tested: bool = True


@dataclass(frozen=True)
class LTTResult:
    rows: list[CandidateRow]  # most conservative first
    threshold: float | None  # the most aggressive rejected candidate
    delta: float
    epsilon: float


def order_candidates(candidates: Sequence[float]) -> list[float]:
    """Most conservative first: a higher threshold lets fewer tokens exit."""
    if not candidates:
        raise ValueError("no candidate thresholds")
    return sorted({float(c) for c in candidates}, reverse=True)


def check_candidate(
    candidate: float,
    losses: Sequence[float],
    delta: float,
    epsilon: float,
    pvalue: str | PValueFn = "hb",
) -> CandidateRow:
    """Test "mean loss of ``candidate`` > delta" at level ``epsilon`` on its losses."""
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
    bad = [x for x in losses if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"losses must lie in [0, 1]; got {bad[:3]}")
    fn = PVALUES[pvalue] if isinstance(pvalue, str) else pvalue
    mean = math.fsum(losses) / len(losses) if losses else 0.0
    p = fn(min(1.0, max(0.0, mean)), len(losses), delta)
    return CandidateRow(candidate, mean, len(losses), p, p <= epsilon)


def learn_then_test(
    losses: Mapping[float, Sequence[float]],
    delta: float,
    epsilon: float,
    pvalue: str | PValueFn = "hb",
) -> LTTResult:
    """Fixed-sequence LTT over every candidate's losses (see the module docstring)."""
    rows: list[CandidateRow] = []
    stopped = False
    for cand in order_candidates(list(losses)):
        row = check_candidate(cand, losses[cand], delta, epsilon, pvalue)
        if stopped:
            row = CandidateRow(
                row.candidate, row.mean_loss, row.n, row.p_value, False, tested=False
            )
        stopped = stopped or not row.rejected
        rows.append(row)
    return LTTResult(rows, chosen_threshold(rows), delta, epsilon)


def chosen_threshold(rows: Sequence[CandidateRow]) -> float | None:
    """The last candidate of the leading run of rejections (rows most conservative first)."""
    chosen: float | None = None
    for row in rows:
        if not (row.tested and row.rejected):
            break
        chosen = row.candidate
    return chosen
