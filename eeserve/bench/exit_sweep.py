"""Early-exit section of ``eeserve bench``: speed next to quality, and engine efficiency.

Contract: in one process, for each exit policy and KV-debt strategy and a sweep of thresholds,
decode tokens/s and mean inter-token latency at each batch size are measured next to full depth
on the same prompts, with token agreement and ROUGE-L of the early-exit text against the
full-depth text and the mean exit layer. The efficiency check exits every decode token at one
layer (threshold 0) and compares the measured speed-up with the ideal one from a cost model
(FLOPs at large batch, weight bytes read at batch 1).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Any

from eeserve.bench.measure import Run, median_run, quality_vs, run_engine
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.cost import CostModel


def bench_exits(args: argparse.Namespace, prompts: list[list[int]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    for policy in args.policies.split(","):
        for kv_fill in args.kv_fills.split(","):
            engine = LLMEngine(
                EngineConfig(
                    model=args.model,
                    dtype=args.exit_dtype,
                    exit_policy=policy,
                    kv_fill=kv_fill,
                    enable_prefix_caching=False,
                    max_num_seqs=max(batch_sizes),
                    quantization=args.quantization,
                )
            )
            run_engine(engine, prompts[:2], 4, ExitParams(enabled=False))  # warm-up
            for b in batch_sizes:
                rows += _sweep(engine, args, prompts[:b], policy, kv_fill, thresholds)
    return rows


def _paired(run: Any, params: ExitParams, repeats: int) -> tuple[Run, float]:
    """Median early-exit run and the median of per-repeat ratios to a full-depth run made right
    before it: pairs share the machine's load at that moment, so drifting load cancels."""
    runs: list[Run] = []
    ratios: list[float] = []
    for _ in range(repeats):
        full = run(ExitParams(enabled=False))
        runs.append(run(params))
        ratios.append(runs[-1].decode_tokens_per_s / full.decode_tokens_per_s)
    runs.sort(key=lambda r: r.decode_tokens_per_s)
    return runs[len(runs) // 2], statistics.median(ratios)


def _sweep(
    engine: LLMEngine,
    args: argparse.Namespace,
    prompts: list[list[int]],
    policy: str,
    kv_fill: str,
    thresholds: list[float],
) -> list[dict[str, Any]]:
    measure = args.measure or engine.exit_config.default_measure
    run = partial(run_engine, engine, prompts, args.max_tokens)
    full = median_run(partial(run, ExitParams(enabled=False)), args.repeats)
    rows: list[dict[str, Any]] = []
    cfg = engine.model_config
    cost = CostModel.of(cfg)
    settings: list[tuple[str, ExitParams]] = [
        (f"{t:g}", ExitParams(threshold=t, measure=measure)) for t in thresholds
    ]
    # A tuned sidecar has heads only at its exit layers: default to the first of them.
    eff_layer = args.efficiency_layer or engine.exit_config.exit_layers[0]
    settings.append(
        (
            f"0@{eff_layer}",
            ExitParams(threshold=0.0, measure="softmax_margin", exit_layers=[eff_layer]),
        )
    )
    for label, params in settings:
        r, ratio = _paired(run, params, args.repeats)
        agree, rouge = quality_vs(full, r, engine.tokenizer)
        row = {
            "policy": policy,
            "kv_fill": kv_fill,
            "batch": len(prompts),
            "threshold": label,
            "measure": params.measure,
            "decode_tok_s": r.decode_tokens_per_s,
            "full_decode_tok_s": full.decode_tokens_per_s,
            "ratio": ratio,
            "itl_ms": r.mean_itl_ms,
            "full_itl_ms": full.mean_itl_ms,
            "mean_exit_layer": r.mean_exit_layer,
            "token_agreement": agree,
            "rouge_l": rouge,
        }
        if label.startswith("0@") and kv_fill == "fill":
            ideal = cost.ideal_ratio(cfg.num_layers, round(r.mean_exit_layer))
            row.update(ideal_ratio=ideal, efficiency=ratio / ideal)
        rows.append(row)
        _print_row(row)
    return rows


def _print_row(row: dict[str, Any]) -> None:
    eff = (
        f"  ideal {row['ideal_ratio']:.2f}x  measured/ideal {row['efficiency']:.0%}"
        if "efficiency" in row
        else ""
    )
    print(
        f"{row['policy']:12s} {row['kv_fill']:9s} batch {row['batch']:3d} "
        f"thr {row['threshold']:>6s}: {row['decode_tok_s']:7.1f} tok/s "
        f"({row['ratio']:.2f}x full {row['full_decode_tok_s']:.1f})"
        f"  ITL {row['itl_ms']:6.1f} ms (full {row['full_itl_ms']:.1f})"
        f"  exit {row['mean_exit_layer']:5.2f}"
        f"  agree {row['token_agreement']:.3f}  ROUGE-L {row['rouge_l']:.3f}{eff}",
        flush=True,
    )
