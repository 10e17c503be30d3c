"""What ``generate`` returns, in vLLM's shape, plus the early-exit record of each completion."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExitStats:
    # Over the generated tokens that the model chose (forced tokens apart), 1-based (L = full
    # depth), and 1 - layers run / (tokens * L) over the same tokens.
    mean_exit_layer: float
    layers_saved_fraction: float
    num_layers: int
    num_forced: int = 0  # tokens the grammar forced (structured outputs): no layer chose them
    # ``speculative`` mode (None otherwise): accepted / drafted over verified drafts, drafts per
    # verification that checked any, and the mean exit layer drafts came from.
    acceptance_rate: float | None = None
    mean_draft_length: float | None = None
    mean_draft_layer: float | None = None
    num_drafted: int | None = None
    num_accepted: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    exit_layers: list[int] = field(default_factory=list)
    exit_confidences: list[float] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)  # per token: forced by the grammar
    exit_stats: ExitStats | None = None
    logprobs: list[dict[int, float]] | None = None
    # ``speculative`` mode, per token: the exit layer its draft came from (None: not drafted, a
    # full-depth token) and whether the draft was accepted (False: replaced by full depth's).
    draft_layers: list[int | None] | None = None
    draft_accepted: list[bool | None] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
