"""``eeserve bench report``: one reproducible benchmark report of early exit.

Contract: in one process and one run, on the same prompts (``prompt_texts(n, seed, "bench")``,
in the chat template when the tokenizer has one), all greedy with EOS ignored so that every
request makes exactly ``max_tokens``:

1. paper: decode tokens/s and mean inter-token latency of early exit at one operating point
   (measure, threshold) against the same engine at full depth, per batch size, exit policy
   (``batch_all``, ``per_sequence``) and KV-debt strategy (``fill``, ``recompute``), each with its
   quality (token agreement, ROUGE-L) against the full-depth text;
2. frontier: per confidence measure, a sweep of thresholds plus the model's default and
   calibrated ones, at one batch size with the first policy and strategy: speed ratio against
   full depth next to token agreement and ROUGE-L;
3. baseline: HF transformers ``generate`` (``bench.measure.run_hf``) on the same weights, dtype
   and prompts;
4. telemetry of every early-exit run: histogram of exit layers over all generated tokens (the
   first token of a request comes from the prefill, at full depth) and mean layers per token;
5. (``--sections paper``, ``bench.report_paper``) the seed paper's comparison: full depth and
   each batch policy across thresholds at every batch size, with quality (ROUGE-L, held-out
   teacher-forced perplexity), layers run per pass and per token, and the cost model's ideals.

Repeats are interleaved (full depth, each early-exit setting and HF one after the other, per
repeat) and each figure is the median run by decode tokens/s; a ratio divides two medians of
the same run. A further repeat starts only if it should end within ``--time-budget`` minutes of
the first (at least one repeat always runs; the report says how many ran). Absolute figures
mean something only within one report. ``write`` puts
``report.json``, ``report.md`` and the PNG plots (``bench.plots``) into the output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eeserve.bench.plots import plot_all
from eeserve.bench.report_blocks import run_blocks
from eeserve.bench.report_config import (
    PAPER_TEXT_SOURCES,
    ReportConfig,
    canonical_command,
    config_from_args,
)
from eeserve.bench.report_md import render
from eeserve.bench.report_paper import paper_blocks, paper_quality, paper_rows, paper_warm_up
from eeserve.bench.report_peer import Peer, open_peer, peer_blocks, peer_rows
from eeserve.bench.report_run import ReportRun
from eeserve.bench.report_spec import speculative_blocks, speculative_rows
from eeserve.bench.report_spec import warm_up as spec_warm_up
from eeserve.tuning.provenance import git_revision


def run_report(cfg: ReportConfig) -> dict[str, Any]:
    """Measure everything (progress on stderr) and return the raw figures."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    load_start = _load_average()
    t0 = time.perf_counter()
    run = ReportRun(cfg)
    run.warm_up()
    exit_blocks = run.blocks() if "exit" in cfg.sections else []
    spec_blocks = speculative_blocks(run) if "speculative" in cfg.sections else []
    if spec_blocks:
        spec_warm_up(run)
    sweep = paper_blocks(run) if "paper" in cfg.sections else []
    if sweep:
        paper_warm_up(run)
        quality = paper_quality(run)
    peer = open_peer(run) if cfg.peer else Peer()
    if peer.skipped:
        print(f"llama.cpp section skipped: {peer.skipped}", file=sys.stderr)
    try:
        t1 = time.perf_counter()
        more = peer_blocks(run, peer)
        blocks = exit_blocks + spec_blocks + sweep + more
        tokens = cfg.repeats * cfg.max_tokens * sum(b.batch * len(b.jobs) for b in blocks)
        with tqdm(total=tokens, desc="bench report", unit="tok", file=sys.stderr) as bar:
            done = run_blocks(blocks, cfg.repeats, 60 * cfg.time_budget_min, bar, cfg.max_tokens)
        t2 = time.perf_counter()
    finally:
        peer.close()
    results: dict[str, Any] = run.rows(exit_blocks) if exit_blocks else {}
    if spec_blocks:
        results["speculative"] = speculative_rows(run, spec_blocks)
    if sweep:
        results["paper_sweep"] = paper_rows(run, sweep, quality)
    if cfg.peer:
        results["peer"] = {"skipped": peer.skipped} if peer.skipped else {}
        if more:
            results["peer"]["rows"] = peer_rows(run, more)
    results["meta"] = run.meta() | {
        "canonical_command": canonical_command(cfg),
        "started": started,
        "repeats_done": done,
        "git_revision": git_revision(),
        "load_average": {"start": load_start, "end": _load_average()},
        "wall_s": {"setup and warm-up": t1 - t0, "measuring": t2 - t1, "total": t2 - t0},
    }
    meta = results["meta"]
    # What a file under bench/results/ must state (tests/test_docs.py).
    results["provenance"] = {
        "commit": meta["git_revision"],
        "date": started,
        "machine": meta["machine"],
        "command": meta["command"],
        "all_options": meta["canonical_command"],
    }
    return results


def _load_average() -> float | None:
    """The 1-minute load average (other work competing for the CPUs), where the OS has one."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def write(results: dict[str, Any], out: Path) -> list[Path]:
    """report.json, report.md and the plots into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=2, default=str))
    plots = plot_all(results, out)
    paths[1].write_text(render(results, [p.name for p in plots]))
    return paths + plots


def main_report(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    results = run_report(cfg)
    for path in write(results, Path(cfg.out)):
        print(f"wrote {path}")
    return 0


def add_report_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="reproducible early-exit report: JSON, markdown, PNG plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default=None, help="folder (default bench/results/report or /quick)")
    p.add_argument("--quick", action="store_true", help="small run: batch 1,8, 32 tokens, 1 repeat")
    p.add_argument("--batch-sizes", default=None, help="default 1,8,32 (and 64 on CUDA)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (128)")
    p.add_argument("--repeats", type=int, default=None, help="median over this many (3)")
    p.add_argument("--seed", type=int, default=0, help="prompt selection")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policies", default="per_sequence,batch_all")
    p.add_argument("--kv-fills", default="fill,recompute")
    p.add_argument("--measure", default=None, help="operating point (default: exit config)")
    p.add_argument("--threshold", type=float, default=None, help="operating point threshold")
    p.add_argument("--measures", default=None, help="frontier measures (default: all available)")
    p.add_argument("--thresholds", default=None, help="sweep of softmax/classifier measures")
    p.add_argument("--cosine-thresholds", default=None, help="sweep of hidden_cosine")
    p.add_argument(
        "--no-peer", action="store_true", help="skip the llama.cpp row (llama-cpp-python)"
    )
    p.add_argument("--frontier-batch", type=int, default=None, help="batch of the frontier (8)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=30.0,
        help="minutes: a further repeat starts only if it should end within (0: no limit)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--prompt-format", choices=["chat", "raw"], default="chat")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--note", default="", help="a line for the report (e.g. machine conditions)")
    p.add_argument(
        "--sections",
        default="exit,speculative",
        help="exit (sections 1-4), speculative (speculative mode vs full depth) and/or paper "
        "(batch policies across thresholds, with layers run and the cost model's ideal)",
    )
    p.add_argument(
        "--num-draft-tokens", default="4", help="speculative section: drafts per verification"
    )
    p.add_argument(
        "--speculative-drafts",
        default="exits,int8",
        help="speculative section: what drafts (exits: the exit heads; int8: an int8 copy)",
    )
    _add_paper_args(p)
    p.set_defaults(func=main_report)


def _add_paper_args(p: argparse.ArgumentParser) -> None:
    """The paper section's options (``bench.report_paper``)."""
    p.add_argument(
        "--paper-policies", default="batch_all,per_sequence,auto", help="paper section: policies"
    )
    p.add_argument(
        "--paper-measures", default=None, help="paper section: measures (default: the model's)"
    )
    p.add_argument(
        "--paper-thresholds",
        default=None,
        help="paper section: '1.01,0.9,0.5' (every measure) or 'classifier=1.01,0.9;"
        "hidden_cosine=1.01,0.99' (default: 1.01 (nothing exits) down to 0.3; cosine to 0.95)",
    )
    p.add_argument(
        "--paper-texts", type=int, default=None, help="paper section: held-out texts (16; quick 4)"
    )
    p.add_argument(
        "--paper-text-source",
        default="generated",
        choices=PAPER_TEXT_SOURCES,
        help="paper section's perplexity: held-out prompts' full-depth continuations, or passages",
    )
