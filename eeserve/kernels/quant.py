"""Weight-only int8 quantisation of a loaded model's projections (``quantization="int8"``).

Contract: ``quantize_int8(w)`` gives a symmetric int8 copy of a float weight [N, K] and its
float32 scales [N, K / 32]: one scale per group of ``GROUP_SIZE`` = 32 consecutive inputs of each
output channel (``w ~= q * scale`` group by group, |q| <= 127; an all-zero group gets scale 1; a
layer whose K is not a multiple of 32 gets one scale per channel). ``Int8Linear`` computes
``F.linear(round_activations(x), dequantize_int8(q, scale), bias)``: the activations are rounded
to int16 per chunk of 32 inputs (``round_activations``: at most 2^-16 of the chunk's largest
value, far below the weights' own rounding) so that the kernel (``csrc/int8_ops.cpp``) multiplies
with VNNI integer dot products; without the kernel the same arithmetic runs through PyTorch by
widening the int8 weight per call (correct everywhere, slow: a fallback, not a fast path).
``quantize_model(model, ops)`` replaces every
decoder projection (fused QKV, O, gate/up, down) and gives each attention an int8 K/V-only
projection for the KV-debt ``fill`` strategy; ``quantize_linears(module, ops)`` does it for exit
heads' large ``nn.Linear``\\ s. The dense float weights are dropped, except the embedding table,
which the LM head shares when tied: the LM head gets its own int8 copy.

Why groups of 32 and an int8 LM head, measured on SmolLM2-135M (32 bench prompts, 64 greedy
tokens, mean ROUGE-L against float32; docs/cpu-performance.md): one scale per channel 0.58 and
held-out perplexity +1.2%; groups of 64 0.78; groups of 32 0.81 and perplexity +0.13%; a float LM
head on top of groups of 32 gave the same tokens, so the head stays int8 (a quarter of the bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import BLOCK, ROW_CHUNK, pack_blocks
from eeserve.models.llama import LlamaForCausalLM

# Inputs per scale (the module docstring gives the measurement behind it).
GROUP_SIZE = 32


def group_count(in_features: int, group_size: int | None) -> int:
    """Scale groups per row: ``in_features / group_size``, or 1 (per channel) when it does not
    divide ``in_features`` or ``group_size`` is None."""
    if group_size is None or in_features % group_size != 0:
        return 1
    return in_features // group_size


def quantize_int8(
    weight: torch.Tensor, group_size: int | None = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N, groups]), symmetric, round to nearest.
    Rows go ``packing.ROW_CHUNK`` at a time: a vocabulary-sized head's float temporaries would
    otherwise need several times its own size at load."""
    w = weight.detach()
    n, k = w.shape
    groups = group_count(k, group_size)
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, groups, dtype=torch.float32, device=w.device)
    for lo in range(0, n, ROW_CHUNK):
        wg = w[lo : lo + ROW_CHUNK].float().view(-1, groups, k // groups)
        amax = wg.abs().amax(dim=2)
        sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [rows, groups]
        rows = torch.round(wg / sc[:, :, None]).clamp_(-127, 127).to(torch.int8)
        q[lo : lo + ROW_CHUNK] = rows.view(-1, k)
        scale[lo : lo + ROW_CHUNK] = sc
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] and scales [N, groups] -> float32 [N, K]."""
    n, k = q.shape
    groups = scale.shape[1]
    return (q.float().view(n, groups, k // groups) * scale[:, :, None]).view(n, k)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float32 [M, K] holding what the kernel multiplies: each chunk of 32 inputs of
    a row rounded to int16 with the scale amax / 32767 (the last chunk may be shorter)."""
    m, k = x.shape
    width = -(-k // GROUP_SIZE) * GROUP_SIZE
    xp = F.pad(x.float(), (0, width - k)).view(m, width // GROUP_SIZE, GROUP_SIZE)
    amax = xp.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    q = torch.round((xp * inv).clamp_(-32767, 32767))
    return (q * (amax / 32767.0)).view(m, width)[:, :k]


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [2 * ceil(N / 32), Kp / 2, 16, 2], Kp = K rounded up
    to 32, zero past N and K: per block of 16 channels, pairs of consecutive inputs side by side."""
    k = q.shape[1]
    width = -(-k // GROUP_SIZE) * GROUP_SIZE
    blocks = pack_blocks(F.pad(q, (0, width - k)))  # [B, Kp, 16]
    return blocks.view(blocks.shape[0], width // 2, 2, BLOCK).transpose(2, 3).contiguous()


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with float32 scales per group of inputs of each output
    channel (``group_size`` inputs; None: one scale per channel)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ops: NativeOps | None,
        group_size: int | None = GROUP_SIZE,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight, group_size)
        self.groups = scale.shape[1]
        self.ops = ops
        # Plain attributes, not buffers: a quantised ``state_dict`` is not meant to be saved.
        self.bias = None if bias is None else bias.detach().float().clone()
        # The kernel's layout when it is there; row-major weight and scales for the fallback.
        self.qweight = pack_int8(q) if ops is not None else q
        self.scale = pack_blocks(scale) if ops is not None else scale

    def row_scales(self) -> torch.Tensor:
        """[N] each output channel's largest scale (from either layout of ``scale``)."""
        return self.scale.amax(dim=1).reshape(-1)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.ops is not None:
            y = self.ops.int8_linear(x2, self.qweight, self.scale, self.bias, self.out_features)
        else:
            # The kernel's arithmetic, so that outputs do not depend on whether it was built.
            w = dequantize_int8(self.qweight, self.scale)
            y = F.linear(round_activations(x2), w, self.bias).to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        k, n, g = self.in_features, self.out_features, self.groups
        return f"in={k}, out={n}, group={k // g}, kernel={self.ops is not None}"


def quantize_model(model: LlamaForCausalLM, ops: NativeOps | None) -> None:
    """Every decoder projection -> ``Int8Linear``; attention also gets an int8 ``kv_proj``."""
    for layer in model.layers:
        attn = layer.self_attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        kv_bias = None if b is None else b[attn.q_size :]
        attn.kv_proj = Int8Linear(w[attn.q_size :], kv_bias, ops)
        attn.qkv_proj = Int8Linear(w, b, ops)  # type: ignore[assignment]
        attn.o_proj = Int8Linear(attn.o_proj.weight, None, ops)  # type: ignore[assignment]
        mlp = layer.mlp
        gate_up = Int8Linear(mlp.gate_up_proj.weight, None, ops)
        mlp.gate_up_proj = gate_up  # type: ignore[assignment]
        mlp.down_proj = Int8Linear(mlp.down_proj.weight, None, ops)  # type: ignore[assignment]


def quantize_linears(module: nn.Module, ops: NativeOps | None, min_params: int = 1 << 18) -> None:
    """Every ``nn.Linear`` of ``module`` with at least ``min_params`` weights -> ``Int8Linear``.

    Small ones stay float: their bytes do not matter and their rounding would."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.numel() >= min_params:
            setattr(module, name, Int8Linear(child.weight, child.bias, ops))
        else:
            quantize_linears(child, ops, min_params)
