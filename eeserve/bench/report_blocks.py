"""Interleaved measurement of ``eeserve bench report``: jobs run side by side, repeat by repeat.

Contract: a ``Block`` is a set of jobs (a label and a call that returns a ``Run``) measured side
by side at one batch size. ``run_blocks(blocks, repeats, budget_s, bar, tokens)`` runs every job
of every block once per repeat, one after the other, so that drifts of the machine hit them all
alike; a further repeat starts only when the average repeat so far fits in what is left of
``budget_s`` (0: no budget), and at least one always runs. Each block keeps every job's runs;
``Block.median()`` picks each job's median run by decode tokens/s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eeserve.bench.measure import Run, median_of

Job = tuple[str, Callable[[], Run]]


@dataclass
class Block:
    """Jobs measured side by side: one after the other in every repeat."""

    what: str
    batch: int
    jobs: list[Job]
    runs: dict[str, list[Run]] = field(default_factory=dict)

    def median(self) -> dict[str, Run]:
        return {k: median_of(v, "decode_tokens_per_s") for k, v in self.runs.items()}


def run_blocks(blocks: list[Block], repeats: int, budget_s: float, bar: Any, tokens: int) -> int:
    """Every block once per repeat; a further repeat starts only when the average repeat so far
    fits in what is left of ``budget_s`` (0: no budget). Returns the repeats done (>= 1)."""
    start = time.perf_counter()
    for r in range(repeats):
        elapsed = time.perf_counter() - start
        if r and budget_s and elapsed * (r + 1) / r > budget_s:
            print(f"time budget: stopping after {r} of {repeats} repeats", file=sys.stderr)
            return r
        for block in blocks:
            for key, fn in block.jobs:
                bar.set_postfix_str(f"{block.what}: {key}", refresh=True)
                block.runs.setdefault(key, []).append(fn())
                bar.update(block.batch * tokens)
    return repeats
