"""Whole decoder layers in one kernel call each (``csrc/layer_ops.cpp``).

Contract: ``FusedDecoder.build(model, ops)`` returns a decoder when every projection of the model
runs on one of the engine's own linear kernels (``PackedLinear`` on float32 or ``Int8Linear``,
with ``ops``) and its norms are the engine's, else None (also for a model whose layers are not
plain Llama layers: Gemma 3's run through the modules). ``run`` computes the layers
``[start, end)`` for the rows of a pass (decode rows attended one by one, prompts and prompt
chunks as spans of consecutive rows: ``PassAttention``), writing their K/V as
``LlamaDecoderLayer.forward`` with the engine's attention would, with the same kernels in the
same order: the same numbers, without the ~15 Python calls per layer. Tensors come in plain (the
pools, slot tables): this layer does not know the engine's cache classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import NativeRMSNorm, PackedLinear
from eeserve.kernels.quant import Int8Linear
from eeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# (packed weight, int8 scales or None, bias or None)
Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class PassAttention:
    """How the rows of a pass attend, as plain tensors: the row-wise rows (one query each) and
    the spans (a prompt or a chunk of one: consecutive rows sharing their keys)."""

    slot_mapping: torch.Tensor  # [R] where each row's K/V goes
    row_idx: torch.Tensor | None  # [R'] the row-wise rows; None: every row (and no span)
    row_slots: torch.Tensor  # [R', T] row r attends to row_slots[r, :row_lens[r]]
    row_lens: torch.Tensor  # [R']
    span_starts: list[int] = field(default_factory=list)  # a span's first row
    span_slots: list[torch.Tensor] = field(default_factory=list)  # [ctx] its context's slots
    span_positions: list[torch.Tensor] = field(default_factory=list)  # [n] its query positions


def _projection(module: torch.nn.Module) -> Projection | None:
    if isinstance(module, PackedLinear) and module.ops is not None:
        return module.packed, None, module.bias
    if isinstance(module, Int8Linear) and module.ops is not None:
        return module.qweight, module.scale, module.bias
    return None


def _layer_weights(layer: LlamaDecoderLayer, eps: float) -> tuple[object, ...] | None:
    """The layer's static arguments of ``decoder_layer`` (norms, eps, then each projection's
    weight and scales, and the fused QKV's bias), or None when the kernel cannot run it."""
    if type(layer) is not LlamaDecoderLayer:  # the kernel computes a Llama layer (not Gemma's)
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(isinstance(n, NativeRMSNorm) for n in norms):
        return None
    qkv, o, gate_up, down = (
        _projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    )
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    if any(p[2] is not None for p in (o, gate_up, down)):  # the kernel adds only QKV's bias
        return None
    return (norms[0].weight, norms[1].weight, eps, *qkv, *o[:2], *gate_up[:2], *down[:2])


class FusedDecoder:
    def __init__(
        self, model: LlamaForCausalLM, ops: NativeOps, layers: list[tuple[object, ...]]
    ) -> None:
        cfg = model.config
        self.ops, self.layers = ops, layers
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5
        # Per-layer views of the KV pools, made once per pool (``_pool_views``).
        self._pools: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _pool_views(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k_pool[i], v_pool[i]) per layer; the runner's pools live as long as the engine, so
        the views are cut once rather than at every layer call."""
        if self._pools is None or self._pools[0] is not k_pool:
            self._pools = (k_pool, list(zip(k_pool.unbind(0), v_pool.unbind(0))))
        return self._pools[1]

    @classmethod
    def build(cls, model: LlamaForCausalLM, ops: NativeOps | None) -> FusedDecoder | None:
        if ops is None:
            return None
        layers: list[tuple[object, ...]] = []
        for layer in model.layers:
            weights = _layer_weights(layer, model.config.rms_norm_eps)
            if weights is None:
                return None
            layers.append(weights)
        return cls(model, ops, layers)

    def run(
        self,
        h: torch.Tensor,  # [R, D] float32
        cos: torch.Tensor,  # [R, head_dim]
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [layers, slots, Hkv, head_dim]
        v_pool: torch.Tensor,
        attn: PassAttention,
        start: int = 0,
        end: int | None = None,
    ) -> torch.Tensor:
        op = self.ops.ops.decoder_layer  # the registered op itself: no wrapper frame per layer
        pools = self._pool_views(k_pool, v_pool)
        # The same per-pass arguments for every layer: built once, not per layer call.
        meta = (
            attn.slot_mapping, attn.row_idx, attn.row_slots, attn.row_lens,
            attn.span_starts, attn.span_slots, attn.span_positions,
            self.num_heads, self.num_kv_heads, self.intermediate, self.scale,
        )  # fmt: skip
        for i in range(start, len(self.layers) if end is None else end):
            h = op(h, *self.layers[i], cos, sin, *pools[i], *meta)
        return h
