"""What the fused kernels take, by name: the hand-offs of ``kernels.fused`` to
``csrc/decode_stack.cpp`` and ``csrc/layer_ops.cpp``.

Contract: a decoder layer's tensors travel as a ``LlamaLayerWeights`` or ``Gemma3LayerWeights``,
an exit check's as a ``StackCheck``, the layer type and the check's measure as ``StackArch`` and
``StackMeasure`` codes. Each dataclass's field order is the order of the kernels' flat tensor
lists (decode_stack's ``weights``, a layer after another; decode_stack_checked's
``check_weights``), and its names are the layer ops' argument names. ``check_layout(ops)`` holds
all of it against the tables the kernels export (``stack_layout()``, read from
``csrc/stack_layout.h``, the tables the C++ readers index with) and raises RuntimeError on any
difference; ``FusedDecoder.build`` runs it once per load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import IntEnum
from functools import cached_property

import torch

from eeserve.kernels.gguf_linear import GGUFLinear
from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import NativeRMSNorm, PackedLinear
from eeserve.kernels.quant import Int8Linear


class StackArch(IntEnum):
    """decode_stack's layer types, by their ``arch`` code."""

    llama = 0
    gemma3 = 1


class StackMeasure(IntEnum):
    """The exit measures decode_stack_checked computes between layers, by their ``measure`` code;
    named as the engine names them (``exit_params.MEASURES``)."""

    shortlist_max_prob = 0
    shortlist_margin = 1
    classifier = 2


# Measure name -> its code: ``measure in STACK_MEASURES`` asks whether the kernel computes a
# measure, ``STACK_MEASURES[measure]`` gives its code.
STACK_MEASURES: Mapping[str, StackMeasure] = StackMeasure.__members__


@dataclass(frozen=True, kw_only=True)
class Projection:
    """A projection's packed tensors, as one of the engine's linear kernels reads them."""

    # float32 [blocks, K, 16], int8 [blocks, Kp / 2, 16, 2], or GGUF blocks (flat uint8)
    weight: torch.Tensor
    # int8: its scales; GGUF: its parts table (int64 [P, 2]: ggml type, rows); float32: None
    scale: torch.Tensor | None
    bias: torch.Tensor | None


@dataclass(frozen=True, kw_only=True)
class LlamaLayerWeights:
    """A Llama layer's tensors: ``decoder_layer``'s arguments of these names, and in this order
    one layer of decode_stack's ``weights``. A projection's ``_s`` is its ``Projection.scale``
    (None when it is float32); only QKV has a bias."""

    norm1: torch.Tensor  # the attention's input norm [D]
    norm2: torch.Tensor  # the MLP's input norm [D]
    qkv_w: torch.Tensor
    qkv_s: torch.Tensor | None
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_s: torch.Tensor | None
    gate_up_w: torch.Tensor
    gate_up_s: torch.Tensor | None
    down_w: torch.Tensor
    down_s: torch.Tensor | None


@dataclass(frozen=True, kw_only=True)
class Gemma3LayerWeights:
    """A Gemma 3 layer's tensors: ``gemma3_layer``'s arguments of these names, and in this order
    one layer of decode_stack's ``weights``. No bias."""

    in_norm: torch.Tensor  # [D] the attention's input norm
    attn_out_norm: torch.Tensor  # [D] its output's
    mlp_in_norm: torch.Tensor  # [D]
    mlp_out_norm: torch.Tensor  # [D]
    q_norm: torch.Tensor  # [head_dim] per query head
    k_norm: torch.Tensor  # [head_dim] per key head
    qkv_w: torch.Tensor
    qkv_s: torch.Tensor | None
    o_w: torch.Tensor
    o_s: torch.Tensor | None
    gate_up_w: torch.Tensor
    gate_up_s: torch.Tensor | None
    down_w: torch.Tensor
    down_s: torch.Tensor | None


LayerWeights = LlamaLayerWeights | Gemma3LayerWeights
LAYER_WEIGHTS: dict[StackArch, type[LayerWeights]] = {
    StackArch.llama: LlamaLayerWeights,
    StackArch.gemma3: Gemma3LayerWeights,
}


def named_tensors(weights: LayerWeights) -> dict[str, torch.Tensor | None]:
    """A layer's tensors by name, in the kernels' order (shallow: the tensors themselves)."""
    return {f.name: getattr(weights, f.name) for f in fields(weights)}


@dataclass(frozen=True, kw_only=True)
class StackCheck:
    """One exit layer's check in decode_stack_checked's terms. Its tensor fields (every field
    but ``eps``), in this order, are a check's tensors in the kernel's ``check_weights``. A
    shortlist check: the tuned head's adapter (``pre_*``: packed weight, scales, bias; None
    without one), the unit norm's weight [D] and ``eps``, the rows' packed weight and scales. A
    classifier check: the probe's weight [D] and bias [1]."""

    pre_w: torch.Tensor | None = None
    pre_s: torch.Tensor | None = None
    pre_b: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    rows_w: torch.Tensor | None = None
    rows_s: torch.Tensor | None = None
    probe_w: torch.Tensor | None = None
    probe_b: torch.Tensor | None = None
    eps: float = 0.0  # the norm's; travels in the kernel's ``check_eps``

    @cached_property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The check's tensors in the kernel's order (made once: checks live as long as the
        exit heads, and a pass hands them over at every call)."""
        return tuple(getattr(self, name) for name in CHECK_TENSORS)

    @classmethod
    def shortlist(
        cls, pre: torch.nn.Module | None, norm: torch.nn.Module, rows: torch.nn.Module
    ) -> StackCheck | None:
        """From a shortlist head's modules; None unless each runs on the engine's kernels."""
        pre_p = None if pre is None else projection(pre)
        rows_p = projection(rows)
        if (pre is not None and pre_p is None) or rows_p is None or rows_p.bias is not None:
            return None
        if not isinstance(norm, NativeRMSNorm):
            return None
        return cls(
            pre_w=None if pre_p is None else pre_p.weight,
            pre_s=None if pre_p is None else pre_p.scale,
            pre_b=None if pre_p is None else pre_p.bias,
            norm=norm.weight.detach(),
            rows_w=rows_p.weight,
            rows_s=rows_p.scale,
            eps=norm.eps,
        )

    @classmethod
    def classifier(cls, weight: torch.Tensor, bias: torch.Tensor) -> StackCheck:
        """A probe: weight [D], bias [1] (float32)."""
        return cls(probe_w=weight.contiguous(), probe_b=bias.contiguous())


CHECK_TENSORS = tuple(f.name for f in fields(StackCheck) if f.name != "eps")


def _by_code(enum: type[IntEnum]) -> list[str]:
    """An enum's member names at their codes' positions ("?" where no member has the code)."""
    by_code = {m.value: m.name for m in enum}
    return [by_code.get(i, "?") for i in range(max(by_code) + 1)]


def check_layout(ops: NativeOps) -> None:
    """Raise RuntimeError where this module's hand-offs and the kernels' differ: the layer and
    check dataclasses' fields and the enums' codes against the tables ``stack_layout()`` exports
    (``csrc/stack_layout.h``), and the layer dataclasses against their ops' argument names."""
    archs, llama, gemma3, check, measures = ops.ops.stack_layout()
    tables = [
        ("layer types (StackArch)", _by_code(StackArch), archs),
        ("a Llama layer's tensors (LlamaLayerWeights)", _names(LlamaLayerWeights), llama),
        ("a Gemma 3 layer's tensors (Gemma3LayerWeights)", _names(Gemma3LayerWeights), gemma3),
        ("a check's tensors (StackCheck)", list(CHECK_TENSORS), check),
        ("measures (StackMeasure)", _by_code(StackMeasure), measures),
    ]
    # The layer ops take the same tensors by these names (``FusedLayer.args``).
    for name, weights in (
        ("decoder_layer", LlamaLayerWeights),
        ("gemma3_layer", Gemma3LayerWeights),
    ):
        args = [a.name for a in getattr(ops.ops, name).default._schema.arguments]
        ours = _names(weights)
        tables.append((f"{weights.__name__} in {name}", ours, [a for a in args if a in ours]))
    for what, ours, theirs in tables:
        if list(ours) != list(theirs):
            raise RuntimeError(
                f"eeserve kernels: kernels/stack_layout.py and the C++ kernels disagree on "
                f"{what}: {list(ours)} here, {list(theirs)} in csrc/stack_layout.h or the op's "
                "schema"
            )


def _names(cls: type[LayerWeights]) -> list[str]:
    return [f.name for f in fields(cls)]


def projection(module: torch.nn.Module) -> Projection | None:
    """A projection's packed tensors when it runs on one of the engine's kernels, else None."""
    if isinstance(module, PackedLinear) and module.ops is not None:
        return Projection(weight=module.packed, scale=None, bias=module.bias)
    if isinstance(module, Int8Linear) and module.ops is not None:
        return Projection(weight=module.qweight, scale=module.scale, bias=module.bias)
    if isinstance(module, GGUFLinear):
        return Projection(weight=module.blocks, scale=module.table, bias=None)
    return None
