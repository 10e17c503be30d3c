"""The ``eeserve tune-exits`` run (command line in ``tuning.cli``).

Contract: ``tune(opts)`` loads or generates the tuning and held-out groups
(``tuning.groups.load_groups``), collects their hidden states (``tuning.data``), trains an exit
head and a classifier probe per exit layer on the frozen model (``tuning.heads.tune_layers``),
evaluates them on the held-out tokens and picks thresholds (``tuning.evaluate``), writes the
sidecar (``save_sidecar``) and the report (``tuning.report``) next to it, and returns the report.
With ``train_base="lora"`` the model is first trained to exit (``tuning.variant``: a base delta
learned from the groups beyond the first ``tokens`` positions, then merged); the same head
pipeline then runs on that variant as a frozen model, and the sidecar (version 2) carries the
delta. The base model's weight files are only read.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eeserve.config import eeserve_home
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import max_exit_layer, save_sidecar
from eeserve.models.loader import load_model, read_config, resolve_model
from eeserve.tuning.data import collect_splits
from eeserve.tuning.evaluate import evaluate
from eeserve.tuning.groups import Group, load_groups
from eeserve.tuning.heads import init_heads, tune_layers
from eeserve.tuning.options import TRAIN_BASE, TuneOptions
from eeserve.tuning.report import write_report
from eeserve.tuning.variant import Variant, make_variant, variant_report


def split_groups(groups: list[Group], tokens: int) -> tuple[list[Group], list[Group]]:
    """The first groups up to ``tokens`` trained positions (heads and probes), and the rest (the
    base delta's; all of them when nothing is left, e.g. a small ``--data`` file)."""
    made = 0
    for i, g in enumerate(groups):
        if made >= tokens:
            return groups[:i], groups[i:]
        made += g.num_trained
    return groups, groups


def _check(opts: TuneOptions) -> tuple[Path, int]:
    folder = resolve_model(opts.model)
    num_layers = read_config(folder).num_layers
    deepest = max_exit_layer(opts.adapter, num_layers)  # a layer head at l is layer l + 1
    bad = [x for x in opts.exit_layers if not 1 <= x <= deepest]
    if bad or not opts.exit_layers:
        raise ValueError(f"exit layers must be in [1, {deepest}], got {opts.exit_layers}")
    if opts.train_base not in TRAIN_BASE:
        raise ValueError(f"train_base must be one of {TRAIN_BASE}, got {opts.train_base!r}")
    if opts.train_base != "none" and opts.adapter == "layer":
        raise ValueError("train_base 'lora' trains linear-headed exits: not with adapter 'layer'")
    return folder, num_layers


def tune(opts: TuneOptions) -> dict[str, Any]:
    """The whole ``tune-exits`` run; returns the report (also written next to the sidecar)."""
    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    start = time.perf_counter()
    folder, num_layers = _check(opts)
    cache = opts.cache_dir or eeserve_home() / "tune" / folder.name
    extra = opts.base_tokens if opts.train_base != "none" else 0
    train_groups, heldout_groups = load_groups(
        opts.model,
        opts.data,
        opts.tokens + extra,
        opts.heldout_tokens,
        opts.seed,
        opts.max_tokens,
        cache,
    )
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    layers = sorted(set(opts.exit_layers))
    variant: Variant | None = None
    t_delta = time.perf_counter()
    if opts.train_base != "none":
        train_groups, delta_groups = split_groups(train_groups, opts.tokens)
        ckpt = cache / f"delta-{opts.delta_key()}"
        variant = make_variant(model, folder, delta_groups, heldout_groups, layers, opts, ckpt)
    delta_s = time.perf_counter() - t_delta
    mid = opts.adapter == "layer"  # layer heads read h_mid of layer l + 1
    train, probe, heldout = collect_splits(
        model, train_groups, heldout_groups, layers, opts.topk, opts.probe_fraction, mid
    )
    cfg = _head_config(opts, num_layers, layers, model.config.intermediate_size)
    heads = init_heads(cfg, model)
    t_train = time.perf_counter()
    stats = tune_layers(model, heads, train, probe, opts, cache / f"heads-{opts.key()}")
    t_eval = time.perf_counter()
    reference = variant.reference if variant is not None else None
    report = evaluate(model, heads, heldout, opts.target_agreement, reference)
    report.update(
        model=opts.model,
        options={k: v for k, v in asdict(opts).items() if k not in ("out", "cache_dir")},
        tokens={"train": train.size, "probe": probe.size, "heldout": heldout.size},
        training=stats,
        seconds={
            "data": t_train - start - delta_s,
            "base_delta": delta_s,
            "train": t_eval - t_train,
            "total": time.perf_counter() - start,
        },
    )
    if variant is not None:
        report["variant"] = variant_report(model, variant, heldout.target, heldout_groups)
        cfg.base_delta = {"base_model_hash": variant.base_model_hash}
    _save(opts.out, cfg, heads, report, variant)
    return report


def _head_config(opts: TuneOptions, num_layers: int, layers: list[int], mlp: int) -> ExitConfig:
    ranks = {"lowrank": opts.rank, "mlp": opts.rank, "layer": mlp}
    return ExitConfig(
        num_layers=num_layers,
        exit_layers=layers,
        head="tuned",
        adapter=opts.adapter,
        adapter_rank=ranks.get(opts.adapter, 0),
        classifier=True,
        default_mode=opts.default_mode,
        default_draft=opts.default_draft,
        draft_vocab=opts.draft_vocab,
    )


def _save(
    out: Path, cfg: ExitConfig, heads: Any, report: dict[str, Any], variant: Variant | None
) -> None:
    cfg.default_measure = report["default_measure"]
    # One threshold per measure: a per-layer list would not fit a request that picks its own
    # exit layers (the report lists the per-layer ones, for ``ExitParams(threshold=[...])``).
    cfg.thresholds = {m: c["threshold"] for m, c in report["chosen"].items()}
    cfg.enabled_by_default = bool(report["enabled_by_default"])
    save_sidecar(out, cfg, heads, variant.delta if variant is not None else None)
    print(write_report(out, report))
