"""Batch exit policies: which of the rows checked at an exit leave now.

Contract: ``decide`` applies the engine's policy (``config.ExitPolicy``, the one list of policies)
to the rows checked at one exit layer.
- ``per_sequence``: confident rows leave on their own;
- ``batch_all`` (the seed paper's): confident rows are marked, and every row stops at the first
  exit layer where all are marked;
- ``auto``: rows are marked as with ``batch_all``; all stop where all are marked, and before
  that the marked rows leave when ``shrink_pays`` (the layer cost model,
  ``engine.layer_cost``) says that the layers above cost less without them than with them.
  ``eager`` rows (speculative drafts, and rows whose threshold was calibrated under
  ``per_sequence``) leave whenever confident, as with ``per_sequence``.
Why each policy wins where it does: docs/design.md ("Batch policies").
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from eeserve.config import ExitPolicy


def decide(
    policy: ExitPolicy,
    confident: Seq[bool],
    marked: list[bool],
    all_checked: bool,
    shrink_pays: Callable[[int], bool] | None = None,
    eager: Seq[bool] | None = None,
) -> list[bool]:
    """Which of the checked rows leave now.

    ``marked`` is the sticky mark of the checked rows (updated in place); ``all_checked``: every
    running row was checked here (else no policy but ``per_sequence`` can stop them all);
    ``shrink_pays(m)``: ``auto``'s cost model, do m leaving rows save time; ``eager``: rows that
    leave whenever confident under ``auto``."""
    if policy == ExitPolicy.PER_SEQUENCE:
        return list(confident)
    for i, c in enumerate(confident):
        marked[i] = marked[i] or c
    if all_checked and all(marked):
        return [True] * len(marked)
    if policy == ExitPolicy.BATCH_ALL:
        return [False] * len(marked)
    assert policy == ExitPolicy.AUTO, policy
    leave = [bool(e and c) for e, c in zip(eager or [False] * len(marked), confident)]
    rest = [m and not x for m, x in zip(marked, leave)]
    if any(rest) and shrink_pays is not None and shrink_pays(sum(rest) + sum(leave)):
        leave = [x or r for x, r in zip(leave, rest)]
    return leave
