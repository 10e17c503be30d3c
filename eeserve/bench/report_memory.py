"""Memory sizing of ``eeserve bench report``: the KV pool a batch needs, which batch sizes fit.

Contract: ``kv_bytes(model_config, prompts, max_tokens, itemsize)`` is the KV pool, in bytes,
that holds every one of ``prompts`` with ``max_tokens`` generated tokens at once (whole 16-token
blocks), with 10% and one block to spare. ``fit_batch_sizes`` splits the configured batch sizes
into those that fit in 80% of the device's free memory (CUDA: what the driver reports free; CPU:
``MemAvailable``) and those that do not, counting each engine as twice the model's weights in
the run's dtype plus its KV pool and the HF model, when it runs, as the weights once; the
smallest batch size is always kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eeserve.bench.report_config import ReportConfig
from eeserve.models.loader import read_config


def kv_bytes(engine_cfg: Any, prompts: list[list[int]], max_tokens: int, itemsize: int) -> int:
    """KV pool bytes for all ``prompts`` at once, whole blocks, with 10% to spare."""
    per_token = 2 * engine_cfg.num_layers * engine_cfg.num_kv_heads * engine_cfg.head_dim * itemsize
    tokens = sum(-(-(len(p) + max_tokens) // 16) * 16 for p in prompts)
    return int(1.1 * tokens * per_token) + 16 * per_token


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def fit_batch_sizes(
    cfg: ReportConfig,
    folder: Path,
    prompts: list[list[int]],
    device: torch.device,
    itemsize: int,
    engines: int,
) -> tuple[list[int], list[int]]:
    """(batch sizes whose ``engines`` + HF model fit in 80% of free memory, those that do not)."""
    mcfg = read_config(folder)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors")) * itemsize // 4
    free = 0.8 * _available_memory(device)
    fit: list[int] = []
    skipped: list[int] = []
    for b in sorted(cfg.batch_sizes):
        need = engines * (2 * weights + kv_bytes(mcfg, prompts[:b], cfg.max_tokens, itemsize))
        (fit if need + weights * cfg.hf <= free or not fit else skipped).append(b)
    return fit, skipped
