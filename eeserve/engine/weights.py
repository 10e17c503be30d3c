"""How the model runner lays out its weights: the engine's kernels, packed float or int8.

Contract: ``WeightKernels`` says which kernels a runner's projections and norms run on (the
device, dtype and the native CPU ops, when loaded) and builds them: ``linear(weight, bias,
fmt)`` is x -> x weight^T + bias in the asked ``WeightFormat`` (int8, packed float32 or dense),
``norm`` an RMS norm on the native kernel where there is one. ``place_weights`` routes a loaded
model (and its exit heads) onto those kernels once, at load, and returns the LM head to use
(``kernels.screened_head`` for greedy steps where it applies); a model on native weights
(``kernels.gguf_linear``) keeps its block-format modules and head as they are. Runs after
anything that needs the float weights as loaded (the int8 drafter's copy, the ``fill``
projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F

from eeserve.config import Quantization
from eeserve.kernels.gguf_linear import GGUFLinear
from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import (
    NativeRMSNorm,
    PackedLinear,
    can_pack,
    native_norms,
    pack_for_cpu,
    pack_linears,
    use_native_ops,
)
from eeserve.kernels.quant import Int8Linear, quantize_linears, quantize_model
from eeserve.kernels.screened_head import screened
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM, RMSNorm


class WeightFormat(StrEnum):
    FLOAT = "float"  # the runner's dtype: packed for the engine's kernels where they apply
    INT8 = "int8"  # weight-only int8 with per-group scales


@dataclass(frozen=True, kw_only=True)
class WeightKernels:
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    native: NativeOps | None  # the engine's CPU kernels (None: PyTorch ops only)

    @property
    def packs(self) -> bool:
        """Float weights are packed for the engine's linear kernel."""
        return can_pack(self.device, self.dtype, self.hidden_size, self.native)

    def linear(
        self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: WeightFormat
    ) -> torch.nn.Module:
        """x [n, D] -> x weight^T + bias [n, K] for a weight [K, D] of the model's."""
        weight = weight.detach().contiguous()
        if fmt is WeightFormat.INT8:
            return Int8Linear(weight, bias, self.native if self.device.type == "cpu" else None)
        if self.packs:
            return PackedLinear(weight, bias, self.native)
        return _Dense(weight, bias)

    def norm(self, norm: RMSNorm) -> torch.nn.Module:
        """``norm`` on the engine's kernel where there is one."""
        return norm if self.native is None else NativeRMSNorm(norm, self.native)


def place_weights(
    model: LlamaForCausalLM,
    exit_heads: ExitHeads | None,
    *,
    kernels: WeightKernels,
    quantization: Quantization | None,
    screen_head: bool,
    drafter_head: torch.nn.Module | None,
) -> torch.nn.Module:
    """Routes the model (and exit heads) onto the engine's kernels, int8 or packed float weights
    where they apply; returns the LM head to use. ``drafter_head``: the int8 drafter's LM head,
    which the screened head reuses as its screen."""
    native = kernels.native
    if native is not None:
        use_native_ops(model, native)
    if exit_heads is not None:
        exit_heads.to(device=kernels.device, dtype=kernels.dtype).eval().requires_grad_(False)
        if native is not None:
            native_norms(exit_heads, native)
    if isinstance(model.lm_head, GGUFLinear):
        return model.lm_head  # native weights: the blocks are the kernels' layout already
    if quantization is Quantization.INT8:
        # Every size, tiny test models included: quantisation is asked for, not a speed-up.
        ops = native if kernels.device.type == "cpu" else None
        quantize_model(model, ops)
        if exit_heads is not None:
            quantize_linears(exit_heads, ops)
        return Int8Linear(model.lm_head.weight, None, ops)
    if kernels.packs:
        pack_for_cpu(model, native)
        if exit_heads is not None:
            pack_linears(exit_heads, native)
        head = PackedLinear(model.lm_head.weight, None, native)
        return screened(head, model.lm_head.weight, drafter_head) if screen_head else head
    return model.lm_head


class _Dense(torch.nn.Module):
    """A linear over a fixed weight [K, D] and bias [K] (no packing on this device or dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
