"""Early-exit logic: the resolved plan, confidence measures, batch policies.

Contract:
- ``ExitParams`` (``eeserve.exit_params``) is what a request asks for; ``resolve_exit_plan``
  turns it, with the model's exit config (sidecar) as defaults, into an ``ExitPlan``: per exit
  layer a threshold, one measure. ``None`` means full depth.
- ``confidence`` computes a measure for some rows at one exit layer (DESIGN.md: softmax margin,
  max prob, hidden-state cosine, classifier probe). Only the softmax measures need the exit
  logits; the runner computes those only where a measure or an exiting row needs them.
- ``decide`` applies the batch policy: ``per_sequence`` lets confident rows leave on their own;
  ``batch_all`` (the seed paper) marks confident rows and stops every row at the first exit layer
  where all are marked.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eeserve.exit_params import DEFAULT_NUM_DRAFT_TOKENS, LOGIT_MEASURES, ExitParams
from eeserve.models.exit_config import ExitConfig


@dataclass(frozen=True)
class ExitPlan:
    """A request's resolved exit rule: exit at layer l when confidence >= thresholds[l]."""

    measure: str
    thresholds: dict[int, float]  # 1-based exit layer -> threshold
    mode: str = "exit"  # "speculative": an exit drafts, the layers above verify
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS

    @property
    def layers(self) -> list[int]:
        return sorted(self.thresholds)


def resolve_exit_plan(
    params: ExitParams | None,
    cfg: ExitConfig,
    policy: str | None = None,
    speculative_draft: str = "exits",
) -> ExitPlan | None:
    """``speculative_draft="int8"``: a speculative request's drafts come from the int8 copy at
    full depth, so its plan has no exit layers (exit layers, threshold and measure go unused)."""
    if params is None:
        if not cfg.enabled_by_default:
            return None
        params = ExitParams()
    if not params.enabled:
        return None
    # A request that states an exit rule but no mode asks for exits, whatever the default mode.
    rule = (params.threshold, params.tolerance, params.measure, params.exit_layers)
    mode = params.mode or ("exit" if any(x is not None for x in rule) else cfg.default_mode)
    num_drafts = params.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
    if mode == "speculative" and speculative_draft == "int8":
        return ExitPlan("max_prob", {}, mode, num_drafts)
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
    return ExitPlan(
        measure,
        {lay: t for lay, t in per_layer.items() if lay >= params.min_layer},
        mode,
        num_drafts,
    )


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
