"""Per-request early-exit parameters (public API), with the measure names they may name.

Contract: ``ExitParams`` validates on construction and raises ``ValueError`` naming the field;
the engine resolves it against the model's exit config (``engine.plan.resolve_exit_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Measure(StrEnum):
    """How sure an exit is of its token (docs/design.md, "Vocabulary")."""

    SOFTMAX_MARGIN = "softmax_margin"  # top-1 minus top-2 probability over the vocabulary
    MAX_PROB = "max_prob"  # top-1 probability over the vocabulary
    HIDDEN_COSINE = "hidden_cosine"  # cosine of the exit layer's input and output
    CLASSIFIER = "classifier"  # a trained probe's sigmoid (needs the sidecar's probes)
    SHORTLIST_MARGIN = "shortlist_margin"  # softmax_margin over the sidecar's shortlist
    SHORTLIST_MAX_PROB = "shortlist_max_prob"  # max_prob over the sidecar's shortlist


# Measures every exit sidecar supports (``classifier`` needs its probes).
BASE_MEASURES = ("softmax_margin", "max_prob", "hidden_cosine", "classifier")
# The two softmax measures over the whole vocabulary (2·V·D per check)...
LOGIT_MEASURES = ("softmax_margin", "max_prob")
# ...and over the sidecar's frequency-ranked vocabulary shortlist (2·K·D, K << V): cheap, but the
# softmax over K rows overstates a token's probability, so their thresholds are their own.
SHORTLIST_MEASURES = ("shortlist_margin", "shortlist_max_prob")
MEASURES = tuple(m.value for m in Measure)


class ExitMode(StrEnum):
    """``exit``: a confident token is final. ``speculative``: it is a draft that the layers
    above verify, so the output equals full depth's."""

    EXIT = "exit"
    SPECULATIVE = "speculative"


class DraftSource(StrEnum):
    """What drafts in ``speculative`` mode (``EngineConfig.speculative_draft``, which also takes
    "auto"; ``ExitConfig.default_draft``): the exit heads, or an int8 copy of the model's own
    weights at full depth."""

    EXITS = "exits"
    INT8 = "int8"


# Their values, as command-line choices and in error messages.
MODES = tuple(m.value for m in ExitMode)
DRAFT_SOURCES = tuple(d.value for d in DraftSource)
# Most drafts before a verification in ``speculative`` mode when a request does not say.
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass
class ExitParams:
    """Per-request early-exit control. ``threshold``/``measure`` default to the model's config."""

    enabled: bool = True
    threshold: float | list[float] | None = None  # one value, or one per exit layer
    measure: str | None = None
    min_layer: int = 1
    exit_layers: list[int] | None = None
    tolerance: float | None = None  # a calibrated quality target instead of a raw threshold
    # "exit": a confident token is final. "speculative": it is a draft that the layers above
    # verify, so the output equals full depth's (None: the model's default mode).
    mode: str | None = None
    num_draft_tokens: int | None = None  # speculative: most drafts before a verification

    def __post_init__(self) -> None:
        if self.mode is not None:
            if self.mode not in MODES:
                raise ValueError(f"ExitParams.mode must be one of {MODES}, got {self.mode!r}")
            self.mode = ExitMode(self.mode)
        n = self.num_draft_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64):
            raise ValueError(
                f"ExitParams.num_draft_tokens must be an integer in [1, 64], got {n!r}"
            )
        if self.measure is not None:
            if self.measure not in MEASURES:
                raise ValueError(
                    f"ExitParams.measure must be one of {MEASURES}, got {self.measure!r}"
                )
            self.measure = Measure(self.measure)
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
