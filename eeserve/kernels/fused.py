"""Whole decoder layers in one kernel call each (``csrc/layer_ops.cpp``).

Contract: ``FusedDecoder.build(model, ops)`` returns a decoder when every projection of the model
runs on one of the engine's own linear kernels (``PackedLinear`` on float32 or ``Int8Linear``,
with ``ops``) and its norms are the engine's, else None (also for a layer type without a kernel).
Llama layers run ``decoder_layer``, Gemma 3 layers ``gemma3_layer`` (its local layers with the
local rotary tables and ``local_attn``, the rows' windowed contexts). ``run`` computes the layers
``[start, end)`` for the rows of a pass (decode rows attended one by one, prompts and prompt
chunks as spans of consecutive rows: ``PassAttention``), writing their K/V as
``LlamaDecoderLayer.forward`` with the engine's attention would, with the same kernels in the
same order: the same numbers, without the ~15 Python calls per layer. A pass whose rows all
attend one query each (decode steps) runs the whole range in one call (``decode_stack``,
``csrc/decode_stack.cpp``, Llama and Gemma 3 layers); ``run_checked`` runs such a range with exit
checks between its layers (``decode_stack_checked``), stopping after the first check where a
row may leave. Tensors come in plain (the pools, slot tables):
this layer does not know the engine's cache classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import NativeRMSNorm, PackedLinear
from eeserve.kernels.quant import Int8Linear
from eeserve.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer
from eeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# decode_stack's layer types (its ``arch``), and their tensors per layer in its weight list: the
# layer kernel's weights without eps (decoder_layer's, gemma3_layer's).
STACK_ARCH = {"llama": 0, "gemma3": 1}
STACK_TENSORS = {"llama": 11, "gemma3": 14}
_EPS_INDEX = {"llama": 2, "gemma3": 6}  # where eps sits among a layer kernel's weights
Tables = tuple[torch.Tensor, torch.Tensor]  # a layer's rotary (cos, sin), each [R, head_dim]
# (packed weight, int8 scales or None, bias or None)
Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# The exit measures decode_stack_checked computes between layers, by the kernel's code for them.
STACK_MEASURES = {"shortlist_max_prob": 0, "shortlist_margin": 1, "classifier": 2}


@dataclass(frozen=True)
class StackCheck:
    """One exit layer's check in decode_stack_checked's terms: six tensors (shortlist: the
    adapter's packed weight, scales and bias, or three None; the unit norm's weight [D]; the
    rows' packed weight and scales. Classifier: weight [D], None, bias [1], None, None, None)
    and the norm's epsilon."""

    tensors: tuple[torch.Tensor | None, ...]
    eps: float = 0.0

    @classmethod
    def shortlist(
        cls, pre: torch.nn.Module | None, norm: torch.nn.Module, rows: torch.nn.Module
    ) -> StackCheck | None:
        """From a shortlist head's modules; None unless each runs on the engine's kernels."""
        pre_p = None if pre is None else projection(pre)
        rows_p = projection(rows)
        if (pre is not None and pre_p is None) or rows_p is None or rows_p[2] is not None:
            return None
        if not isinstance(norm, NativeRMSNorm):
            return None
        first = pre_p if pre_p is not None else (None, None, None)
        return cls((*first, norm.weight.detach(), rows_p[0], rows_p[1]), norm.eps)

    @classmethod
    def classifier(cls, weight: torch.Tensor, bias: torch.Tensor) -> StackCheck:
        """A probe: weight [D], bias [1] (float32)."""
        return cls((weight.contiguous(), None, bias.contiguous(), None, None, None))


@dataclass(frozen=True)
class CheckedSpan:
    """The checks of a run of layers: after 1-based layer ``layers[c]`` check ``checks[c]``
    under ``measure``; row r stops the run at check c when its confidence reaches
    ``thresholds[c, r]`` (-inf: there; +inf: never)."""

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


def projection(module: torch.nn.Module) -> Projection | None:
    """A projection's packed tensors when it runs on one of the engine's kernels, else None."""
    if isinstance(module, PackedLinear) and module.ops is not None:
        return module.packed, None, module.bias
    if isinstance(module, Int8Linear) and module.ops is not None:
        return module.qweight, module.scale, module.bias
    return None


@dataclass(frozen=True)
class FusedLayer:
    """One layer's kernel, its static arguments, and whether it is a local layer (Gemma 3: the
    local rotary tables, attention within the window)."""

    op: Any  # torch.ops.eeserve.decoder_layer or gemma3_layer
    weights: tuple[object, ...]
    local: bool = False


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
        norms: tuple[torch.nn.Module, ...] = (layer.input_layernorm, layer.post_attention_layernorm)
        projs = _projections(layer, norms)
        if projs is None or any(p[2] is not None for p in projs[1:]):  # only QKV's bias is added
            return None
        qkv, o, gate_up, down = projs
        weights = (norms[0].weight, norms[1].weight, eps, *qkv, *o[:2], *gate_up[:2], *down[:2])
        return FusedLayer(ops.ops.decoder_layer, weights)
    attn = layer.self_attn
    if type(layer) is Gemma3DecoderLayer and isinstance(attn, Gemma3Attention):
        norms = (
            layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm,
        )  # fmt: skip
        projs = _projections(layer, norms)
        if projs is None or any(p[2] is not None for p in projs):
            return None
        parts = tuple(t for p in projs for t in p[:2])
        norm_weights = tuple(n.weight for n in norms)
        return FusedLayer(ops.ops.gemma3_layer, (*norm_weights, eps, *parts), attn.local)
    return None  # another layer type: the modules compute it


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
        # Every layer's weights in decode_stack's order (STACK_TENSORS a layer), when the layers
        # are all of one type it computes: a pass of decode rows then runs them in one call.
        self._stack: list[object] | None = None
        self.arch = next((a for a, op in (("llama", ops.ops.decoder_layer),
                                          ("gemma3", ops.ops.gemma3_layer))
                          if all(layer.op is op for layer in layers)), None)  # fmt: skip
        if self.arch is not None:
            at = _EPS_INDEX[self.arch]
            self.eps = layers[0].weights[at]
            self._stack = [t for layer in layers for i, t in enumerate(layer.weights) if i != at]
        # decode_stack's local_layers: a flag per Gemma 3 layer, none for Llama.
        self._local_flags = [int(y.local) for y in layers] if self.arch == "gemma3" else []
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
        if ops is None:
            return None
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
        """``local_attn``: how the rows attend in the local layers (within the window; None:
        as ``attn``)."""
        stop = len(self.layers) if end is None else end
        if self.stacks(attn, local_attn):
            args = self._stack_args((h, cos, sin, k_pool, v_pool), attn, local_attn, start, stop)
            return self.ops.ops.decode_stack(*args)  # type: ignore[no-any-return]
        pools = self._pool_views(k_pool, v_pool)
        tables = self._rotary_tables(cos, sin)
        # The same per-pass arguments for every layer: built once, not per layer call.
        metas = {local: self._pass_args(local_attn if local and local_attn else attn)
                 for local in (False, True)}  # fmt: skip
        for i in range(start, stop):
            layer = self.layers[i]  # its registered op itself: no wrapper frame per layer
            h = layer.op(h, *layer.weights, *tables[layer.local], *pools[i], *metas[layer.local])
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
        after = [layer - 1 - start for layer in span.layers]
        tensors = [t for c in span.checks for t in c.tensors]
        out, conf, stopped = self.ops.ops.decode_stack_checked(
            *self._stack_args((h, cos, sin, k_pool, v_pool), attn, local_attn, start, stop),
            after, [c.eps for c in span.checks], tensors, STACK_MEASURES[span.measure],
            span.shortlist_rows, span.thresholds,
        )  # fmt: skip
        return out, conf, int(stopped)

    def _stack_args(
        self,
        tensors: tuple[torch.Tensor, ...],
        attn: PassAttention,
        local_attn: PassAttention | None,
        start: int,
        stop: int,
    ) -> list[object]:
        """decode_stack's arguments for layers ``[start, stop)`` of rows that each attend one
        query (decode steps); decode_stack_checked's first ones. ``tensors``: (h [R, D], cos,
        sin, k_pool, v_pool); ``local_attn``: the rows' contexts in local layers (None: as
        ``attn``)."""
        assert self._stack is not None and self.arch is not None
        h, cos, sin, k_pool, v_pool = tensors
        n = STACK_TENSORS[self.arch]
        tables = self._rotary_tables(cos, sin)
        local = local_attn or attn
        return [
            h.contiguous(), self._stack[start * n : stop * n], self.eps, *tables[False], k_pool,
            v_pool, start, attn.slot_mapping, attn.row_slots.contiguous(), attn.row_lens,
            self.num_heads, self.num_kv_heads, self.intermediate, self.scale,
            STACK_ARCH[self.arch], self._local_flags[start:stop],
            *tables[True], local.row_slots.contiguous(), local.row_lens,
        ]  # fmt: skip

    def _rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> dict[bool, Tables]:
        """Global (False) and local (True) layers' (cos, sin). Gemma's [R, 2 * head_dim] tables
        are cut into contiguous halves once per pass: the exit loop runs a pass's layers in
        several calls with the same tables."""
        if cos.shape[1] != 2 * self.head_dim:
            return {False: (cos, sin), True: (cos, sin)}
        if self._tables is None or self._tables[0] is not cos:
            hd = self.head_dim
            halves = {False: (cos[:, :hd].contiguous(), sin[:, :hd].contiguous()),
                      True: (cos[:, hd:].contiguous(), sin[:, hd:].contiguous())}  # fmt: skip
            self._tables = (cos, halves)
        return self._tables[1]

    def _pass_args(self, attn: PassAttention) -> tuple[object, ...]:
        return (
            attn.slot_mapping, attn.row_idx, attn.row_slots, attn.row_lens,
            attn.span_starts, attn.span_slots, attn.span_positions,
            self.num_heads, self.num_kv_heads, self.intermediate, self.scale,
        )  # fmt: skip
