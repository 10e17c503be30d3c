"""Confidence measures: how sure an exit is of its token, for the rows checked at one exit.

Contract: ``confidence`` computes a measure (docs/design.md: softmax margin, max prob,
hidden-state cosine, classifier probe; the two softmax measures also over a vocabulary
shortlist) for some rows at one exit layer. Only the softmax measures need exit logits; the exit
loop computes those only where a measure or an exiting row needs them. This is the engine's one
statement of the arithmetic in Python; the layer kernel's twin for the measures it computes
between layers (``kernels.stack_layout.StackMeasure``) is ``csrc/stack_checks.h``'s, and
tests/test_fused.py holds each of those against this function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eeserve.exit_params import LOGIT_MEASURES, SHORTLIST_MEASURES, Measure


def confidence(
    measure: str,
    logits: torch.Tensor | None,
    h: torch.Tensor,
    h_prev: torch.Tensor,
    probe: torch.Tensor | None,
) -> torch.Tensor:
    """Confidence [n] of rows at one exit.

    logits: [n, V] exit-head logits (softmax measures; [n, K] over the shortlist for the
    shortlist measures); h: [n, D] hidden after the exit layer
    (``layer`` heads: h_mid of the layer above); h_prev: [n, D] hidden before it (``layer`` heads:
    h_l), for ``hidden_cosine``; probe: [n] classifier logit.
    """
    if measure in LOGIT_MEASURES or measure in SHORTLIST_MEASURES:
        assert logits is not None
        probs = logits.float().softmax(dim=-1)
        top = probs.topk(2, dim=-1).values
        margin = measure in (Measure.SOFTMAX_MARGIN, Measure.SHORTLIST_MARGIN)
        return top[:, 0] - top[:, 1] if margin else top[:, 0]
    if measure == Measure.HIDDEN_COSINE:
        return F.cosine_similarity(h.float(), h_prev.float(), dim=-1)
    if measure == Measure.CLASSIFIER:
        assert probe is not None
        return torch.sigmoid(probe.float())
    raise ValueError(f"unknown measure {str(measure)!r}")
