"""Engine configuration: one dataclass, validated, with the derived device and dtype.

Contract: ``EngineConfig`` holds every engine-level option (model, dtype, device, KV budget,
batching limits, prefix caching, early-exit policy and KV-debt strategy, CPU kernels, weight-only
quantisation, what drafts in speculative mode). Invalid
values raise ``ValueError`` naming the field. ``resolved_device``/``resolved_dtype`` turn "auto"
into real values: float32 on CPU, bfloat16 on CUDA. ``eeserve_home()`` is where the engine keeps
what it makes once per machine (converted models, built kernels): ``$EESERVE_HOME``, default
``~/.cache/eeserve``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eeserve.exit_params import DRAFT_SOURCES

EXIT_POLICIES = ("per_sequence", "batch_all", "none")
KV_FILL_STRATEGIES = ("fill", "recompute")
QUANTIZATIONS = ("int8",)
SPECULATIVE_DRAFTS = ("auto", *DRAFT_SOURCES)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Positions per forward pass unless set: on two CPU cores a pass of 8 decode rows and a prompt
# chunk within this budget keeps the streams' p99 gap within ~4x of a decode step
# (docs/benchmarks.md, "Session 9"; 128 until decode steps got faster).
DEFAULT_BATCHED_TOKENS = 112
# Unset, the budget leaves prompts at least this many positions beside max_num_seqs decode rows.
MIN_PROMPT_ROOM = 48


@dataclass
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # Bytes (int > 1) or a fraction of free memory (float in (0, 1]); device memory on CUDA.
    kv_cache_memory: float = 512 * 2**20
    max_num_seqs: int = 64
    # Positions one forward pass computes at most. With chunked prefill, decode rows go first and
    # prompts fill the rest in chunks; without it, a whole prompt always fits in one pass. None:
    # DEFAULT_BATCHED_TOKENS, or max_num_seqs + MIN_PROMPT_ROOM where more may decode at once.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # A prompt chunk's position p counts 1 + p / attention_context against the budget (its
    # attention over p earlier positions): None derives it from the model's shape and the device
    # (``CostModel.attention_context``); 0 counts every position as one.
    attention_context: float | None = None
    exit_policy: str = "per_sequence"
    kv_fill: str = "fill"
    # The engine's fused CPU kernels (eeserve/csrc, built once per machine); off: PyTorch ops only.
    cpu_kernels: bool = True
    # Weight-only quantisation of the projections and LM head at load (None: the dtype's weights).
    quantization: str | None = None
    # What drafts for requests in ``speculative`` mode: "exits" (the exit heads, at the exit
    # rules' layers) or "int8" (an int8 copy of the model's own weights, at full depth; loaded
    # beside the float weights); "auto": the exit config's ``default_draft`` ("exits" when the
    # model is quantised or exits are off).
    speculative_draft: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if self.enable_chunked_prefill and self.batched_tokens() <= self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.batched_tokens()}) must exceed max_num_seqs "
                f"({self.max_num_seqs}) with chunked prefill: decode rows come first and prompt "
                "chunks would get no room"
            )
        if self.attention_context is not None and not self.attention_context >= 0:
            raise ValueError(
                f"attention_context must be None or >= 0, got {self.attention_context!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory!r}")
        if self.exit_policy not in EXIT_POLICIES:
            raise ValueError(
                f"exit_policy must be one of {EXIT_POLICIES}, got {self.exit_policy!r}"
            )
        if self.kv_fill not in KV_FILL_STRATEGIES:
            raise ValueError(f"kv_fill must be one of {KV_FILL_STRATEGIES}, got {self.kv_fill!r}")
        if self.speculative_draft not in SPECULATIVE_DRAFTS:
            raise ValueError(
                f"speculative_draft must be one of {SPECULATIVE_DRAFTS}, "
                f"got {self.speculative_draft!r}"
            )
        if self.speculative_draft == "int8" and self.quantization is not None:
            raise ValueError(
                "speculative_draft='int8' drafts with an int8 copy of float weights; the model "
                f"itself is already quantised (quantization={self.quantization!r})"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )

    def batched_tokens(self) -> int:
        """``max_num_batched_tokens``, or its default for ``max_num_seqs``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_BATCHED_TOKENS, self.max_num_seqs + MIN_PROMPT_ROOM)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def kv_cache_bytes(self) -> int:
        """The KV budget in bytes (a fraction is taken of currently free memory)."""
        if self.kv_cache_memory > 1:
            return int(self.kv_cache_memory)
        device = self.resolved_device()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = _mem_available()
        return int(free * self.kv_cache_memory)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def eeserve_home() -> Path:
    return Path(os.environ.get("EESERVE_HOME", Path.home() / ".cache" / "eeserve"))
