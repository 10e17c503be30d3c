"""Quality of early-exit output against full depth: token agreement and ROUGE-L.

Contract: pure functions on token-id lists or texts; 1.0 means identical.
"""

from __future__ import annotations

from collections.abc import Sequence


def token_agreement(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of reference positions where the candidate has the same token (strict, positional:
    a divergence early in the text costs everything after it, like CALM's textual consistency)."""
    if not reference:
        return 1.0 if not candidate else 0.0
    same = sum(1 for a, b in zip(candidate, reference) if a == b)
    return same / max(len(reference), len(candidate))


def lcs_length(a: Sequence[object], b: Sequence[object]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str | Sequence[object], reference: str | Sequence[object]) -> float:
    """ROUGE-L F1 on whitespace words (for texts) or on the items of the sequences."""
    c = candidate.split() if isinstance(candidate, str) else list(candidate)
    r = reference.split() if isinstance(reference, str) else list(reference)
    if not c or not r:
        return 1.0 if c == r else 0.0
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)
