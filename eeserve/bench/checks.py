"""``eeserve bench checks``: what one exit check costs, against one decoder layer.

Contract: for each confidence measure the model's sidecar supports and each batch size, in one
process: the time of one check at an exit layer (the exit head's input to a confidence per row:
``ExitChecks.confidence``, as the exit loop calls it) divided by
the time of one decoder layer on the same rows (``engine.layer_cost.measure_layer_cost``, the
engine's own kernels, attention left out, weights streamed from memory as in a step), beside the
cost model's fraction. A check is timed repeated on its own, so its weights (an adapter and the
shortlist's rows, a few MB) stay in the caches: the measured fraction is a lower bound, the
modelled one (weights read from memory) the bound above (weights read per
check over weights of a layer, ``models.cost.CostModel``). Then, end to end, decode tokens/s of
a run where every exit layer checks but nothing exits (an unreachable threshold) divided by full
depth's, alternated pairs, median ratio. Writes JSON with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eeserve.bench.measure import run_engine
from eeserve.config import EngineConfig
from eeserve.engine.layer_cost import best_time, measure_layer_cost
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import LOGIT_MEASURES, MEASURES, SHORTLIST_MEASURES, ExitParams
from eeserve.models.cost import CostModel
from eeserve.models.llama import Rotary
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts
from eeserve.tuning.provenance import provenance

NEVER = 1.5  # above every measure's range: every check runs, nothing exits


def supported_measures(engine: LLMEngine) -> list[str]:
    cfg = engine.exit_config
    return [
        m
        for m in MEASURES
        if (m != "classifier" or cfg.classifier) and (m not in SHORTLIST_MEASURES or cfg.shortlist)
    ]


def _hidden(engine: LLMEngine, n: int) -> torch.Tensor:
    """[n, D] hidden states to time with (their values do not change the time)."""
    h = torch.randn(n, engine.model_config.hidden_size, generator=torch.Generator().manual_seed(n))
    return h.to(engine.runner.device, engine.runner.dtype)


@torch.inference_mode()
def _check(engine: LLMEngine, measure: str, layer: int, h: torch.Tensor) -> list[float]:
    """One check as the exit loop runs it, to the confidences it reads as Python numbers."""
    conf, _ = engine.runner.exit_loop.checks.confidence(measure, layer, h, h)
    return conf.tolist()  # type: ignore[no-any-return]


def check_fractions(engine: LLMEngine, batch_sizes: list[int]) -> list[dict[str, Any]]:
    """Per measure and batch size: a check's time over a layer's, measured and modelled."""
    runner, cfg = engine.runner, engine.model_config
    layer = engine.exit_config.exit_layers[0]
    heads = runner.exit_loop.checks.heads
    adapter = 0
    if heads is not None and engine.exit_config.head == "tuned":
        params = heads.head(layer).named_parameters()
        adapter = sum(p.numel() for n, p in params if "classifier" not in n)
    cm = CostModel.of(cfg, adapter)
    rows = dict.fromkeys(MEASURES, 0)
    rows.update(dict.fromkeys(LOGIT_MEASURES, cfg.vocab_size))
    rows.update(dict.fromkeys(SHORTLIST_MEASURES, runner.exit_loop.checks.shortlist_rows))

    def rotary(k: int) -> Rotary:
        return Rotary(runner.cos[:k], runner.sin[:k])

    cost = measure_layer_cost(runner.model.layers, partial(_hidden, engine), rotary)
    out = []
    for n in batch_sizes:
        h = _hidden(engine, n)
        layer_s = cost.layer(n)
        for m in supported_measures(engine):
            check_s = best_time(partial(_check, engine, m, layer, h), 30)
            uses_head = m in LOGIT_MEASURES or m in SHORTLIST_MEASURES
            weights = (adapter + rows[m] * cfg.hidden_size) if uses_head else cfg.hidden_size
            out.append(
                {
                    "measure": m,
                    "batch": n,
                    "check_ms": check_s * 1e3,
                    "layer_ms": layer_s * 1e3,
                    "measured_fraction": check_s / layer_s,
                    "model_fraction": weights / cm.layer,
                    "vocab_rows": rows[m],
                }
            )
    return out


def no_exit_ratios(
    engine: LLMEngine, batch_sizes: list[int], max_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    """Every exit layer checks, nothing exits: decode speed against full depth, per measure."""
    out = []
    for n in batch_sizes:
        prompts = fixed_length_ids(engine.tokenizer, prompt_texts(n, 0, "bench"), 32)
        run = partial(run_engine, engine, prompts, max_tokens)
        run(ExitParams(enabled=False))  # warm-up
        for m in supported_measures(engine):
            ratios = []
            for _ in range(repeats):
                full = run(ExitParams(enabled=False))
                checked = run(ExitParams(threshold=NEVER, measure=m))
                assert checked.outputs == full.outputs, "an unreachable threshold changed the text"
                ratios.append(checked.decode_tokens_per_s / full.decode_tokens_per_s)
            out.append({"measure": m, "batch": n, "ratio": statistics.median(ratios)})
    return out


def add_checks_parser(sub: Any) -> None:
    p = sub.add_parser("checks", help="what an exit check costs against a decoder layer")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per no-exit run")
    p.add_argument("--repeats", type=int, default=3, help="alternated pairs per no-exit ratio")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    p.add_argument("--out", default="bench/results/checks/smollm2.json")
    p.set_defaults(func=run_checks)


def run_checks(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    result: dict[str, Any] = {
        "provenance": provenance(),
        "checks": check_fractions(engine, sizes),
        "no_exit": no_exit_ratios(engine, sizes, args.max_tokens, args.repeats),
    }
    for r in result["checks"]:
        print(
            f"{r['measure']:20s} batch {r['batch']:3d}: check {r['check_ms']:.3f} ms = "
            f"{r['measured_fraction']:.1%} of a layer ({r['layer_ms']:.3f} ms); "
            f"cost model {r['model_fraction']:.1%}"
        )
    for r in result["no_exit"]:
        print(
            f"{r['measure']:20s} batch {r['batch']:3d}: every check, no exit: "
            f"{r['ratio']:.3f}x full depth"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
