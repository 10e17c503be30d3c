"""Engine configuration: one dataclass, validated, with the derived device and dtype.

Contract: ``EngineConfig`` holds every engine-level option (model, dtype, device, KV budget,
batching limits, prefix caching, early-exit policy and KV-debt strategy, CPU kernels, weight-only
quantisation, what drafts in speculative mode), each field with its help text and choices: the
command-line flags are derived from these fields (``engine_args``), nowhere else. Invalid
values raise ``ValueError`` naming the field. ``resolved_device``/``resolved_dtype`` turn "auto"
into real values: float32 on CPU, bfloat16 on CUDA. ``eeserve_home()`` is where the engine keeps
what it makes once per machine (converted models, built kernels): ``$EESERVE_HOME``, default
``~/.cache/eeserve``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from eeserve.exit_params import DRAFT_SOURCES


class ExitPolicy(StrEnum):
    """How the rows of one batch leave early (docs/design.md, "Batch policies"); ``none``: every
    row runs every layer."""

    AUTO = "auto"
    PER_SEQUENCE = "per_sequence"
    BATCH_ALL = "batch_all"
    NONE = "none"


class KVFill(StrEnum):
    """How the K/V that an exited token skipped is paid: at once (``fill``), or recomputed by
    the next pass that runs those layers (``recompute``)."""

    FILL = "fill"
    RECOMPUTE = "recompute"


class Quantization(StrEnum):
    INT8 = "int8"  # weight-only int8 projections and LM head


class Weights(StrEnum):
    """Where the projections, embedding and LM head come from: the converted float32 folder, or
    the model's GGUF file, kept in its block formats and de-quantized inside the kernels."""

    FLOAT32 = "float32"
    NATIVE = "native"


# Their values, as command-line choices and in error messages.
EXIT_POLICIES = tuple(p.value for p in ExitPolicy)
# The policies that let rows leave (every one but ``none``).
BATCH_POLICIES = tuple(p.value for p in ExitPolicy if p is not ExitPolicy.NONE)
KV_FILL_STRATEGIES = tuple(f.value for f in KVFill)
QUANTIZATIONS = tuple(q.value for q in Quantization)
WEIGHT_SOURCES = tuple(w.value for w in Weights)
SPECULATIVE_DRAFTS = ("auto", *DRAFT_SOURCES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Positions per forward pass unless set: on two CPU cores a pass of 8 decode rows and a prompt
# chunk within this budget keeps the streams' p99 gap within ~4x of a decode step
# (docs/benchmarks.md, "Chunked prefill").
DEFAULT_BATCHED_TOKENS = 112
# Unset, the budget leaves prompts at least this many positions beside max_num_seqs decode rows.
MIN_PROMPT_ROOM = 48


def _option(
    default: Any, help: str, choices: tuple[str, ...] = (), aliases: tuple[str, ...] = ()
) -> Any:
    """A config field with what its command-line flag needs (``engine_args`` derives the flag:
    ``--field-name``, plus ``aliases``; booleans get ``--no-...`` too)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass
class EngineConfig:
    """Every engine option, declared once: the flags of ``generate``/``serve``/``batch``/
    ``calibrate`` and ``LLM(**options)`` are these fields."""

    model: str = _option("smollm2", "smollm2, smollm2-ee, an HF folder or a .gguf file")
    dtype: str = _option(
        "auto",
        "activations and weights (auto: float32 on CPU, bfloat16 on CUDA)",
        ("auto", *DTYPES),
    )
    device: str = _option("auto", "auto, cpu, cuda, cuda:N")
    block_size: int = _option(16, "positions per KV block")
    kv_cache_memory: float = _option(
        512 * 2**20,
        "KV pool: bytes (> 1), or a fraction (0, 1] of free memory (device memory on CUDA)",
    )
    max_num_seqs: int = _option(64, "sequences one forward pass holds at most")
    max_num_batched_tokens: int | None = _option(
        None,
        "positions one forward pass computes at most; with chunked prefill, decode rows go first "
        "and prompts fill the rest in chunks, without it a whole prompt always fits in one pass "
        f"(default {DEFAULT_BATCHED_TOKENS}, or --max-num-seqs + {MIN_PROMPT_ROOM} when that is "
        "more)",
    )
    max_model_len: int | None = _option(
        None, "longest prompt + output (default: the model's context, capped by the KV pool)"
    )
    enable_prefix_caching: bool = _option(
        True, "reuse the KV blocks of shared prompt prefixes", aliases=("--prefix-caching",)
    )
    enable_chunked_prefill: bool = _option(
        True, "mix decode rows and prompt chunks in one pass (no decode stalls on long prompts)"
    )
    attention_context: float | None = _option(
        None,
        "a prompt chunk's position p counts 1 + p / this against the budget (its attention over "
        "p earlier positions); default: from the model's shape and the device; 0: one per "
        "position",
    )
    exit_policy: str = _option(
        "auto",
        "how rows of one batch leave early: auto decides layer by layer from a measured layer "
        "cost (docs/early-exit.md)",
        EXIT_POLICIES,
    )
    kv_fill: str = _option(
        "fill",
        "how the K/V that exited tokens skipped is paid (docs/early-exit.md)",
        KV_FILL_STRATEGIES,
    )
    cpu_kernels: bool = _option(
        True, "the engine's own CPU kernels (built once per machine); off: PyTorch ops only"
    )
    screen_head: bool = _option(
        True,
        "greedy steps without logprobs take their tokens from an int8 screen of the float LM head "
        "and the float rows that can still be the maximum (the same tokens as the whole head; CPU "
        "kernels, float32)",
    )
    jump_forward: bool = _option(
        True,
        "constrained requests: tokens the grammar forces (the only one it allows) are appended "
        "without a pass of their own, and their positions computed together in the next pass "
        "(the same tokens as without it)",
    )
    quantization: str | None = _option(
        None,
        "weight-only int8 projections and LM head at load (activations stay in --dtype)",
        QUANTIZATIONS,
    )
    weights: str = _option(
        "float32",
        "float32: projections from the converted float32 folder; native: kept in the model's "
        "GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) and de-quantized inside "
        "the CPU kernels, the same float weights from ~1/5 of the bytes (float32; "
        "docs/cpu-performance.md)",
        WEIGHT_SOURCES,
    )
    speculative_draft: str = _option(
        "auto",
        "what drafts for speculative-mode requests: the exit heads (at the exit rules' layers), "
        "or an int8 copy of the model's weights (full depth; loaded beside the float weights); "
        "auto: the model's default (its exit config's default_draft; exits when the model is "
        "quantised or exits are off)",
        SPECULATIVE_DRAFTS,
    )

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
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
        self.exit_policy = ExitPolicy(self.exit_policy)
        if self.kv_fill not in KV_FILL_STRATEGIES:
            raise ValueError(f"kv_fill must be one of {KV_FILL_STRATEGIES}, got {self.kv_fill!r}")
        self.kv_fill = KVFill(self.kv_fill)
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
        if self.quantization is not None:
            self.quantization = Quantization(self.quantization)
        self._check_weights()

    def _check_weights(self) -> None:
        if self.weights not in WEIGHT_SOURCES:
            raise ValueError(f"weights must be one of {WEIGHT_SOURCES}, got {self.weights!r}")
        self.weights = Weights(self.weights)
        if self.weights is Weights.NATIVE and (
            self.quantization is not None or self.speculative_draft == "int8"
        ):
            raise ValueError(
                "weights='native' keeps the GGUF's blocks; it takes neither quantization nor "
                "speculative_draft='int8' (an int8 copy of float weights)"
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
        return DTYPES[self.dtype]

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
