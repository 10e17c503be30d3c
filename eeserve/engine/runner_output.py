"""What one forward pass gives the engine: one typed record per scheduled sequence.

Contract: ``ModelRunner.execute`` returns a ``RunnerOutput`` whose ``seqs[i]`` belongs to the
i-th scheduled sequence. A ``SeqStep`` says everything the engine applies to that sequence's
state (token, exit layer, confidence, logprobs, the positions still owed, speculation); it never
refers back to other rows by index. Plain data: no tensors cross from the runner to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eeserve.engine.speculative import SpecOutput


@dataclass(kw_only=True)
class SeqStep:
    """One sequence's result of one forward pass."""

    # The sampled token; None for a prompt chunk short of its last token (K/V only).
    token_id: int | None = None
    exit_layer: int  # 1-based layer the token came from (L = full depth)
    confidence: float = 1.0
    logprobs: dict[int, float] | None = None  # top-n and the sampled token, when asked for
    # The positions still owed after this step, ascending (``recompute`` and speculative
    # sequences; the runner's ``RequestState.owed`` holds their depths and hidden states).
    owed: tuple[int, ...] = ()
    # Speculative sequences: a new draft or a verification's kept tokens (None: other modes).
    spec: SpecOutput | None = None
    # Constrained sequences: the tokens the grammar forces after this step's verified tokens
    # (already accepted by its matcher); the engine appends them, and the next pass computes
    # their positions as one chunk (jump-forward).
    forced: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class RunnerOutput:
    seqs: list[SeqStep]
    layers_run: int = 0  # decoder layers computed, summed over rows (telemetry, tests)
    layer_passes: int = 0  # decoder layers the pass ran with any row: what the hardware paid
