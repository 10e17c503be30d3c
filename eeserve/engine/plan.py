"""A request's exit rule, resolved: which exit layers, which measure, which thresholds.

Contract: ``ExitParams`` (``eeserve.exit_params``) is what a request asks for;
``resolve_exit_plan`` turns it, with the model's exit config (sidecar) as defaults, into an
``ExitPlan``: per exit layer a threshold, one measure, the mode. ``None`` means full depth.
``calibrated_threshold`` reads a Learn-then-Test calibration (docs/calibration.md) back.
"""

from __future__ import annotations

from dataclasses import dataclass

from eeserve.config import ExitPolicy
from eeserve.exit_params import (
    DEFAULT_NUM_DRAFT_TOKENS,
    SHORTLIST_MEASURES,
    DraftSource,
    ExitMode,
    ExitParams,
    Measure,
)
from eeserve.models.exit_config import ExitConfig


@dataclass(frozen=True, kw_only=True)
class ExitPlan:
    """A request's resolved exit rule: exit at layer l when confidence >= thresholds[l]."""

    measure: Measure
    thresholds: dict[int, float]  # 1-based exit layer -> threshold
    mode: ExitMode = ExitMode.EXIT  # speculative: an exit drafts, the layers above verify
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    # The row leaves at its own first confident exit whatever the ``auto`` policy would do: its
    # threshold was calibrated under ``per_sequence``, whose guarantee holds for such a row.
    eager: bool = False

    @property
    def layers(self) -> list[int]:
        return sorted(self.thresholds)


def resolve_exit_plan(
    params: ExitParams | None,
    cfg: ExitConfig,
    policy: ExitPolicy | None = None,
    speculative_draft: DraftSource = DraftSource.EXITS,
    constrained: bool = False,
) -> ExitPlan | None:
    """``speculative_draft`` int8: a speculative request's drafts come from the int8 copy at
    full depth, so its plan has no exit layers (exit layers, threshold and measure go unused).
    ``constrained`` (structured outputs): without a stated threshold or tolerance, the
    measure's constrained threshold where the config has one."""
    if params is None:
        if not cfg.enabled_by_default:
            return None
        params = ExitParams()
    if not params.enabled:
        return None
    # A request that states an exit rule but no mode asks for exits, whatever the default mode.
    rule = (params.threshold, params.tolerance, params.measure, params.exit_layers)
    stated = any(x is not None for x in rule)
    mode = ExitMode(params.mode or (ExitMode.EXIT if stated else cfg.default_mode))
    num_drafts = params.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS
    if mode is ExitMode.SPECULATIVE and speculative_draft is DraftSource.INT8:
        return ExitPlan(
            measure=Measure.MAX_PROB, thresholds={}, mode=mode, num_draft_tokens=num_drafts
        )
    measure = Measure(params.measure or cfg.default_measure)
    layers = _exit_layers(params, cfg, measure)
    threshold = params.threshold
    eager = False
    if params.tolerance is not None:
        # ``auto`` has no calibration of its own (its decisions follow the machine's layer
        # cost): its rows use ``per_sequence``'s and leave as they would there.
        eager = policy == ExitPolicy.AUTO
        threshold = calibrated_threshold(
            cfg, params.tolerance, measure, ExitPolicy.PER_SEQUENCE if eager else policy
        )
    if threshold is None:
        stored = cfg.constrained_thresholds if constrained else {}
        threshold = stored.get(measure, cfg.thresholds.get(measure))
    if threshold is None:
        raise ValueError(
            "no exit threshold given and the model's exit config has no default for "
            f"{str(measure)!r}"
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
        measure=measure,
        thresholds={lay: t for lay, t in per_layer.items() if lay >= params.min_layer},
        mode=mode,
        num_draft_tokens=num_drafts,
        eager=eager,
    )


def _exit_layers(params: ExitParams, cfg: ExitConfig, measure: str) -> list[int]:
    """The request's exit layers, once its measure and layers are known to be usable."""
    if measure == Measure.CLASSIFIER and not cfg.classifier:
        raise ValueError("measure 'classifier' needs trained classifier probes in the exit sidecar")
    if measure in SHORTLIST_MEASURES and not cfg.shortlist:
        raise ValueError(
            f"measure {str(measure)!r} needs a vocabulary shortlist in the exit sidecar "
            "(eeserve shortlist MODEL --out DIR)"
        )
    layers = sorted(set(params.exit_layers or cfg.exit_layers))
    bad = [x for x in layers if x >= cfg.num_layers]
    if bad:
        raise ValueError(f"exit layers must be below the model's {cfg.num_layers} layers: {bad}")
    if cfg.head == "tuned" and params.exit_layers:
        missing = sorted(set(layers) - set(cfg.exit_layers))
        if missing:
            raise ValueError(f"no tuned exit head at layers {missing}; available {cfg.exit_layers}")
    return layers


def calibrated_threshold(
    cfg: ExitConfig, tolerance: float, measure: str, policy: str | None = None
) -> float:
    """Threshold calibrated for quality loss <= ``tolerance`` (the loosest that still covers it),
    on free text (a constrained workload's calibration is the constrained threshold's)."""
    fits = [
        c
        for c in cfg.calibration
        if c.get("measure") == measure
        and not c.get("structured")
        and float(c["delta"]) <= tolerance  # type: ignore[arg-type]
        # A threshold calibrated under one batch policy says nothing about another.
        and (policy is None or c.get("policy") in (None, policy))
    ]
    if not fits:
        known = sorted({(c.get("measure"), c.get("delta")) for c in cfg.calibration}, key=str)
        raise ValueError(
            f"no calibration for tolerance {tolerance} with measure {str(measure)!r}"
            f"{f' under policy {str(policy)!r}' if policy else ''}; "
            f"calibrated (measure, delta): {known or 'none'} (run `eeserve calibrate`)"
        )
    best = max(fits, key=lambda c: float(c["delta"]))  # type: ignore[arg-type]
    return float(best["threshold"])  # type: ignore[arg-type]
