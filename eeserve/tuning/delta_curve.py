"""The training curve of a base delta: held-out agreement measured while it trains.

Contract:
``CurveProbe(groups, chunk_tokens)`` packs held-out groups once (their continuation positions only;
the first groups up to ``MAX_POSITIONS`` of them: a point costs two forward passes and six full-
vocabulary heads over them, and +-0.01 is enough to see a curve flatten). ``probe.point(model,
heads, switch, rope)`` measures, teacher-forced at the current weights and without gradients: per
exit layer the fraction of those positions where the joint exit head's argmax (full vocabulary)
equals the model's own final argmax, and the fraction where the model's final argmax equals the
original's (``switch(False)`` turns the delta off for that pass, ``switch(True)`` back on).
``tuning.delta_train`` records one point every ``eval_every`` steps, so that a run's report shows
where agreement stops growing, and the same probe run with the base frozen (``lora_lr=0``) is the
heads-only baseline on the same data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM
from eeserve.tuning.data import Packed, chunks, exit_states, pack_groups
from eeserve.tuning.groups import Group

MAX_POSITIONS = 2048


class CurveProbe:
    def __init__(self, groups: list[Group], chunk_tokens: int) -> None:
        self.groups: list[Group] = []
        self.packs: list[Packed] = []
        positions = 0
        for part in chunks(groups, chunk_tokens):
            if positions >= MAX_POSITIONS:
                break
            packed = pack_groups(part, False, True)
            if len(packed.rows):
                self.groups += part
                self.packs.append(packed)
                positions += len(packed.rows)
        if not self.packs:
            raise ValueError("the training curve needs held-out groups with continuations")

    @torch.no_grad()
    def point(
        self,
        model: LlamaForCausalLM,
        heads: ExitHeads,
        switch: Callable[[bool], None],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> dict[str, Any]:
        layers = heads.config.exit_layers
        device = model.lm_head.weight.device
        agree = {lay: 0 for lay in layers}
        same_as_original, total = 0, 0
        for packed in self.packs:
            packed = packed.to(device)
            switch(False)
            original = _final_argmax(model, packed, rope, [])[0]
            switch(True)
            final, hidden = _final_argmax(model, packed, rope, layers)
            for lay in layers:
                logits = heads.normed(lay, hidden[lay]) @ model.lm_head.weight.T  # [m, V]
                agree[lay] += int((logits.argmax(-1) == final).sum())
            same_as_original += int((final == original).sum())
            total += len(final)
        return {
            "exit_agreement": {str(lay): agree[lay] / total for lay in layers},
            "full_depth_agreement_with_original": same_as_original / total,
            "positions": total,
        }


def _final_argmax(
    model: LlamaForCausalLM,
    packed: Packed,
    rope: tuple[torch.Tensor, torch.Tensor],
    layers: list[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The final argmax [m] at the packed rows, and the exit layers' states {l: [m, D]}."""
    hidden, final = exit_states(model, packed, rope, layers)
    return (final @ model.lm_head.weight.T).argmax(-1), hidden  # logits [m, V]
