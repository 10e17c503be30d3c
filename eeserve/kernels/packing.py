"""CPU fast paths for a loaded model: packed projections and the engine's fused kernels.

Contract: ``use_native_ops(model, ops)`` routes every RMSNorm, rotary embedding and SwiGLU
activation of the model through the engine's own kernels (``native``): same arithmetic, one pass
each instead of several ATen ops. ``pack_for_cpu(model, ops)`` replaces every projection of a
loaded model by a ``PackedLinear`` holding the same weights in a kernel's layout (the dense copy is
dropped, so memory does not grow), and gives each attention a packed K/V-only projection for the
KV-debt ``fill`` strategy. Outputs equal ``F.linear`` up to float rounding. Which kernel, measured
on the 2-core AVX-512 machine with ``eeserve bench`` and per projection (docs/cpu-performance.md):
float32 weights go to the engine's own kernel (``csrc/f32_ops.cpp``, blocks of 16 output channels)
when ``ops`` is loaded: it read the default model's projections at 27-36 GB/s at one row where
oneDNN's packed kernel read 15-35, and was faster at 8 to 256 rows too; bfloat16 weights (CPUs with
AVX512-BF16), or float32 without the engine's kernels, go to oneDNN's blocked layout, which reads
them at about twice the rate of PyTorch's default CPU matmul at decode's row counts.
"""

from __future__ import annotations

import torch
from torch import nn

from eeserve.kernels.native import NativeOps
from eeserve.models.gemma3 import gelu_tanh_and_mul
from eeserve.models.llama import LlamaForCausalLM, RMSNorm, Rotary, silu_and_mul

# The engine kernels' layout: blocks of 16 output channels side by side, tiles of 2 such blocks.
BLOCK, TILE = 16, 32
# Rows of a weight packed (or quantised, ``quant``) at once, a multiple of BLOCK: a
# vocabulary-sized head then needs no whole float temporary beside its packed copy at load.
ROW_CHUNK = 4096


def pack_blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [2 * ceil(N / 32), X, 16]: each block of 16 rows (output channels) transposed so
    that one column of the block is 16 consecutive values; zero rows past N."""
    n, x = t.shape
    padded = -(-n // TILE) * TILE
    out = torch.zeros(padded // BLOCK, x, BLOCK, dtype=t.dtype, device=t.device)
    for lo in range(0, n, ROW_CHUNK):
        rows = t[lo : lo + ROW_CHUNK]
        m = rows.shape[0]
        whole = -(-m // BLOCK) * BLOCK
        if whole != m:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, whole - m))
        blocks = out[lo // BLOCK : (lo + whole) // BLOCK]
        blocks.copy_(rows.view(-1, BLOCK, x).transpose(1, 2))
    return out


class PackedLinear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, ops: NativeOps | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach()
        self.ops = ops if w.dtype == torch.float32 and w.device.type == "cpu" else None
        # Plain attributes, not buffers: ``state_dict`` of a packed model is not meant to be saved.
        self.packed = pack_blocks(w) if self.ops is not None else w.contiguous().to_mkldnn()
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features)
            y = self.ops.f32_linear(x2, self.packed, self.bias, self.out_features)
            return y.view(*lead, self.out_features)
        # Dense in, dense out: no per-call layout conversion of the activations.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(
    device: torch.device, dtype: torch.dtype, hidden_size: int, ops: NativeOps | None = None
) -> bool:
    """Whether ``pack_for_cpu`` applies. The engine's float32 kernel at every size, so that tiny
    test models run the same code as real ones; oneDNN packing pays off only for real model
    sizes (tiny models see its call overhead)."""
    if device.type != "cpu":
        return False
    if ops is not None and dtype == torch.float32:
        return True
    if not torch.backends.mkldnn.is_available() or hidden_size < 256:
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_for_cpu(model: LlamaForCausalLM, ops: NativeOps | None) -> None:
    for layer in model.layers:
        attn = layer.self_attn
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        kv_bias = None if b is None else b[attn.q_size :]
        attn.kv_proj = PackedLinear(w[attn.q_size :], kv_bias, ops)
        attn.qkv_proj = PackedLinear(w, b, ops)  # type: ignore[assignment]
        attn.o_proj = PackedLinear(attn.o_proj.weight, None, ops)  # type: ignore[assignment]
        mlp = layer.mlp
        gate_up = PackedLinear(mlp.gate_up_proj.weight, None, ops)
        mlp.gate_up_proj = gate_up  # type: ignore[assignment]
        mlp.down_proj = PackedLinear(mlp.down_proj.weight, None, ops)  # type: ignore[assignment]


def pack_linears(module: nn.Module, ops: NativeOps | None, min_params: int = 1 << 19) -> None:
    """Pack every ``nn.Linear`` of ``module`` (exit heads) with at least ``min_params`` weights.

    Smaller ones stay dense: for a 576x576 matrix one decode row was measured faster through
    ``F.linear`` than through the packed kernel; a layer head's MLP is well above the bound.
    """
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.numel() >= min_params:
            setattr(module, name, PackedLinear(child.weight, child.bias, ops))
        else:
            pack_linears(child, ops, min_params)


class NativeRMSNorm(nn.Module):
    """An ``RMSNorm`` (the same weight parameter) computed by the fused kernel."""

    def __init__(self, norm: RMSNorm, ops: NativeOps) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def native_norms(module: nn.Module, ops: NativeOps) -> None:
    """Every ``RMSNorm`` under ``module`` computed by the fused kernel: PyTorch's ``rms_norm`` of a
    few rows costs tens of microseconds of dispatch, as much as a small projection."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is RMSNorm:
                setattr(parent, name, NativeRMSNorm(child, ops))


def use_native_ops(model: LlamaForCausalLM, ops: NativeOps) -> None:
    """Inference only: the kernels have no autograd and rotate in place."""

    def rotary(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
        ops.rotary_(x, rot.cos, rot.sin)
        return x

    for layer in model.layers:
        # Every norm of the layer: Llama's two; Gemma's four and its per-head q/k norms.
        native_norms(layer, ops)
        layer.self_attn.rotary = rotary
        if layer.mlp.act is silu_and_mul:  # Llama's SwiGLU
            layer.mlp.act = ops.silu_mul
        elif layer.mlp.act is gelu_tanh_and_mul:  # Gemma's GeGLU
            layer.mlp.act = ops.gelu_mul
    model.model.norm = NativeRMSNorm(model.model.norm, ops)  # type: ignore[arg-type]
