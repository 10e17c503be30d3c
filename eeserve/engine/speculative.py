"""Self-speculative decoding: an early exit drafts, the layers above it verify.

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
How a step works (see ``ExitLoop``): a drafting row carries an exit plan; when it is confident
at an exit it leaves with a draft token and owes the deep layers of its position (the
``recompute`` KV debt). A row that is not confident at any exit, or that may not draft (limit
reached), runs to full depth with every owed position as a passenger: that is the verification,
and the final head is applied to those passenger rows too. The engine then rolls back the
rejected positions (``LLMEngine._apply_spec``, ``BlockManager.truncate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eeserve.engine.sampler import Sampler, race, token_logprobs
from eeserve.sampling_params import SamplingParams

# Two verifications in a row that accept nothing pause drafting for this many verified tokens.
PAUSE_AFTER_REJECTIONS = 2
PAUSE_TOKENS = 8
# No drafting in decode steps of more sequences than this. Every kept token still runs all L
# layers (a draft's deep layers run later, as a verification passenger), so speculation only
# pays where a step's cost hardly grows with its rows (weight reads dominate: small batches).
# On CPU a batch of 8 is already compute-bound: measured 0.70x full depth with drafting at
# batch 8 and 32 (docs/speculative.md); 4 is a cautious guess between measured points.
DRAFT_MAX_BATCH = 4
# The int8 drafter (``speculative_draft="int8"``) drafts at about half a step's cost at small
# batches; what limits it is the verification pass, whose rows (every sequence's drafts plus one)
# stop being nearly free once the pass is compute-bound. Sequences draft only in steps of at most
# INT8_DRAFT_MAX_BATCH rows, and again only while rows times (their drafts + 2) stay within
# VERIFY_MAX_ROWS: up to 4 drafts at batch 1-4, 3 at 5-6, 2 at 7-8. Measured on the default model
# on 2 CPU cores (docs/speculative.md): batch 8 gained 1.09x with 2 drafts, 1.05x with 1 or 4;
# batch 12 with 1 draft lost (0.89-0.93x).
INT8_DRAFT_MAX_BATCH = 8
VERIFY_MAX_ROWS = 24


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


class SpecDecoder:
    """The runner's half of speculation: remembers each pending draft's distribution (sampling)
    and turns a verification's logits into ``SpecOutput``. Holds tensors, so it lives with the
    model runner; the ``Sequence`` keeps only the pure-Python ``SpecState``."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._q: dict[int, list[torch.Tensor]] = {}  # seq_id -> [V] per pending draft

    def release(self, seq_id: int) -> None:
        self._q.pop(seq_id, None)

    def draft(
        self, seq_id: int, params: SamplingParams, logits: torch.Tensor, token: int, layer: int
    ) -> SpecOutput:
        """A draft ``token`` sampled from the exit head's logits [V] at ``layer``."""
        if not params.greedy:
            q = Sampler.probabilities(logits[None], [params])[0]
            self._q.setdefault(seq_id, []).append(q)
        return SpecOutput(True, [token], draft_layer=layer)

    def verify(
        self, seq_id: int, params: SamplingParams, drafts: list[int], logits: torch.Tensor
    ) -> SpecOutput:
        """logits [k+1, V]: full depth at the k drafted positions and the next one."""
        if params.greedy:
            tokens, a = accept_greedy(drafts, logits)
        else:
            q = self._q.pop(seq_id, [])
            assert len(q) == len(drafts), "draft distributions out of step with the drafts"
            p = Sampler.probabilities(logits, [params] * logits.shape[0])
            gen = self.sampler.generator(seq_id, params.seed, logits.device)
            q_t = torch.stack(q) if q else p[:0]
            tokens, a = accept_sampled(drafts, q_t, p, gen)
        self._q.pop(seq_id, None)
        n = params.logprobs
        lps = [
            token_logprobs(logits[i], t, n) if n is not None else None for i, t in enumerate(tokens)
        ]
        return SpecOutput(False, tokens, num_accepted=a, logprobs=lps)
