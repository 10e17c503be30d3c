"""``eeserve tune-exits``: the command line of exit-head tuning (``tuning.tune``).

Contract: ``add_tune_parser`` registers the subcommand; every ``TuneOptions`` knob in ``_KNOBS``
becomes a flag with the dataclass default, so the command line and the Python API cannot drift.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eeserve.exit_params import DRAFT_SOURCES, MODES
from eeserve.models.exit_heads import ADAPTERS
from eeserve.tuning.options import DEFAULT_ADAPTER, TRAIN_BASE, TuneOptions
from eeserve.tuning.tune import tune

_KNOBS = {  # TuneOptions fields set from the command line, with their help
    "tokens": "self-generated tuning tokens (heads and probes)",
    "heldout_tokens": "self-generated held-out tokens for the report",
    "steps": "optimizer steps per head (default: --epochs passes over the data)",
    "epochs": "passes over the data",
    "rank": "lowrank / mlp width",
    "lr": "peak learning rate (AdamW, warm-up then cosine)",
    "layer_lr": "peak learning rate of --adapter layer heads (a pretrained MLP)",
    "weight_decay": "AdamW weight decay",
    "batch_size": "rows per step",
    "seed": "seed of sampling, shuffling and negatives",
    "max_tokens": "tokens per generated continuation",
    "target_agreement": "agreement among exiting tokens that the thresholds keep",
    "threads": "torch threads",
    "base_tokens": "--train-base: self-generated tokens the base delta learns from",
    "lora_rank": "--train-base lora: rank of the base delta",
    "lora_alpha": "--train-base lora: the delta is scaled by alpha / rank",
    "lora_lr": "--train-base lora: peak learning rate of the base delta (0: base frozen, the "
    "heads-only baseline on the same data)",
    "final_weight": "--train-base: loss weight of KL(original final || variant final)",
    "joint_head_lr": "--train-base: learning rate of the exit heads trained with the delta",
    "base_batch_tokens": "--train-base: tokens per base-delta training step",
    "checkpoint_every": "--train-base: steps between base-delta checkpoints",
    "eval_every": "--train-base: steps between held-out points of the training curve (0: none)",
}


def add_tune_parser(sub: Any) -> None:
    p = sub.add_parser(
        "tune-exits",
        help="train tuned exit heads and classifier probes on a frozen model",
        description="Distil per-layer exit heads (own norm + adapter, or with --adapter layer a "
        "copy of layer l+1's MLP after its shared attention; frozen LM head) from the final "
        "layer, train classifier probes, evaluate on held-out generated text and write the exit "
        "sidecar and a report (tune_report.json/.md) to --out.",
    )
    p.add_argument("model", help="smollm2, an HF folder or a .gguf file")
    p.add_argument("--exit-layers", required=True, help="comma-separated, e.g. 6,10,14,18,22,26")
    p.add_argument("--out", required=True, type=Path, help="folder for the sidecar and report")
    p.add_argument(
        "--data",
        nargs="+",
        type=Path,
        default=[],
        help=".txt/.jsonl training text "
        "(default: the model's own continuations of the offline 'tune' prompts)",
    )
    p.add_argument("--adapter", default=DEFAULT_ADAPTER, choices=ADAPTERS)
    p.add_argument(
        "--train-base",
        default="none",
        choices=TRAIN_BASE,
        help="lora: first train the model itself to exit (a low-rank base delta, distilled from "
        "the frozen original jointly with exit heads), stored in the sidecar (version 2)",
    )
    p.add_argument(
        "--layer-weights",
        default=None,
        help="--train-base: loss weight per exit layer, comma-separated (default l / L)",
    )
    p.add_argument("--device", default="auto", help="--train-base: auto, cpu or cuda")
    p.add_argument(
        "--default-mode",
        default="exit",
        choices=MODES,
        help="the sidecar's default mode for requests that name none",
    )
    p.add_argument(
        "--default-draft",
        default="exits",
        choices=DRAFT_SOURCES,
        help="what drafts in speculative mode by default (the engine's speculative_draft=auto)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="exit drafts over the first N token ids only (0: the whole vocabulary)",
    )
    defaults = TuneOptions("", [], Path())
    for name, text in _KNOBS.items():
        value = getattr(defaults, name)
        kind = float if isinstance(value, float) else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=text)
    p.add_argument("--cache-dir", type=Path, default=None, help="checkpoints (resumable)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    layers = [int(x) for x in str(args.exit_layers).split(",") if x.strip()]
    weights = None
    if args.layer_weights:
        weights = [float(x) for x in str(args.layer_weights).split(",") if x.strip()]
    opts = TuneOptions(
        model=args.model,
        exit_layers=layers,
        out=args.out,
        data=list(args.data),
        adapter=args.adapter,
        cache_dir=args.cache_dir,
        train_base=args.train_base,
        layer_weights=weights,
        device=args.device,
        default_mode=args.default_mode,
        default_draft=args.default_draft,
        draft_vocab=args.draft_vocab,
        **{name: getattr(args, name) for name in _KNOBS},
    )
    tune(opts)
    return 0
