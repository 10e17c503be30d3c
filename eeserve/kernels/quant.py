"""Weight-only int8 quantisation of a loaded model's projections (``quantization="int8"``).

Contract: ``quantize_int8(w)`` gives a symmetric per-output-channel int8 copy of a float weight
[N, K] and its scales [N] (``w ~= q * scale[:, None]``, |q| <= 127; a zero row gets scale 1).
``Int8Linear`` computes ``F.linear(x, q * scale[:, None], bias)`` with float activations (never
quantised): through the engine's kernel (``csrc/int8_ops.cpp``, float32 sums over the int8 values)
when the CPU kernels are loaded, else by widening the int8 weight per call (correct everywhere,
slow: a fallback, not a fast path). ``quantize_model(model, ops)`` replaces every decoder
projection (fused QKV, O, gate/up, down) and gives each attention an int8 K/V-only projection for
the KV-debt ``fill`` strategy; ``quantize_linears(module, ops)`` does it for exit heads' large
``nn.Linear``\\ s. The dense float weights are dropped, except the embedding table, which the LM
head shares when tied: the LM head gets its own int8 copy (``Int8Linear(lm_head.weight)``).

Why per output channel: one scale per row keeps the kernel a plain int8 x float dot product with a
single multiply per output; on SmolLM2-135M it keeps greedy output close to float32 (quality is
measured by ``eeserve bench`` and reported in docs/cpu-performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eeserve.kernels.native import NativeOps
from eeserve.models.llama import LlamaForCausalLM

# The kernel's layout: 16 output channels side by side per k, tiles of 2 such blocks.
_BLOCK, _TILE = 16, 32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N]), symmetric, round to nearest."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [2 * ceil(N / 32), K, 16], zero channels past N."""
    n, k = q.shape
    padded = -(-n // _TILE) * _TILE
    out = torch.zeros(padded, k, dtype=torch.int8, device=q.device)
    out[:n] = q
    return out.view(padded // _BLOCK, _BLOCK, k).transpose(1, 2).contiguous()


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 with one float32 scale per output channel."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, ops: NativeOps | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight)
        self.ops = ops
        # Plain attributes, not buffers: a quantised ``state_dict`` is not meant to be saved.
        self.scale = scale
        self.bias = None if bias is None else bias.detach().float().clone()
        # The kernel's layout when it is there; the row-major int8 weight for the fallback.
        self.qweight = pack_int8(q) if ops is not None else q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.ops is not None:
            y = self.ops.int8_linear(x2, self.qweight, self.scale, self.bias)
        else:
            w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            b = None if self.bias is None else self.bias.to(x.dtype)
            y = F.linear(x2, w, b)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.ops is not None}"


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
        mlp.gate_up_proj = Int8Linear(mlp.gate_up_proj.weight, None, ops)  # type: ignore[assignment]
        mlp.down_proj = Int8Linear(mlp.down_proj.weight, None, ops)  # type: ignore[assignment]


def quantize_linears(module: nn.Module, ops: NativeOps | None, min_params: int = 1 << 18) -> None:
    """Every ``nn.Linear`` of ``module`` with at least ``min_params`` weights -> ``Int8Linear``.

    Small ones stay float: their bytes do not matter and their rounding would."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.numel() >= min_params:
            setattr(module, name, Int8Linear(child.weight, child.bias, ops))
        else:
            quantize_linears(child, ops, min_params)
