"""Iteration-level (continuous) batching with a token budget and preemption by recomputation.

Contract: each ``schedule()`` returns the sequences for one forward pass, either a prefill batch
(new or resumed sequences; prefills go first so that waiting requests join as soon as they fit)
or a decode batch (every running sequence, one token each). When a decode step cannot get a
block, the most recently admitted sequence is preempted: its blocks are freed and it waits at
the head of the queue to be recomputed later, so its output does not change. Requests that
could never fit are refused by the engine before they get here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from eeserve.engine.block_manager import BlockManager
from eeserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefill = self._schedule_prefill()
        if prefill:
            return SchedulerOutput(prefill, is_prefill=True)
        return self._schedule_decode()

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            too_big = scheduled and seq.num_tokens > budget
            if too_big or not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            budget -= seq.num_new_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self) -> SchedulerOutput:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running = list(scheduled)
        return SchedulerOutput(scheduled, is_prefill=False, preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        # Recomputation at full prompt depth pays any outstanding KV debt; unverified
        # speculative drafts are dropped (only verified tokens are recomputed).
        seq.kv_debt.clear()
        seq.discard_drafts()
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
