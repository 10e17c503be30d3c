"""The batch-1 decode roofline: this machine's memory bandwidth over the bytes read per token.

Contract: ``read_bandwidth(threads)`` measures a streaming read (``torch.sum`` over a float32
buffer of ``max(1 GiB, 4 × L3)``, so the caches hold a small part of it) with ``threads``
PyTorch threads, best of ``repeats``, in bytes/s. ``engine_bytes_per_token(folder, scheme)`` is
what this engine reads per decode step at batch 1 for ``scheme`` ``"float32"`` or ``"int8"``:
every decoder projection (Q, K, V, O, gate, up, down) and the LM head, at 4 bytes a weight in
float32 and 1 + 4/32 bytes in int8 (an int8 weight plus one float32 scale per 32,
``kernels.quant``); norms are counted in float32. ``screened_head=True`` counts a float32
engine's greedy steps, whose LM head is read through its int8 screen (``kernels.screened_head``):
the int8 head plus one float32 scale per id. ``gguf_bytes_per_token(path)`` is the same for
llama.cpp: every tensor of the file at its stored size, the embedding table counted once as the
LM head when the model is tied (``output.weight`` absent) and not at all otherwise. Both leave
out the one embedding row a token reads and the KV cache (at batch 1 and a short context, a few
hundred kB, well under 1% of the weights); ``engine_bytes_split`` gives its two parts, the decoder
layers (with their norms) and the LM head. ``fraction_of_roofline(tok_s, bandwidth, bytes)`` is
``tok_s / (bandwidth / bytes)``: 1.0 means the weights stream at the measured bandwidth.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import torch

INT8_BYTES_PER_WEIGHT = 1 + 4 / 32  # int8 weight + a float32 scale per group of 32
_L3_SIZE = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")


def _l3_bytes() -> int:
    try:
        text = _L3_SIZE.read_text().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def read_bandwidth(threads: int, repeats: int = 5, size_bytes: int | None = None) -> float:
    """Bytes/s of a streaming read of a buffer larger than the caches, best of ``repeats``."""
    size = size_bytes or max(1 << 30, 4 * _l3_bytes())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size // 4, dtype=torch.float32)  # written once: pages are real
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return buf.numel() * 4 / best


def weights_per_token(config: dict) -> tuple[int, int]:
    """(projection + LM head weights, norm weights) one decode step reads, from ``config.json``."""
    matrices, head, norms = _weights(config)
    return matrices + head, norms


def _weights(config: dict) -> tuple[int, int, int]:
    """(projection weights, LM head weights, norm weights) of ``config.json``."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # Q and O, K and V
    mlp = 3 * hidden * inter  # gate, up, down
    norms = layers * 2 * hidden + hidden
    return layers * (attn + mlp), vocab * hidden, norms


def engine_bytes_per_token(folder: Path, scheme: str, screened_head: bool = False) -> int:
    return sum(engine_bytes_split(folder, scheme, screened_head))


def engine_bytes_split(folder: Path, scheme: str, screened_head: bool = False) -> tuple[int, int]:
    """(decoder layers with their norms, LM head): ``engine_bytes_per_token``'s two parts."""
    if scheme not in ("float32", "int8"):
        raise ValueError(f"scheme must be float32 or int8, got {scheme!r}")
    config = json.loads((folder / "config.json").read_text())
    matrices, head, norms = _weights(config)
    per_weight = 4.0 if scheme == "float32" else INT8_BYTES_PER_WEIGHT
    # The screened head reads its int8 copy and one float32 scale per id for the bound (a few
    # float tiles besides: under 0.1% here).
    head_bytes = (
        head * INT8_BYTES_PER_WEIGHT + 4 * config["vocab_size"]
        if screened_head
        else head * per_weight
    )
    return round(matrices * per_weight) + 4 * norms, round(head_bytes)


def gguf_bytes_per_token(path: Path) -> int:
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)  # untied: only one row of the table is read
    return sum(sizes.values())


def fraction_of_roofline(tok_s: float, bandwidth: float, bytes_per_token: int) -> float:
    return tok_s * bytes_per_token / bandwidth
