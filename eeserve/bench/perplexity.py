"""Held-out perplexity of a model folder in float32 and with this engine's int8 weights.

Contract: ``heldout_perplexity(folder, quantized, n_texts, max_len)`` is exp of the mean next-token
negative log-likelihood over ``n_texts`` passages of the ``heldout`` split (``tuning.prompts``),
each cut to ``max_len`` tokens. With ``quantized`` every projection and the LM head hold the
int8 weights that ``quantization="int8"`` loads (``kernels.quant.quantize_int8``, dequantised):
the engine's arithmetic up to float summation order (tests/test_quant.py pins that), run through
HF transformers' causal forward because the engine has no teacher-forced scoring path.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from eeserve.kernels import quant
from eeserve.tuning.prompts import prompt_texts

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantize_(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _PROJECTIONS:
            module.weight.data = quant.dequantize_int8(*quant.quantize_int8(module.weight))
    head = model.get_output_embeddings()  # type: ignore[operator]
    # Its own parameter: a tied embedding table stays float32, as in the engine.
    head.weight = torch.nn.Parameter(quant.dequantize_int8(*quant.quantize_int8(head.weight)))


@torch.inference_mode()
def heldout_perplexity(
    folder: Path, quantized: bool, n_texts: int = 16, max_len: int = 256
) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if quantized:
        _dequantize_(model)
    nll, count = 0.0, 0
    for text in prompt_texts(n_texts, seed=0, split="heldout"):
        ids = torch.tensor([tok(text).input_ids[:max_len]])
        logits = model(ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
    return math.exp(nll / count)
