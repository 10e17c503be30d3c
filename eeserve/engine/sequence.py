"""Request/sequence state: the one mutable record the scheduler, cache manager and engine share.

Contract: pure Python, no tensors. A ``Sequence`` holds its tokens, its block table, how many of
its tokens already have K/V in the cache, and its early-exit record (exit layer and confidence per
generated token). The engine changes it from each step's ``SeqStep``; the runner's own record of
the request (``engine.request_state``: owed K/V and their hidden states, draft distributions) is
the runner's alone. Two facts of that record shape scheduling and so are reported here: the owed
positions (``owed``: a pass recomputes them, and no block holding one is cached) and how many
pending drafts end ``output_token_ids`` (``num_drafts``: speculative mode; everything that
outputs, stop-checks or hashes reads only the verified part, ``num_verified_output``).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import KW_ONLY, dataclass, field

from eeserve.engine.grammar import Grammar
from eeserve.engine.plan import ExitPlan
from eeserve.engine.speculative import SpecStats
from eeserve.exit_params import ExitMode
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
    _: KW_ONLY
    exit_plan: ExitPlan | None = None  # the request's ExitParams, resolved (None: full depth)
    grammar: Grammar | None = None  # its constraint, compiled (None: free text)
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
    forced: list[bool] = field(default_factory=list)  # per generated token: forced by the grammar
    # Positions whose deep-layer K/V is still owed, ascending (reported by the runner).
    owed: tuple[int, ...] = ()
    num_drafts: int = 0  # pending (unverified) drafts at the end of ``output_token_ids``
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    spec_stats: SpecStats | None = None  # speculative mode's telemetry

    def __post_init__(self) -> None:
        if self.speculative:
            self.spec_stats = SpecStats()

    @property
    def speculative(self) -> bool:
        return self.exit_plan is not None and self.exit_plan.mode == ExitMode.SPECULATIVE

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
    def num_verified_output(self) -> int:
        return len(self.output_token_ids) - self.num_drafts

    def preempted(self) -> None:
        """Back to the queue: recomputed at full depth from its verified tokens, so it owes
        nothing and its unverified drafts go."""
        self.owed = ()
        if self.num_drafts:
            del self.output_token_ids[-self.num_drafts :]
            self.num_drafts = 0

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
