"""Batch exit policies: which of the rows checked at an exit leave now.

Contract: ``decide`` applies the engine's policy. ``per_sequence`` lets confident rows leave on
their own; ``batch_all`` (the seed paper's) marks confident rows and stops every row at the
first exit layer where all are marked (docs/design.md, "Batch policies").
"""

from __future__ import annotations

from collections.abc import Sequence as Seq


def decide(policy: str, confident: Seq[bool], marked: list[bool], all_checked: bool) -> list[bool]:
    """Which of the checked rows leave now.

    ``marked`` is the sticky ``batch_all`` state of the checked rows (updated in place);
    ``all_checked``: every running row was checked here (else ``batch_all`` cannot stop).
    """
    if policy == "per_sequence":
        return list(confident)
    for i, c in enumerate(confident):
        marked[i] = marked[i] or c
    leave = all_checked and all(marked)
    return [leave] * len(marked)
