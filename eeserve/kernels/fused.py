"""Whole decoder layers in one kernel call each (``csrc/layer_ops.cpp``).

Contract: ``FusedDecoder.build(model, ops)`` returns a decoder when every projection of the model
runs on one of the engine's own linear kernels (``PackedLinear`` on float32, ``Int8Linear`` or
``GGUFLinear`` on GGUF blocks, with ``ops``) and its norms are the engine's, else None (also for a
layer type without a kernel).
Llama layers run ``decoder_layer``, Gemma 3 layers ``gemma3_layer`` (its local layers with the
local rotary tables and ``local_attn``, the rows' windowed contexts). ``run`` computes the layers
``[start, end)`` for the rows of a pass (decode rows attended one by one, prompts and prompt
chunks as spans of consecutive rows: ``PassAttention``), writing their K/V as
``LlamaDecoderLayer.forward`` with the engine's attention would, with the same kernels in the
same order: the same numbers, without the ~15 Python calls per layer. The caller says how
(``FusedCall``): one kernel call per layer, or, for a pass whose rows all attend one query each
(decode steps, ``stacks``), the whole range in one call (``decode_stack``,
``csrc/decode_stack.cpp``, Llama and Gemma 3 layers); ``run_checked`` runs such a range with exit
checks between its layers (``decode_stack_checked``), stopping after the first check where a
row may leave. Tensors come in plain (the pools, slot tables):
this layer does not know the engine's cache classes.

The hand-offs are named: a layer's tensors are a ``LlamaLayerWeights`` or ``Gemma3LayerWeights``,
a check's a ``StackCheck``, the layer type and measure codes ``StackArch`` and ``StackMeasure``,
and every op is called with keyword arguments. The dataclasses' field order is the order of the
kernels' flat tensor lists; ``check_layout`` holds it (and the codes) against the tables the
kernels export (``stack_layout()``, ``csrc/stack_layout.h``), and ``build`` raises on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import cached_property
from typing import Any

import torch

from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import NativeRMSNorm
from eeserve.kernels.stack_layout import (
    LAYER_WEIGHTS,
    STACK_MEASURES,
    Gemma3LayerWeights,
    LayerWeights,
    LlamaLayerWeights,
    Projection,
    StackArch,
    StackCheck,
    check_layout,
    named_tensors,
    projection,
)
from eeserve.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer
from eeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

Tables = tuple[torch.Tensor, torch.Tensor]  # a layer's rotary (cos, sin), each [R, head_dim]


class FusedCall(StrEnum):
    """How ``FusedDecoder.run`` computes a range of layers."""

    STACK = "stack"  # the whole range in one decode_stack call (decode rows only)
    LAYERS = "layers"  # one decoder_layer / gemma3_layer call per layer


@dataclass(frozen=True, kw_only=True)
class CheckedSpan:
    """The checks of a run of layers: after 1-based layer ``layers[c]`` check ``checks[c]``
    under ``measure`` (a name in ``STACK_MEASURES``); row r stops the run at check c when its
    confidence reaches ``thresholds[c, r]`` (-inf: there; +inf: never)."""

    layers: list[int]
    checks: list[StackCheck]
    measure: str
    shortlist_rows: int  # K: the shortlist measures' logits per row
    thresholds: torch.Tensor  # [C, R] float32


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


@dataclass(frozen=True, kw_only=True)
class FusedLayer:
    """One layer's kernel, its weights, and whether it is a local layer (Gemma 3: the local
    rotary tables, attention within the window)."""

    op: Any  # torch.ops.eeserve.decoder_layer.default or gemma3_layer.default
    arch: StackArch
    weights: LayerWeights
    eps: float
    local: bool = False

    @cached_property
    def args(self) -> dict[str, object]:
        """``op``'s keyword arguments that stay the same at every call: weights and eps."""
        return {**named_tensors(self.weights), "eps": self.eps}


def _projections(
    layer: LlamaDecoderLayer, norms: tuple[torch.nn.Module, ...]
) -> tuple[Projection, ...] | None:
    """(qkv, o, gate_up, down) when they and ``norms`` run on the engine's kernels, else None."""
    if not all(isinstance(n, NativeRMSNorm) for n in norms):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    found = [projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in found):
        return None
    return tuple(p for p in found if p is not None)


def _layer(layer: LlamaDecoderLayer, eps: float, ops: NativeOps) -> FusedLayer | None:
    """The layer's kernel call, or None when no kernel computes it."""
    if type(layer) is LlamaDecoderLayer:
        return _llama_layer(layer, eps, ops)
    if type(layer) is Gemma3DecoderLayer and isinstance(layer.self_attn, Gemma3Attention):
        return _gemma3_layer(layer, layer.self_attn, eps, ops)
    return None  # another layer type: the modules compute it


def _llama_layer(layer: LlamaDecoderLayer, eps: float, ops: NativeOps) -> FusedLayer | None:
    norms: tuple[torch.nn.Module, ...] = (layer.input_layernorm, layer.post_attention_layernorm)
    projs = _projections(layer, norms)
    if projs is None or any(p.bias is not None for p in projs[1:]):  # only QKV's bias is added
        return None
    qkv, o, gate_up, down = projs
    weights = LlamaLayerWeights(
        norm1=_weight(norms[0]),
        norm2=_weight(norms[1]),
        qkv_w=qkv.weight,
        qkv_s=qkv.scale,
        qkv_b=qkv.bias,
        o_w=o.weight,
        o_s=o.scale,
        gate_up_w=gate_up.weight,
        gate_up_s=gate_up.scale,
        down_w=down.weight,
        down_s=down.scale,
    )
    op = ops.ops.decoder_layer.default
    return FusedLayer(op=op, arch=StackArch.llama, weights=weights, eps=eps)


def _gemma3_layer(
    layer: Gemma3DecoderLayer, attn: Gemma3Attention, eps: float, ops: NativeOps
) -> FusedLayer | None:
    norms = (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm,
        attn.q_norm,
        attn.k_norm,
    )
    projs = _projections(layer, norms)
    if projs is None or any(p.bias is not None for p in projs):
        return None
    qkv, o, gate_up, down = projs
    in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm, q_norm, k_norm = map(_weight, norms)
    weights = Gemma3LayerWeights(
        in_norm=in_norm,
        attn_out_norm=attn_out_norm,
        mlp_in_norm=mlp_in_norm,
        mlp_out_norm=mlp_out_norm,
        q_norm=q_norm,
        k_norm=k_norm,
        qkv_w=qkv.weight,
        qkv_s=qkv.scale,
        o_w=o.weight,
        o_s=o.scale,
        gate_up_w=gate_up.weight,
        gate_up_s=gate_up.scale,
        down_w=down.weight,
        down_s=down.scale,
    )
    op, arch = ops.ops.gemma3_layer.default, StackArch.gemma3
    return FusedLayer(op=op, arch=arch, weights=weights, eps=eps, local=attn.local)


def _weight(norm: torch.nn.Module) -> torch.Tensor:
    """A norm's weight (``_projections`` saw that it is a ``NativeRMSNorm``)."""
    assert isinstance(norm, NativeRMSNorm)
    return norm.weight


class FusedDecoder:
    def __init__(self, model: LlamaForCausalLM, ops: NativeOps, layers: list[FusedLayer]) -> None:
        cfg = model.config
        self.ops, self.layers = ops, layers
        self.head_dim = cfg.head_dim
        # Gemma 3's local layers attend within one window (None: no layer has a window).
        self.window = next((w for w in cfg.layer_windows() if w is not None), None)
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.intermediate = cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5
        # The layers' one type when decode_stack computes them all: a pass of decode rows then
        # runs them in one call (None: layer by layer).
        archs = {layer.arch for layer in layers}
        self.arch: StackArch | None = archs.pop() if len(archs) == 1 else None
        # Every layer's tensors in decode_stack's order (_per_layer a layer), flattened once.
        self._stack: list[torch.Tensor | None] | None = None
        self._per_layer = 0
        # decode_stack's keyword arguments that are the same at every call.
        self._stack_static: dict[str, object] = {}
        if self.arch is not None:
            self._per_layer = len(fields(LAYER_WEIGHTS[self.arch]))
            self._stack = [t for y in layers for t in named_tensors(y.weights).values()]
            self._stack_static = {
                "eps": layers[0].eps,
                "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads,
                "intermediate": self.intermediate,
                "scale": self.scale,
                "arch": self.arch.value,
            }
        # The ops' overloads themselves: keyword arguments to an overload packet are matched
        # against its overloads at every call (~7 us for decode_stack's), to one overload not.
        self._decode_stack = ops.ops.decode_stack.default
        self._decode_stack_checked = ops.ops.decode_stack_checked.default
        # decode_stack's local_layers: a flag per Gemma 3 layer, none for Llama.
        gemma3 = self.arch is StackArch.gemma3
        self._local_flags = [int(y.local) for y in layers] if gemma3 else []
        # Per-layer views of the KV pools, made once per pool (``_pool_views``).
        self._pools: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # The last pass's rotary tables and their halves (``_rotary_tables``).
        self._tables: tuple[torch.Tensor, dict[bool, Tables]] | None = None

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
        """The model's decoder on the kernels, or None (see the module's contract). Raises
        RuntimeError when the kernels' hand-off layout differs from this module's."""
        if ops is None:
            return None
        check_layout(ops)
        if len({w for w in model.config.layer_windows() if w is not None}) > 1:
            return None  # one window for every local layer (Gemma 3) is what run() passes
        layers: list[FusedLayer] = []
        for layer in model.layers:
            fused = _layer(layer, model.config.rms_norm_eps, ops)
            if fused is None:
                return None
            layers.append(fused)
        return cls(model, ops, layers)

    def run(
        self,
        call: FusedCall,
        h: torch.Tensor,  # [R, D] float32
        cos: torch.Tensor,  # [R, head_dim], or [R, 2 * head_dim]: global then local tables
        sin: torch.Tensor,
        k_pool: torch.Tensor,  # [layers, slots, Hkv, head_dim]
        v_pool: torch.Tensor,
        attn: PassAttention,
        start: int = 0,
        end: int | None = None,
        local_attn: PassAttention | None = None,
    ) -> torch.Tensor:
        """Layers ``[start, end)`` in one ``decode_stack`` call (``call`` STACK: ``stacks(attn,
        local_attn)`` must hold) or one kernel call per layer (LAYERS). ``local_attn``: how the
        rows attend in the local layers (within the window; None: as ``attn``). The engine's
        ``kernel_route`` chooses the call."""
        stop = len(self.layers) if end is None else end
        if call is FusedCall.STACK:
            assert self.stacks(attn, local_attn), "decode_stack takes decode rows only"
            args = self._stack_args(h, cos, sin, k_pool, v_pool, attn, local_attn, start, stop)
            return self._decode_stack(**args)  # type: ignore[no-any-return]
        pools = self._pool_views(k_pool, v_pool)
        tables = self._rotary_tables(cos, sin)
        # The same per-pass arguments for every layer: built once, not per layer call.
        passes = {
            local: self._pass_args(local_attn if local and local_attn else attn, *tables[local])
            for local in (False, True)
        }
        for i in range(start, stop):
            layer = self.layers[i]  # its registered op itself: no wrapper frame per layer
            k_cache, v_cache = pools[i]
            h = layer.op(h=h, k_cache=k_cache, v_cache=v_cache, **layer.args, **passes[layer.local])
        return h

    def stacks(self, attn: PassAttention, local_attn: PassAttention | None = None) -> bool:
        """Whether a pass of these rows runs its layers in one call (decode rows only, in the
        local layers too)."""
        return self._stack is not None and all(
            a.row_idx is None and not a.span_starts for a in (attn, local_attn) if a is not None
        )

    def run_checked(
        self,
        h: torch.Tensor,  # [R, D] float32
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        attn: PassAttention,
        start: int,
        stop: int,
        span: CheckedSpan,
        local_attn: PassAttention | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layers ``[start, stop)`` with ``span``'s checks between them (``stacks(attn,
        local_attn)`` must hold): (the output [R, D] of the last layer run, the confidences
        [C, R] (NaN for checks not reached), the check that stopped the run or -1)."""
        assert self.stacks(attn, local_attn)
        out, conf, stopped = self._decode_stack_checked(
            **self._stack_args(h, cos, sin, k_pool, v_pool, attn, local_attn, start, stop),
            check_after=[layer - 1 - start for layer in span.layers],
            check_eps=[c.eps for c in span.checks],
            check_weights=[t for c in span.checks for t in c.tensors],
            measure=STACK_MEASURES[span.measure].value,
            shortlist_rows=span.shortlist_rows,
            thresholds=span.thresholds,
        )
        return out, conf, int(stopped)

    def _stack_args(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        attn: PassAttention,
        local_attn: PassAttention | None,
        start: int,
        stop: int,
    ) -> dict[str, object]:
        """decode_stack's keyword arguments for layers ``[start, stop)`` of rows that each
        attend one query (decode steps); decode_stack_checked's first ones. ``local_attn``: the
        rows' contexts in local layers (None: as ``attn``)."""
        assert self._stack is not None
        n = self._per_layer
        tables = self._rotary_tables(cos, sin)
        local = local_attn or attn
        return dict(
            self._stack_static,
            h=h.contiguous(),
            weights=self._stack[start * n : stop * n],
            cos=tables[False][0],
            sin=tables[False][1],
            k_pool=k_pool,
            v_pool=v_pool,
            first_layer=start,
            slot_mapping=attn.slot_mapping,
            row_slots=attn.row_slots.contiguous(),
            row_lens=attn.row_lens,
            local_layers=self._local_flags[start:stop],
            local_cos=tables[True][0],
            local_sin=tables[True][1],
            local_slots=local.row_slots.contiguous(),
            local_lens=local.row_lens,
        )

    def _rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> dict[bool, Tables]:
        """Global (False) and local (True) layers' (cos, sin). Gemma's [R, 2 * head_dim] tables
        are cut into contiguous halves once per pass: the exit loop runs a pass's layers in
        several calls with the same tables."""
        if cos.shape[1] != 2 * self.head_dim:
            return {False: (cos, sin), True: (cos, sin)}
        if self._tables is None or self._tables[0] is not cos:
            hd = self.head_dim
            glob = (cos[:, :hd].contiguous(), sin[:, :hd].contiguous())
            local = (cos[:, hd:].contiguous(), sin[:, hd:].contiguous())
            self._tables = (cos, {False: glob, True: local})
        return self._tables[1]

    def _pass_args(
        self, attn: PassAttention, cos: torch.Tensor, sin: torch.Tensor
    ) -> dict[str, object]:
        """A layer op's keyword arguments that are the same for every layer of a pass (of its
        kind: global or local)."""
        return {
            "cos": cos,
            "sin": sin,
            "slot_mapping": attn.slot_mapping,
            "row_idx": attn.row_idx,
            "row_slots": attn.row_slots,
            "row_lens": attn.row_lens,
            "span_starts": attn.span_starts,
            "span_slots": attn.span_slots,
            "span_positions": attn.span_positions,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate": self.intermediate,
            "scale": self.scale,
        }
