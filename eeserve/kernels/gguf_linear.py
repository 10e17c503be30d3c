"""Projections, LM head and embedding computed on weights kept in their GGUF block formats.

Contract: ``GGUFLinear(parts, ops)`` is x [n, K] float32 -> [n, N] = x W^T, where W is the
``BlockWeight``s ``parts`` stacked along the output (a fused qkv or gate/up projection may mix
formats: Q4_K_M files keep some rows in Q6_K), each de-quantized inside the kernel
(``csrc/gguf_ops.cpp``) exactly as ``gguf.quants.dequantize`` does, with float32 activations and
sums: F.linear on the de-quantized weights up to summation order, in one kernel call over all
the parts (``gguf_stacked_linear``: one flat block buffer and its parts table, the form the fused
layers take too). ``weight[ids]`` gives rows of the de-quantized weight (what the engine's exit
checks and draft heads read of an LM head).
``GGUFEmbedding`` looks token ids up in block rows, de-quantized bit for bit.
``use_gguf_weights(model, blocks, ops)`` puts them in place of a model's projections, embedding
and head; it runs on the model while it is still on the meta device (``models.loader``), so no
float32 copy of those weights is ever made. The kernels are required: without them native
weights are refused, not run slowly.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch
from torch import nn

from eeserve.kernels.native import NativeOps
from eeserve.models.gguf_weights import BlockWeight
from eeserve.models.llama import LlamaForCausalLM


class BlockRows:
    """Rows of a block weight, de-quantized on demand: ``rows[ids]`` -> [len(ids), K]."""

    def __init__(self, parts: Sequence[BlockWeight], ops: NativeOps) -> None:
        self.parts, self.ops = list(parts), ops
        self.shape = (sum(p.out_features for p in parts), parts[0].in_features)

    def __getitem__(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        out = torch.empty(ids.numel(), self.shape[1])
        lo = 0
        for p in self.parts:
            hi = lo + p.out_features
            mine = (ids >= lo) & (ids < hi)
            if bool(mine.any()):
                rows = p.blocks[ids[mine] - lo].contiguous()
                out[mine] = self.ops.gguf_dequantize(rows, int(p.ggml_type), p.in_features)
            lo = hi
        return out


def joined(parts: Sequence[BlockWeight]) -> torch.Tensor:
    """The parts' bytes as one flat uint8 tensor: a view where they already lie end to end in one
    storage (a tail of another projection's parts), else one copy."""
    first = parts[0].blocks
    total = sum(p.blocks.numel() for p in parts)
    at = first.data_ptr()
    for p in parts:
        same = p.blocks.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same and p.blocks.is_contiguous() and p.blocks.data_ptr() == at):
            return torch.cat([q.blocks.reshape(-1) for q in parts])
        at += p.blocks.numel()
    storage = first.untyped_storage()
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,), (1,))


class GGUFLinear(nn.Module):
    """x [n, K] float32 -> [n, N]; ``parts`` stacked along the output (N = their rows).

    Its bytes live in one flat buffer ``blocks`` described by ``table`` (int64 [P, 2]: ggml type,
    rows per run of one format): the form every kernel takes (``gguf_stacked_linear``, and the
    fused layers' projections, ``kernels.stack_layout.projection``). ``parts`` are views of it."""

    def __init__(self, parts: Sequence[BlockWeight], ops: NativeOps) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("GGUFLinear: parts of different input widths")
        # Plain attributes, not buffers: to_empty() at load must not replace the blocks.
        self.blocks, self.ops = joined(parts), ops
        self.in_features = parts[0].in_features
        self.parts = self._runs(parts)
        self.table = torch.tensor([[int(p.ggml_type), p.out_features] for p in self.parts])
        self.out_features = sum(p.out_features for p in parts)
        self.weight = BlockRows(self.parts, ops)
        self.bias: torch.Tensor | None = None

    def _runs(self, parts: Sequence[BlockWeight]) -> list[BlockWeight]:
        """Views of ``blocks``, one per run of neighbouring parts of one format."""
        out: list[BlockWeight] = []
        at = 0
        for kind, group in groupby(parts, key=lambda p: p.ggml_type):
            run = list(group)
            size = sum(p.blocks.numel() for p in run)
            rows = sum(p.out_features for p in run)
            view = self.blocks[at : at + size].view(rows, -1)
            out.append(BlockWeight(ggml_type=kind, blocks=view, in_features=self.in_features))
            at += size
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        out = x2.new_empty(x2.shape[0], self.out_features)
        self.ops.gguf_stacked_linear(x2, self.blocks, self.table, out)
        return out.view(*x.shape[:-1], self.out_features)

    def rows_from(self, start: int) -> list[BlockWeight]:
        """Its parts from output row ``start`` on, as views of the same blocks (no copy)."""
        out, lo = [], 0
        for p in self.parts:
            if lo + p.out_features > start:
                view = p.blocks[max(0, start - lo) :]
                out.append(
                    BlockWeight(ggml_type=p.ggml_type, blocks=view, in_features=p.in_features)
                )
            lo += p.out_features
        return out

    def nbytes(self) -> int:
        """Bytes of the blocks (what a pass reads)."""
        return int(self.blocks.numel())


class GGUFEmbedding(nn.Module):
    """ids [n] -> [n, K]: the block rows of those tokens, de-quantized."""

    def __init__(self, weight: BlockWeight, ops: NativeOps) -> None:
        super().__init__()
        self.rows = BlockRows([weight], ops)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids].view(*ids.shape, self.rows.shape[1])


def use_gguf_weights(
    model: LlamaForCausalLM, blocks: dict[str, BlockWeight], ops: NativeOps
) -> None:
    """The model's projections, embedding and head on ``blocks`` (``read_block_weights``'s
    names); each attention also gets a K/V-only projection (the KV-debt ``fill``)."""
    for i, layer in enumerate(model.layers):
        b = {name: blocks[f"layers.{i}.{name}"] for name in ("q", "k", "v", "o", "gate", "up")}
        attn, mlp = layer.self_attn, layer.mlp
        qkv = GGUFLinear([b["q"], b["k"], b["v"]], ops)
        attn.qkv_proj = qkv  # type: ignore[assignment]
        attn.kv_proj = GGUFLinear(qkv.rows_from(b["q"].out_features), ops)
        attn.o_proj = GGUFLinear([b["o"]], ops)  # type: ignore[assignment]
        mlp.gate_up_proj = GGUFLinear([b["gate"], b["up"]], ops)  # type: ignore[assignment]
        mlp.down_proj = GGUFLinear([blocks[f"layers.{i}.down"]], ops)  # type: ignore[assignment]
    model.model.embed_tokens = GGUFEmbedding(blocks["embed"], ops)
    head = blocks.get("lm_head", blocks["embed"])  # tied: the embedding's rows
    model.lm_head = GGUFLinear([head], ops)  # type: ignore[assignment]
