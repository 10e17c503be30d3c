"""Iteration-level (continuous) batching with a token budget and preemption by recomputation.

Contract: each ``schedule()`` returns the sequences of one forward pass and, per sequence, how
many of its positions the pass computes (``num_tokens``); a sequence samples its next token in
that pass only when those positions reach its last token.

- Chunked prefill (``enable_chunked_prefill``, the default): one pass carries, first, one decode
  row for every running sequence whose prompt is done (latency first: a decoding stream never
  waits for a prompt), then prompt chunks of running sequences still prefilling, then of waiting
  sequences admitted in arrival order, until ``max_num_batched_tokens`` positions (decode rows
  count one each, plus owed ``recompute`` positions). A prompt longer than the budget is prefilled
  over several passes; its blocks are reserved when it is admitted. With ``attention_context``
  = C > 0, a prompt position p counts 1 + p / C instead of 1: its attention over the p positions
  before it costs p / C of its projections, so a late chunk of a long prompt is shorter than an
  early one and every pass costs about the same (the decoding streams' gap is bounded, not only
  the token count). Every chunk gets at least one position.
- Without it: a pass is either a prefill batch (new or resumed sequences, whole prompts; prefills
  go first so that waiting requests join as soon as they fit) or a decode batch (every running
  sequence, one token each).

A constrained sequence whose grammar forced tokens after its last one (jump-forward) has
several new positions: they get their slots as a decode row does and are computed together in
the next pass, as its decode rows, outside the prompt budget.
When a decode row cannot get a block, the most recently admitted sequence is preempted: its
blocks are freed and it waits at the head of the queue to be recomputed later (from its prefix
cache hits, if any), so its output does not change. Requests that could never fit are refused
by the engine before they get here.

Each output also names the requests (``Sequence.seq_id``) that finished since the last one and
those preempted by this one, so that the model runner drops or resets its record of them
(``engine.request_state``) without scanning anything.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from eeserve.engine.block_manager import BlockManager
from eeserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    attention_context: float = 0.0  # C above; 0: every position counts one


def chunk_size(start: int, remaining: int, budget: float, context: float) -> tuple[int, float]:
    """The most positions from ``start`` on (at most ``remaining``, at least one) whose cost
    sum_p (1 + p / context) fits ``budget``, and that cost (``context`` 0: one per position)."""
    if context <= 0:
        n = max(1, min(remaining, int(budget)))
        return n, float(n)
    # n (1 + (start + (n - 1) / 2) / C) <= budget: the positive root of the quadratic in n.
    b = 1 + (start - 0.5) / context
    n = int((-b + math.sqrt(b * b + 2 * budget / context)) * context)
    n = max(1, min(remaining, n))
    return n, n * (1 + (start + (n - 1) / 2) / context)


@dataclass(kw_only=True)
class SchedulerOutput:
    seqs: list[Sequence]
    num_tokens: list[int]  # per sequence: positions this pass computes (its last ones if sampling)
    preempted_ids: list[int] = field(default_factory=list)  # preempted by this schedule
    finished_ids: list[int] = field(default_factory=list)  # finished or aborted since the last


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._finished_ids: list[int] = []  # since the last ``schedule``

    def _output(
        self, seqs: list[Sequence], num_tokens: list[int], preempted: list[Sequence] | None = None
    ) -> SchedulerOutput:
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            seqs=seqs,
            num_tokens=num_tokens,
            preempted_ids=[s.seq_id for s in preempted or []],
            finished_ids=finished,
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        if self.config.enable_chunked_prefill:
            return self._schedule_mixed()
        prefill = self._schedule_prefill()
        if prefill:
            return self._output(prefill, [s.num_new_tokens for s in prefill])
        return self._schedule_decode()

    def _schedule_mixed(self) -> SchedulerOutput:
        """Decode rows of every running sequence, then prompt chunks within the budget."""
        kept, preempted = self._reserve([s for s in self.running if self._grows(s)])
        # A forced run is decoding too: whole, outside the budget (its tokens would otherwise
        # take a pass each).
        counts = [s.num_new_tokens for s in kept]
        prefilling = [s for s in self.running if s.num_new_tokens > 1 and s not in kept]
        budget: float = self.config.max_num_batched_tokens
        budget -= sum(n + len(s.owed) for s, n in zip(kept, counts))
        seqs = list(kept)
        for seq in prefilling:
            if budget <= 0:
                break
            budget = self._add_chunk(seq, budget, seqs, counts)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self._admit(seq)
            budget = self._add_chunk(seq, budget, seqs, counts)
        return self._output(seqs, counts, preempted)

    def _add_chunk(
        self, seq: Sequence, budget: float, seqs: list[Sequence], counts: list[int]
    ) -> float:
        """Schedule ``seq``'s next prompt chunk; returns the budget left."""
        n, cost = chunk_size(
            seq.num_computed_tokens, seq.num_new_tokens, budget, self.config.attention_context
        )
        seqs.append(seq)
        counts.append(n)
        return budget - cost

    def _admit(self, seq: Sequence) -> None:
        self.waiting.popleft()
        self.block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            too_big = scheduled and seq.num_tokens > budget
            if too_big or not self.block_manager.can_allocate(seq):
                break
            self._admit(seq)
            budget -= seq.num_new_tokens
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> SchedulerOutput:
        scheduled, preempted = self._reserve(list(self.running))
        return self._output(scheduled, [s.num_new_tokens for s in scheduled], preempted)

    def _grows(self, seq: Sequence) -> bool:
        """Does ``seq`` need cache slots for new tokens: a decode row, or a run of tokens that a
        grammar forced (jump-forward), computed as a chunk of generated positions."""
        return seq.num_new_tokens == 1 or (
            bool(seq.output_token_ids) and not self.block_manager.covers(seq)
        )

    def _reserve(self, decoding: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """A block slot for the next token of each of ``decoding``; when none is left, the most
        recently admitted running sequence (decoding or not) is preempted. Returns the decoding
        sequences that got their slot, and the preempted ones."""
        kept: list[Sequence] = []
        preempted: list[Sequence] = []
        queue = list(self.running)  # admission order: victims come from the end
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            while not self.block_manager.can_append(seq):
                victim = queue.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                kept.append(seq)
        return kept, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.preempted()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (normal end, abort or error)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._finished_ids.append(seq.seq_id)
