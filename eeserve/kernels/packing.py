"""CPU fast paths for a loaded model: oneDNN-packed projections and the engine's fused kernels.

Contract: ``use_native_ops(model, ops)`` routes every RMSNorm, rotary embedding and SwiGLU
activation of the model through the engine's own kernels (``native``): same arithmetic, one pass
each instead of several ATen ops. ``pack_for_cpu(model)`` replaces every projection of a loaded
model by a ``PackedLinear`` holding the same weights in oneDNN's blocked layout (the dense copy is
dropped, so memory does not grow), and gives each attention a packed K/V-only projection for the
KV-debt ``fill`` strategy. Outputs equal ``F.linear`` up to float rounding. Why: PyTorch's default
CPU matmul reads float32 weights at about half the memory bandwidth that the packed oneDNN kernels
reach for the small row counts of decoding (measured with ``eeserve bench``); bfloat16 on CPUs with
AVX512-BF16 likewise.
"""

from __future__ import annotations

import torch
from torch import nn

from eeserve.kernels.native import NativeOps
from eeserve.models.llama import LlamaForCausalLM, RMSNorm, Rotary


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        # Plain attributes, not buffers: ``state_dict`` of a packed model is not meant to be saved.
        self.packed = weight.detach().contiguous().to_mkldnn()
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dense in, dense out: no per-call layout conversion of the activations.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype, hidden_size: int) -> bool:
    """Packing pays off for real model sizes; tiny test models only see its call overhead."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or hidden_size < 256:
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_for_cpu(model: LlamaForCausalLM) -> None:
    for layer in model.layers:
        attn = layer.self_attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        attn.kv_proj = PackedLinear(w[attn.q_size :], None if b is None else b[attn.q_size :])
        attn.qkv_proj = PackedLinear(w, b)  # type: ignore[assignment]
        attn.o_proj = PackedLinear(attn.o_proj.weight, None)  # type: ignore[assignment]
        mlp = layer.mlp
        mlp.gate_up_proj = PackedLinear(mlp.gate_up_proj.weight, None)  # type: ignore[assignment]
        mlp.down_proj = PackedLinear(mlp.down_proj.weight, None)  # type: ignore[assignment]


def pack_linears(module: nn.Module, min_params: int = 1 << 19) -> None:
    """Pack every ``nn.Linear`` of ``module`` (exit heads) with at least ``min_params`` weights.

    Smaller ones stay dense: for a 576x576 matrix one decode row was measured faster through
    ``F.linear`` than through the packed kernel; a layer head's MLP is well above the bound.
    """
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.numel() >= min_params:
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child, min_params)


class NativeRMSNorm(nn.Module):
    """An ``RMSNorm`` (the same weight parameter) computed by the fused kernel."""

    def __init__(self, norm: RMSNorm, ops: NativeOps) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def use_native_ops(model: LlamaForCausalLM, ops: NativeOps) -> None:
    """Inference only: the kernels have no autograd and rotate in place."""

    def rotary(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
        ops.rotary_(x, rot.cos, rot.sin)
        return x

    for layer in model.layers:
        layer.input_layernorm = NativeRMSNorm(layer.input_layernorm, ops)  # type: ignore[assignment]
        layer.post_attention_layernorm = NativeRMSNorm(layer.post_attention_layernorm, ops)  # type: ignore[assignment]
        layer.self_attn.rotary = rotary
        layer.mlp.act = ops.silu_mul
    model.model.norm = NativeRMSNorm(model.model.norm, ops)  # type: ignore[arg-type]
