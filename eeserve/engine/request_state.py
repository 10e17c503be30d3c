"""What the model runner keeps between steps for one request: its one record per request.

Contract: ``RequestState`` is the runner's record of a request (``ModelRunner.requests``, keyed
by ``Sequence.seq_id``), created the first time the request is scheduled and dropped when the
scheduler reports it finished (``SchedulerOutput.finished_ids``). It owns everything tensor-side
the runner carries from one step to the next:
- ``owed``: the request's KV debt. Each owed position (a token that left at an exit under
  ``recompute``, a speculative draft, an int8 draft) with the layer its K/V reach and its hidden
  state there, which is the input of its first owed layer when it rides along a later pass;
- ``drafts``: its pending (unverified) speculative drafts, oldest first: the exit layer each came
  from and, for sampled requests, the distribution it was drawn from (speculative sampling needs
  it at verification);
- ``spec``: the adaptive draft limit of a speculative request;
- ``matcher``: a constrained request's grammar state (``engine.grammar``), advanced by every
  token the runner chooses for it, drafts included, and rolled back when drafts go.
(A seeded request's generator is the ``Sampler``'s, released with this record.)
A preemption (``SchedulerOutput.preempted_ids``) drops the debt and the drafts (the grammar
forgets them): the request is recomputed from its verified tokens at full depth. The engine sees
none of this; it reads what a step changed from the step's ``SeqStep`` (``runner_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eeserve.engine.grammar import TokenMatcher

# Two verifications in a row that accept nothing pause drafting for this many verified tokens.
PAUSE_AFTER_REJECTIONS = 2
PAUSE_TOKENS = 8


@dataclass(kw_only=True)
class OwedPosition:
    """A position whose deep-layer K/V is still owed."""

    layer: int  # its K/V exist up to this layer (1-based; 0: none of the float model's)
    hidden: torch.Tensor  # [D] its hidden state after ``layer``: the input of layer + 1


@dataclass(kw_only=True)
class Draft:
    """One pending speculative draft (its token is the matching tail of the sequence's output)."""

    layer: int  # exit layer it came from (L: the int8 copy at full depth)
    probs: torch.Tensor | None = None  # [V] the distribution it was sampled from (sampled only)


@dataclass(kw_only=True)
class SpecControl:
    """A speculative request's adaptive draft limit: grows by one after a verification that
    accepts every draft, drops to what was accepted plus one after one that does not, and
    pauses drafting after ``PAUSE_AFTER_REJECTIONS`` verifications in a row accept nothing."""

    max_drafts: int  # ExitParams.num_draft_tokens
    limit: int = 0  # current limit (<= max_drafts); 0: max_drafts
    rejection_streak: int = 0
    pause: int = 0  # verified tokens left before drafting resumes

    def __post_init__(self) -> None:
        self.limit = self.limit or self.max_drafts

    def may_draft(self, num_pending: int, room: bool) -> bool:
        """May the next step draft, with ``num_pending`` drafts already and ``room`` for one
        more under ``max_tokens``?"""
        return room and self.pause == 0 and num_pending < self.limit

    def after_verification(self, num_drafts: int, num_accepted: int, num_tokens: int) -> None:
        """A verification of ``num_drafts`` drafts kept ``num_accepted`` of them and produced
        ``num_tokens`` verified tokens in all (0 drafts: a plain full-depth token)."""
        if num_drafts == 0:
            self.pause = max(0, self.pause - num_tokens)
            return
        if num_accepted == num_drafts:
            self.limit = min(self.max_drafts, self.limit + 1)
            self.rejection_streak = 0
            return
        # The draft after the accepted ones was wrong: drafting further out is likely wasted.
        self.limit = max(1, num_accepted + 1)
        self.rejection_streak = self.rejection_streak + 1 if num_accepted == 0 else 0
        if self.rejection_streak >= PAUSE_AFTER_REJECTIONS:
            self.pause, self.rejection_streak = PAUSE_TOKENS, 0


@dataclass(kw_only=True)
class RequestState:
    owed: dict[int, OwedPosition] = field(default_factory=dict)  # position -> its debt
    drafts: list[Draft] = field(default_factory=list)
    spec: SpecControl | None = None  # speculative requests only
    matcher: TokenMatcher | None = None  # constrained requests only

    @property
    def owed_positions(self) -> tuple[int, ...]:
        """The owed positions, ascending (the rows a pass computes before the new ones)."""
        return tuple(sorted(self.owed))

    def preempted(self) -> None:
        """Recomputation at full depth pays the debt; the unverified drafts are dropped."""
        self.owed.clear()
        if self.matcher is not None:
            self.matcher.rollback(len(self.drafts))
        self.drafts.clear()
