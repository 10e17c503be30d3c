"""Self-speculative decoding, the per-sequence half: telemetry and acceptance.

Contract:
- ``SpecStats`` (pure Python, on the ``Sequence``) is a speculative request's telemetry; the
  runner keeps its drafts and adaptive limit (``engine.request_state``).
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


@dataclass(kw_only=True)
class SpecStats:
    """A speculative request's telemetry, per verified output token: the exit layer of the draft
    it verified (None: not drafted) and whether that draft was accepted (None: not drafted)."""

    draft_layers: list[int | None] = field(default_factory=list)
    accepted: list[bool | None] = field(default_factory=list)
    num_drafted: int = 0  # drafts that were verified (dropped ones are not counted)
    num_accepted: int = 0
    num_verifications: int = 0  # verifications that checked at least one draft

    def record(self, layers: list[int], num_accepted: int, num_tokens: int) -> None:
        """A verification of drafts from ``layers`` kept ``num_accepted`` and produced
        ``num_tokens`` verified tokens in all."""
        k = len(layers)
        self.draft_layers += [*layers[: num_accepted + 1], None][:num_tokens]
        self.accepted += [*([True] * num_accepted), *([False] if num_accepted < k else [None])][
            :num_tokens
        ]
        if k == 0:
            return
        self.num_drafted += k
        self.num_accepted += num_accepted
        self.num_verifications += 1


@dataclass(kw_only=True)
class SpecOutput:
    """One speculative sequence's result of a step."""

    drafted: bool  # True: ``token_ids`` is one new draft; False: a verification
    token_ids: list[int]  # the draft, or the verified tokens (accepted drafts + one)
    num_accepted: int = 0
    # A verification: the exit layers of the drafts it checked, oldest first (telemetry).
    draft_layers: list[int] = field(default_factory=list)
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
