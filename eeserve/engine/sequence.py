"""Request/sequence state: the one mutable record the scheduler, cache manager and engine share.

Contract: pure Python, no tensors. A ``Sequence`` holds its tokens, its block table, how many of
its tokens already have K/V in the cache, and its early-exit record (exit layer and confidence per
generated token, and the positions whose deep-layer K/V is still owed under ``recompute``).
In ``speculative`` mode ``output_token_ids`` ends with the pending (unverified) drafts; everything
that outputs, stop-checks or hashes reads only the verified part (``num_verified_output``).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from eeserve.engine.plan import ExitPlan
from eeserve.engine.speculative import SpecState
from eeserve.exit_params import ExitParams
from eeserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    exit_params: ExitParams | None = None
    exit_plan: ExitPlan | None = None  # resolved from exit_params and the model's exit config
    seq_id: int = field(default_factory=lambda: next(_ids))
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    finish_reason: str | None = None
    # Early-exit record: one entry per generated token (layer is 1-based, L = full depth).
    exit_layers: list[int] = field(default_factory=list)
    exit_confidences: list[float] = field(default_factory=list)
    # ``recompute`` KV debt: position -> layer up to which its K/V exists (only positions < L).
    kv_debt: dict[int, int] = field(default_factory=dict)
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    spec: SpecState | None = None  # speculative mode: drafts, adaptive limit, telemetry

    def __post_init__(self) -> None:
        plan = self.exit_plan
        if self.spec is None and plan is not None and plan.mode == "speculative":
            self.spec = SpecState(plan.num_draft_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_draft_tokens(self) -> int:
        """Unverified drafts at the end of ``output_token_ids``."""
        return self.spec.num_pending if self.spec is not None else 0

    @property
    def num_verified_output(self) -> int:
        return len(self.output_token_ids) - self.num_draft_tokens

    def step_plan(self) -> ExitPlan | None:
        """The exit plan of the next forward pass: none for the prefill's first token, and none
        for a speculative sequence that may not draft now (that pass verifies)."""
        if not self.output_token_ids or self.exit_plan is None:
            return None
        spec = self.spec
        if spec is not None and not spec.can_draft(
            self.num_verified_output, self.sampling_params.max_tokens
        ):
            return None
        return self.exit_plan

    def discard_drafts(self) -> None:
        """Drop unverified drafts (preemption: only verified tokens are recomputed)."""
        if self.spec is not None and (k := self.spec.discard_pending()):
            del self.output_token_ids[-k:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next forward pass must compute (the whole uncached prompt, or one)."""
        return self.num_tokens - self.num_computed_tokens

    def kv_exit_layer(self, pos: int, num_layers: int) -> int:
        """Deepest layer that computed the token at ``pos`` as an input (the rest was filled).

        The forward pass of position ``pos`` produced the token at ``pos + 1``, so its depth is
        that token's exit layer; prompt positions and positions not yet run count as full depth.
        """
        i = pos - self.num_prompt_tokens + 1
        return self.exit_layers[i] if 0 <= i < len(self.exit_layers) else num_layers

    def kv_depth_key(self, start: int, end: int) -> tuple[int, ...]:
        """Depths of the generated positions in [start, end): part of a block's cache key."""
        first = max(start, self.num_prompt_tokens)
        return tuple(
            self.exit_layers[p - self.num_prompt_tokens + 1]
            for p in range(first, end)
            if p - self.num_prompt_tokens + 1 < len(self.exit_layers)
        )
