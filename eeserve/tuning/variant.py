"""A model trained to exit, in ``tune-exits --train-base lora``: make it, and measure it against
the original.

Contract: ``make_variant`` measures the frozen original on the held-out groups (its final argmax
at every held-out decode position, and its perplexity), trains the base delta
(``tuning.delta_train``), merges it, rounded to its stored float16, into ``model`` in place (the
model is then the variant that the ordinary head tuning sees as a frozen model) and returns a
``Variant``. ``variant_report`` adds the variant's side: its full-depth agreement with the
original and its perplexity. Perplexity is measured on the held-out *prompts* (text, not model
output, and never trained on: held-out prompts are a split of their own), each prompt position
predicting the next prompt token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eeserve.models.base_delta import BaseDelta, merge_base_delta, rounded, weights_hash
from eeserve.models.llama import LlamaForCausalLM
from eeserve.tuning.data import collect
from eeserve.tuning.delta_train import train_base_delta
from eeserve.tuning.groups import Group
from eeserve.tuning.options import TuneOptions


@dataclass
class Variant:
    delta: BaseDelta  # as stored (float16 values)
    base_model_hash: str
    reference: torch.Tensor  # [N] the original's final argmax at the held-out decode positions
    perplexity_original: float
    training: dict[str, Any]


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, groups: list[Group]) -> float:
    """exp(mean NLL) of every next prompt token of ``groups`` (continuations ignored)."""
    prompts = [Group(g.prompt, []) for g in groups if len(g.prompt) > 1]
    if not prompts:
        raise ValueError("perplexity needs held-out prompts of at least 2 tokens")
    data = collect(model, prompts, [1], topk=1, desc="perplexity", rows="prompt")
    # Rows are every prompt position in order; the last of each prompt has no next prompt token.
    targets = torch.cat([torch.tensor([*g.prompt[1:], -1]) for g in prompts])
    nll, count = 0.0, 0
    lm_w = model.lm_head.weight.float()
    for x, t in zip(data.final.split(1024), targets.split(1024)):
        logp = F.log_softmax(x @ lm_w.T, -1)
        keep = t >= 0
        nll -= float(logp[keep].gather(1, t[keep, None]).sum())
        count += int(keep.sum())
    return math.exp(nll / max(1, count))


def make_variant(
    model: LlamaForCausalLM,
    folder: Path,
    train_groups: list[Group],
    heldout_groups: list[Group],
    exit_layers: list[int],
    opts: TuneOptions,
    checkpoints: Path | None,
) -> Variant:
    """The original's held-out figures, then the delta trained and merged into ``model``."""
    base_hash = weights_hash(folder)
    original = collect(model, heldout_groups, exit_layers[:1], topk=1, desc="collect (original)")
    ppl = perplexity(model, heldout_groups)
    delta, stats = train_base_delta(
        model, train_groups, exit_layers, opts, checkpoints, heldout_groups
    )
    stored = rounded(delta)
    merge_base_delta(model, stored)
    return Variant(stored, base_hash, original.target, ppl, stats)


def variant_report(
    model: LlamaForCausalLM, variant: Variant, heldout_target: torch.Tensor, groups: list[Group]
) -> dict[str, Any]:
    """The report's ``variant`` section; ``heldout_target``: the variant's final argmax on the
    same held-out positions as ``variant.reference``."""
    return {
        "full_depth_agreement_with_original": float(
            (heldout_target == variant.reference).float().mean()
        ),
        "perplexity": {
            "original": variant.perplexity_original,
            "variant": perplexity(model, groups),
        },
        "base_model_hash": variant.base_model_hash,
        "lora_rank": variant.delta.rank,
        "lora_scale": variant.delta.scale,
        "training": variant.training,
    }
