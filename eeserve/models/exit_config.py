"""The model's exit-head description: the JSON half of the exit sidecar (``exit_config.json``).

Contract: ``ExitConfig`` is plain data (exit layers, head kind, adapter, probes, thresholds per
measure for free text and for constrained requests, calibration records, whether exits are on
by default, for a model trained to exit its base delta, and the vocabulary shortlist of the
cheap checks); ``default_shared_exit_layers`` gives the exit layers used when a model has no
sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eeserve.exit_params import DRAFT_SOURCES, MODES, DraftSource


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
    # Per measure, the threshold of constrained requests (structured outputs), calibrated on a
    # constrained workload (``eeserve calibrate --structured``); a measure missing here uses
    # ``thresholds``.
    constrained_thresholds: dict[str, float | list[float]] = field(default_factory=dict)
    calibration: list[dict[str, object]] = field(default_factory=list)
    enabled_by_default: bool = False
    # Sidecar v2, a model trained to exit (``models.base_delta``): {"rank", "scale", "file",
    # "base_model_hash"}; None: the base weights are used as they are.
    base_delta: dict[str, str | int | float] | None = None
    default_mode: str = "exit"  # "exit" or "speculative" (when a request names no mode)
    # What drafts in speculative mode when the engine's ``speculative_draft`` is "auto": "exits"
    # (the exit heads) or "int8" (an int8 copy of the model's own weights, at full depth).
    default_draft: str = "exits"
    # Exit-head drafts are projected onto the first ``draft_vocab`` token ids only (a BPE
    # vocabulary is roughly frequency-ordered), int8-copy drafts onto the first
    # ``int8_draft_vocab`` ids of ``shortlist``; 0: the whole vocabulary (``draft_ids``).
    # Verification keeps the output exact whatever the draft head is; a smaller one makes
    # drafting cheaper and drafts a token outside it never.
    draft_vocab: int = 0
    int8_draft_vocab: int = 0
    # Token ids ranked by how often the model produces them (counted from its own text):
    # ``shortlist_*`` measures check the first ``shortlist_size`` of them (0: as many as fit in
    # the engine's check budget, ``CostModel.shortlist_rows``).
    shortlist: list[int] = field(default_factory=list)
    shortlist_size: int = 0

    def __post_init__(self) -> None:
        if self.default_mode not in MODES:
            raise ValueError(f"default_mode must be one of {MODES}, got {self.default_mode!r}")
        if self.default_draft not in DRAFT_SOURCES:
            raise ValueError(
                f"default_draft must be one of {DRAFT_SOURCES}, got {self.default_draft!r}"
            )
        if self.int8_draft_vocab > len(self.shortlist):
            raise ValueError(
                f"int8_draft_vocab {self.int8_draft_vocab} needs a shortlist of as many ids, "
                f"not {len(self.shortlist)} (eeserve shortlist --size)"
            )

    def draft_ids(self, vocab_size: int, source: DraftSource) -> list[int] | None:
        """The token ids that ``source``'s drafts are projected onto; None: every id."""
        int8 = source is DraftSource.INT8
        n = self.int8_draft_vocab if int8 else self.draft_vocab
        if not 0 < n < vocab_size:
            return None
        return self.shortlist[:n] if int8 else list(range(n))


def default_shared_exit_layers(num_layers: int) -> list[int]:
    """Sparse exits for the shared head: every check costs a vocabulary projection (2·V·D)."""
    step = max(1, num_layers // 5)
    return list(range(step, num_layers, step))
