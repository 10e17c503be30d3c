"""The options of ``eeserve tune-exits``: every knob of one tuning run, and its cache keys.

Contract: ``TuneOptions`` is plain data read by the whole tuning command (heads: ``tuning.heads``;
base delta: ``tuning.delta_train``; the run: ``tuning.tune``; command line: ``tuning.cli``).
``key()`` hashes what changes the trained heads and ``delta_key()`` what changes the base delta:
they name the checkpoint folders, so a rerun with the same options resumes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eeserve.tuning.layer_heads import LAYER_LR

DEFAULT_ADAPTER = "linear"


@dataclass
class TuneOptions:
    model: str
    exit_layers: list[int]
    out: Path
    data: list[Path] = field(default_factory=list)
    tokens: int = 30000  # self-generated tuning tokens (heads and probes together)
    heldout_tokens: int = 5000
    steps: int | None = None  # optimizer steps per head; default ``epochs`` passes
    epochs: int = 3
    adapter: str = DEFAULT_ADAPTER
    rank: int = 128  # lowrank / mlp width
    seed: int = 0
    batch_size: int = 128
    lr: float = 3e-2
    layer_lr: float = LAYER_LR  # ``layer`` heads: a pretrained MLP, far smaller steps
    weight_decay: float = 0.1
    probe_fraction: float = 0.15  # of the tuning groups, kept for the probes (unseen by heads)
    topk: int = 32
    negatives: int = 1024
    max_tokens: int = 192  # per generated continuation
    target_agreement: float = 0.95
    threads: int = 1  # 2 on a busy 2-core machine was measured 3-10x slower
    cache_dir: Path | None = None
    # A model trained to exit (``tuning.delta_train``): "lora" trains a low-rank base delta jointly
    # with exit heads, by distillation from the frozen original, before the heads are tuned.
    train_base: str = "none"
    base_tokens: int = 200000  # self-generated tokens the base delta learns from
    lora_rank: int = 16
    lora_alpha: float = 32.0  # the delta is scaled by lora_alpha / lora_rank
    lora_lr: float = 2e-4
    final_weight: float = 8.0  # weight of KL(original final || variant final) in the loss
    joint_head_lr: float = 1e-3  # the delta's auxiliary linear exit heads (raw inputs)
    layer_weights: list[float] | None = None  # per exit layer; default l / L (CALM)
    base_batch_tokens: int = 512  # tokens (prompt and continuation) per delta training step
    checkpoint_every: int = 50  # delta training steps between checkpoints
    eval_every: int = 40  # delta training steps between held-out curve points (0: none)
    device: str = "auto"  # of the delta training: "cuda" when present, else "cpu"
    # Written into the sidecar as they are (what requests get by default; docs/speculative.md).
    default_mode: str = "exit"
    default_draft: str = "exits"
    draft_vocab: int = 0

    def key(self) -> str:
        """Hash of everything that changes the trained heads (names the checkpoint folder)."""
        d = asdict(self)
        d["data"] = [(str(p), p.stat().st_mtime_ns) for p in self.data]
        for k in (
            "out",
            "cache_dir",
            "threads",
            "target_agreement",
            "device",
            "checkpoint_every",
            "eval_every",
            "default_mode",
            "default_draft",
            "draft_vocab",
        ):
            d.pop(k)
        d.pop("lr" if self.adapter == "layer" else "layer_lr")  # unused: old keys stay valid
        if self.train_base == "none":  # heads of the frozen model: old keys stay valid
            for k in BASE_FIELDS:
                d.pop(k)
        return hashlib.sha256(json.dumps(d, default=str).encode()).hexdigest()[:16]

    def delta_key(self) -> str:
        """Hash of everything that changes the trained base delta (its checkpoint folder)."""
        d = asdict(self)
        keep = {"model", "exit_layers", "tokens", "seed", "max_tokens", "topk", "negatives"}
        d = {k: v for k, v in d.items() if k in keep or k in BASE_FIELDS}
        d["data"] = [(str(p), p.stat().st_mtime_ns) for p in self.data]
        return hashlib.sha256(json.dumps(d, default=str).encode()).hexdigest()[:16]


BASE_FIELDS = (
    "train_base",
    "base_tokens",
    "lora_rank",
    "lora_alpha",
    "lora_lr",
    "final_weight",
    "joint_head_lr",
    "layer_weights",
    "base_batch_tokens",
)
TRAIN_BASE = ("none", "lora")
