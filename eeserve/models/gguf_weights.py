"""A GGUF file's projection and embedding tensors, kept in their block formats.

Contract: ``read_block_weights(path, cfg)`` reads every decoder layer's projections, the token
embedding and the LM head of a Llama-family or Gemma 3 GGUF file as ``BlockWeight``s (the
tensor's raw bytes, one row per output channel: uint8 [N, row_bytes]), named by this package's
modules (``layers.{i}.q`` / ``k`` / ``v`` / ``o`` / ``gate`` / ``up`` / ``down``, ``embed``,
``lm_head``; no ``lm_head`` when the model ties it to the embedding). No tensor is de-quantized:
the kernels (``kernels.gguf_linear``) decode the blocks as they multiply. The rows are those of
the HF-format weights that the loader's conversion writes (transformers de-quantizes the same
file): Llama's q and k rows are put back in HF's order (the GGUF writer permutes them for
llama.cpp's rotary), so a block row is exactly a de-quantized row of the converted model.

A tensor stored in a type other than ``SUPPORTED`` raises ``UnsupportedBlockType`` naming the
tensor and its type. ``from_hf(name)`` says whether the loader takes an HF weight from the
converted folder (norms) or leaves it to these blocks (projections, embedding, head).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from eeserve.models.config import GEMMA3, ModelConfig


class GGMLType(IntEnum):
    """The block formats the kernels decode, by their ggml type id."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14


SUPPORTED = tuple(t.name for t in GGMLType)
# The HF weights these blocks stand in for (the converted folder's copies are not loaded).
_FROM_BLOCKS = (
    ".q_proj.",
    ".k_proj.",
    ".v_proj.",
    ".o_proj.",
    ".gate_proj.",
    ".up_proj.",
    ".down_proj.",
    "embed_tokens.",
    "lm_head.",
)
# GGUF tensor name (per layer) -> this package's name.
_LAYER_TENSORS = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}


class UnsupportedBlockType(ValueError):
    """A GGUF tensor in a block format the kernels do not decode."""


@dataclass(frozen=True, kw_only=True)
class BlockWeight:
    """A weight [out_features, in_features] as GGUF blocks: ``blocks`` uint8 [out_features,
    row_bytes], each row ``in_features`` weights in blocks of ``ggml_type``."""

    ggml_type: GGMLType
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])


def from_hf(name: str) -> bool:
    """Whether the HF weight ``name`` is loaded from the converted folder (else from blocks)."""
    return not any(part in name for part in _FROM_BLOCKS)


def read_block_weights(path: Path, cfg: ModelConfig) -> dict[str, BlockWeight]:
    """The GGUF file's projections, embedding and head (see the module's contract)."""
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    wanted = {"token_embd.weight": "embed", "output.weight": "lm_head"}
    for i in range(cfg.num_layers):
        for gguf_name, ours in _LAYER_TENSORS.items():
            wanted[f"blk.{i}.{gguf_name}.weight"] = f"layers.{i}.{ours}"
    out: dict[str, BlockWeight] = {}
    for gguf_name, ours in wanted.items():
        if gguf_name not in tensors:
            if ours == "lm_head":
                continue  # tied to the embedding
            raise ValueError(f"{path.name}: tensor {gguf_name} is missing")
        t = tensors[gguf_name]
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED:
            raise UnsupportedBlockType(
                f"{path.name}: tensor {gguf_name} is stored as {type_name}; native weights "
                f"decode {', '.join(SUPPORTED)} (use --weights float32 for this file)"
            )
        rows = np.asarray(t.data).reshape(int(t.shape[-1]), -1)  # [out_features, row_bytes]
        blocks = torch.from_numpy(rows.copy())
        if cfg.architecture != GEMMA3 and ours.endswith((".q", ".k")):
            heads = cfg.num_heads if ours.endswith(".q") else cfg.num_kv_heads
            blocks = blocks[hf_row_order(blocks.shape[0], heads)].contiguous()
        out[ours] = BlockWeight(
            ggml_type=GGMLType[type_name], blocks=blocks, in_features=int(t.shape[0])
        )
    return out


def hf_row_order(rows: int, heads: int) -> torch.Tensor:
    """[rows] int64: row r of the HF weight is row order[r] of the GGUF one. Per head, the GGUF
    writer interleaves the two rotary halves for llama.cpp; transformers' reader undoes it: HF
    row (head, half s, pair j) is GGUF row (head, pair j, half s)."""
    dim = rows // heads
    idx = torch.arange(rows).view(heads, dim // 2, 2)  # GGUF rows, as (head, pair, half)
    return idx.transpose(1, 2).reshape(rows)
