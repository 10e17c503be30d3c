"""Self-speculative decoding, the per-sequence half: draft bookkeeping and acceptance.

Contract:
- ``SpecState`` (pure Python, on the ``Sequence``) holds a speculative request's pending drafts
  (their exit layers), its adaptive draft limit and its telemetry. ``can_draft`` says whether the
  next step may draft; ``record`` updates the limit after a verification.
- ``accept_greedy`` / ``accept_sampled`` turn a verification's full-depth logits into the tokens
  that are kept: the accepted prefix of the drafts plus one token from full depth (the
  replacement of the first rejected draft, or the bonus token when every draft was accepted).
  ``accept_sampled`` is speculative sampling (accept with min(1, p/q), resample from the
  normalised max(0, p - q)), so the output distribution is exactly full depth's.
- ``SpecOutput`` is what the model runner reports per speculative sequence and step.
The runner-side component that decides what drafts and what is kept is ``engine.speculator``;
how a step drafts and verifies is in docs/design.md ("Speculative mode").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eeserve.engine.sampler import race

# Two verifications in a row that accept nothing pause drafting for this many verified tokens.
PAUSE_AFTER_REJECTIONS = 2
PAUSE_TOKENS = 8


@dataclass
class SpecState:
    max_drafts: int  # ExitParams.num_draft_tokens
    limit: int = 0  # current adaptive limit (<= max_drafts); set from max_drafts
    pending_layers: list[int] = field(default_factory=list)  # exit layer of each pending draft
    rejection_streak: int = 0
    pause: int = 0  # verified tokens left before drafting resumes
    # Telemetry per verified output token: the draft's exit layer (None: not drafted) and
    # whether the draft was accepted (None: not drafted).
    draft_layers: list[int | None] = field(default_factory=list)
    accepted: list[bool | None] = field(default_factory=list)
    num_drafted: int = 0  # drafts that were verified (dropped ones are not counted)
    num_accepted: int = 0
    num_verifications: int = 0  # verifications that checked at least one draft

    def __post_init__(self) -> None:
        self.limit = self.limit or self.max_drafts

    @property
    def num_pending(self) -> int:
        return len(self.pending_layers)

    def can_draft(self, num_verified_out: int, max_tokens: int) -> bool:
        """May the next step draft? Never past what ``max_tokens`` could still use."""
        room = num_verified_out + self.num_pending + 1 < max_tokens
        return self.pause == 0 and self.num_pending < self.limit and room

    def record(self, layers: list[int], num_accepted: int, num_tokens: int) -> None:
        """A verification of drafts from ``layers`` kept ``num_accepted`` and produced
        ``num_tokens`` verified tokens in all."""
        k = len(layers)
        self.draft_layers += [*layers[: num_accepted + 1], None][:num_tokens]
        self.accepted += [*([True] * num_accepted), *([False] if num_accepted < k else [None])][
            :num_tokens
        ]
        self.pending_layers = []
        if k == 0:
            self.pause = max(0, self.pause - num_tokens)
            return
        self.num_drafted += k
        self.num_accepted += num_accepted
        self.num_verifications += 1
        if num_accepted == k:
            self.limit = min(self.max_drafts, self.limit + 1)
            self.rejection_streak = 0
            return
        # The draft after the accepted ones was wrong: drafting further out is likely wasted.
        self.limit = max(1, num_accepted + 1)
        self.rejection_streak = self.rejection_streak + 1 if num_accepted == 0 else 0
        if self.rejection_streak >= PAUSE_AFTER_REJECTIONS:
            self.pause, self.rejection_streak = PAUSE_TOKENS, 0

    def discard_pending(self) -> int:
        """Drop the unverified drafts (preemption); returns how many there were."""
        k = self.num_pending
        self.pending_layers = []
        return k


@dataclass
class SpecOutput:
    """One speculative sequence's result of a step."""

    drafted: bool  # True: ``token_ids`` is one new draft; False: a verification
    token_ids: list[int]  # the draft, or the verified tokens (accepted drafts + one)
    num_accepted: int = 0
    draft_layer: int = 0  # exit layer of the new draft
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # per verified token


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [k+1, V]: full depth at the drafted positions and the next one. Returns the kept
    tokens and how many drafts were accepted."""
    full = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(drafts) and full[a] == drafts[a]:
        a += 1
    return [*drafts[:a], full[a]], a


def accept_sampled(
    drafts: list[int],
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling. q [k, V]: the distributions the drafts were drawn from; p [k+1, V]:
    full depth's sampling distributions (after temperature, top-k, top-p) at the same positions
    and the next. Returns the kept tokens and how many drafts were accepted."""
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[i, d]) < float(p[i, d]):  # accept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        return [*drafts[:i], race(residual, generator)], i
    return [*drafts, race(p[len(drafts)], generator)], len(drafts)
