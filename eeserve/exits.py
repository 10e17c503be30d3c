"""Early-exit logic: per-request parameters, the resolved plan, confidence measures, policies.

Contract:
- ``ExitParams`` is what a request asks for; ``resolve_exit_plan`` turns it, with the model's exit
  config (sidecar) as defaults, into an ``ExitPlan``: per exit layer a threshold, one measure.
  ``None`` means full depth.
- ``confidence`` computes a measure for some rows at one exit layer (DESIGN.md: softmax margin,
  max prob, hidden-state cosine, classifier probe). Only the softmax measures need the exit
  logits; the runner computes those only where a measure or an exiting row needs them.
- ``decide`` applies the batch policy: ``per_sequence`` lets confident rows leave on their own;
  ``batch_all`` (the seed paper) marks confident rows and stops every row at the first exit layer
  where all are marked.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MEASURES = ("softmax_margin", "max_prob", "hidden_cosine", "classifier")
LOGIT_MEASURES = ("softmax_margin", "max_prob")


@dataclass
class ExitParams:
    """Per-request early-exit control. ``threshold``/``measure`` default to the model's config."""

    enabled: bool = True
    threshold: float | list[float] | None = None  # one value, or one per exit layer
    measure: str | None = None
    min_layer: int = 1
    exit_layers: list[int] | None = None
    tolerance: float | None = None  # a calibrated quality target instead of a raw threshold

    def __post_init__(self) -> None:
        if self.measure is not None and self.measure not in MEASURES:
            raise ValueError(f"ExitParams.measure must be one of {MEASURES}, got {self.measure!r}")
        ths = self.threshold if isinstance(self.threshold, list) else [self.threshold]
        for t in ths:
            if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t != t):
                raise ValueError(
                    f"ExitParams.threshold must be a number or a list of numbers, got {t!r}"
                )
        if (
            isinstance(self.min_layer, bool)
            or not isinstance(self.min_layer, int)
            or self.min_layer < 1
        ):
            raise ValueError(
                f"ExitParams.min_layer must be an integer >= 1, got {self.min_layer!r}"
            )
        if self.exit_layers is not None and (
            not self.exit_layers or not all(isinstance(x, int) and x >= 1 for x in self.exit_layers)
        ):
            raise ValueError(
                f"ExitParams.exit_layers must be layer numbers >= 1, got {self.exit_layers!r}"
            )
        if self.tolerance is not None and not (0 < self.tolerance < 1):
            raise ValueError(f"ExitParams.tolerance must be in (0, 1), got {self.tolerance!r}")
        if self.threshold is not None and self.tolerance is not None:
            raise ValueError("ExitParams: give threshold or tolerance, not both")


@dataclass(frozen=True)
class ExitPlan:
    """A request's resolved exit rule: exit at layer l when confidence >= thresholds[l]."""

    measure: str
    thresholds: dict[int, float]  # 1-based exit layer -> threshold

    @property
    def layers(self) -> list[int]:
        return sorted(self.thresholds)


@dataclass
class ExitConfig:
    """The model's exit-head description (the JSON half of the sidecar; see README)."""

    num_layers: int
    exit_layers: list[int]
    head: str = "shared"  # "shared" (final norm + LM head) or "tuned" (own norm + adapter)
    adapter: str = "none"  # none|linear|lowrank|mlp, or "layer" (see models.exit_heads)
    adapter_rank: int = 0  # lowrank/mlp width; "layer": the model's MLP width
    classifier: bool = False
    default_measure: str = "softmax_margin"
    thresholds: dict[str, float | list[float]] = field(default_factory=dict)
    calibration: list[dict[str, object]] = field(default_factory=list)
    enabled_by_default: bool = False


def default_shared_exit_layers(num_layers: int) -> list[int]:
    """Sparse exits for the shared head: every check costs a vocabulary projection (2·V·D)."""
    step = max(1, num_layers // 5)
    return list(range(step, num_layers, step))


def resolve_exit_plan(
    params: ExitParams | None, cfg: ExitConfig, policy: str | None = None
) -> ExitPlan | None:
    if params is None:
        if not cfg.enabled_by_default:
            return None
        params = ExitParams()
    if not params.enabled:
        return None
    measure = params.measure or cfg.default_measure
    if measure == "classifier" and not cfg.classifier:
        raise ValueError("measure 'classifier' needs trained classifier probes in the exit sidecar")
    layers = sorted(set(params.exit_layers or cfg.exit_layers))
    bad = [x for x in layers if x >= cfg.num_layers]
    if bad:
        raise ValueError(f"exit layers must be below the model's {cfg.num_layers} layers: {bad}")
    if cfg.head == "tuned" and params.exit_layers:
        missing = sorted(set(layers) - set(cfg.exit_layers))
        if missing:
            raise ValueError(f"no tuned exit head at layers {missing}; available {cfg.exit_layers}")
    threshold = params.threshold
    if params.tolerance is not None:
        threshold = calibrated_threshold(cfg, params.tolerance, measure, policy)
    if threshold is None:
        threshold = cfg.thresholds.get(measure)
    if threshold is None:
        raise ValueError(
            f"no exit threshold given and the model's exit config has no default for {measure!r}"
        )
    if isinstance(threshold, list):
        if len(threshold) != len(layers):
            raise ValueError(
                f"got {len(threshold)} thresholds for {len(layers)} exit layers {layers}"
            )
        per_layer = dict(zip(layers, threshold))
    else:
        per_layer = dict.fromkeys(layers, float(threshold))
    return ExitPlan(measure, {lay: t for lay, t in per_layer.items() if lay >= params.min_layer})


def calibrated_threshold(
    cfg: ExitConfig, tolerance: float, measure: str, policy: str | None = None
) -> float:
    """Threshold calibrated for quality loss <= ``tolerance`` (the loosest that still covers it)."""
    fits = [
        c
        for c in cfg.calibration
        if c.get("measure") == measure
        and float(c["delta"]) <= tolerance  # type: ignore[arg-type]
        # A threshold calibrated under one batch policy says nothing about another.
        and (policy is None or c.get("policy") in (None, policy))
    ]
    if not fits:
        known = sorted({(c.get("measure"), c.get("delta")) for c in cfg.calibration}, key=str)
        raise ValueError(
            f"no calibration for tolerance {tolerance} with measure {measure!r}"
            f"{f' under policy {policy!r}' if policy else ''}; "
            f"calibrated (measure, delta): {known or 'none'} (run `eeserve calibrate`)"
        )
    best = max(fits, key=lambda c: float(c["delta"]))  # type: ignore[arg-type]
    return float(best["threshold"])  # type: ignore[arg-type]


# -- measures (tensor functions on the rows being checked) -------------------------------------


def confidence(
    measure: str,
    logits: torch.Tensor | None,
    h: torch.Tensor,
    h_prev: torch.Tensor,
    probe: torch.Tensor | None,
) -> torch.Tensor:
    """Confidence [n] of rows at one exit.

    logits: [n, V] exit-head logits (softmax measures); h: [n, D] hidden after the exit layer
    (``layer`` heads: h_mid of the layer above); h_prev: [n, D] hidden before it (``layer`` heads:
    h_l), for ``hidden_cosine``; probe: [n] classifier logit.
    """
    if measure in LOGIT_MEASURES:
        assert logits is not None
        probs = logits.float().softmax(dim=-1)
        top = probs.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1] if measure == "softmax_margin" else top[:, 0]
    if measure == "hidden_cosine":
        return F.cosine_similarity(h.float(), h_prev.float(), dim=-1)
    if measure == "classifier":
        assert probe is not None
        return torch.sigmoid(probe.float())
    raise ValueError(f"unknown measure {measure!r}")


def decide(policy: str, confident: Seq[bool], marked: list[bool], all_checked: bool) -> list[bool]:
    """Which of the checked rows leave now.

    ``marked`` is the sticky ``batch_all`` state of the checked rows (updated in place);
    ``all_checked``: every running row was checked here (else ``batch_all`` cannot stop).
    """
    if policy == "per_sequence":
        return list(confident)
    for i, c in enumerate(confident):
        marked[i] = marked[i] or c
    leave = all_checked and all(marked)
    return [leave] * len(marked)
