"""Whole decoder layers in one kernel call each, for decode rows (``csrc/layer_ops.cpp``).

Contract: ``FusedDecoder.build(model, ops)`` returns a decoder when every projection of the model
runs on one of the engine's own linear kernels (``PackedLinear`` on float32 or ``Int8Linear``,
with ``ops``) and its norms are the engine's, else None. ``run`` computes the layers
``[start, end)`` for rows that are all decode rows (one query each, context in the paged pool,
``AttnMeta.rowwise`` everywhere), writing their K/V as ``LlamaDecoderLayer.forward`` with the
engine's attention would, with the same kernels in the same order: the same numbers, without the
~15 Python calls per layer. Tensors come in plain (the pools, slot tables): this layer does not
know the engine's cache classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import NativeRMSNorm, PackedLinear
from eeserve.kernels.quant import Int8Linear
from eeserve.models.llama import LlamaForCausalLM

# (packed weight, int8 scales or None, bias or None)
Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _projection(module: torch.nn.Module) -> Projection | None:
    if isinstance(module, PackedLinear) and module.ops is not None:
        return module.packed, None, module.bias
    if isinstance(module, Int8Linear) and module.ops is not None:
        return module.qweight, module.scale, module.bias
    return None


@dataclass(frozen=True)
class FusedLayer:
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


class FusedDecoder:
    def __init__(self, model: LlamaForCausalLM, ops: NativeOps, layers: list[FusedLayer]) -> None:
        cfg = model.config
        self.ops, self.layers = ops, layers
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5

    @classmethod
    def build(cls, model: LlamaForCausalLM, ops: NativeOps | None) -> FusedDecoder | None:
        if ops is None:
            return None
        layers: list[FusedLayer] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = [_projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj)]
            projs.append(_projection(mlp.down_proj))
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(p is None for p in projs) or not all(
                isinstance(n, NativeRMSNorm) for n in norms
            ):
                return None
            qkv, o, gate_up, down = projs
            assert qkv is not None and o is not None and gate_up is not None and down is not None
            layers.append(FusedLayer(norms[0].weight, norms[1].weight, qkv, o, gate_up, down))
        return cls(model, ops, layers)

    def run(
        self,
        h: torch.Tensor,  # [R, D] float32
        cos: torch.Tensor,  # [R, head_dim]
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [layers, slots, Hkv, head_dim]
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,  # [R]
        row_slots: torch.Tensor,  # [R, T]
        row_lens: torch.Tensor,  # [R]
        start: int = 0,
        end: int | None = None,
    ) -> torch.Tensor:
        op = self.ops.decode_layer
        for i in range(start, len(self.layers) if end is None else end):
            w = self.layers[i]
            h = op(
                h, w.norm1, w.norm2, self.eps, *w.qkv, *w.o[:2], *w.gate_up[:2], *w.down[:2],
                cos, sin, k_pool[i], v_pool[i], slot_mapping, row_slots, row_lens,
                self.num_heads, self.num_kv_heads, self.intermediate, self.scale,
            )  # fmt: skip
        return h
