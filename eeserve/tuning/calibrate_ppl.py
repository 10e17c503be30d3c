"""``eeserve calibrate --loss perplexity``: the loosest threshold within a perplexity budget.

Contract: ``calibrate_perplexity(engine, scores, measure, candidates, bound)`` evaluates each
candidate threshold on teacher-forced scores (``tuning.teacher_forced``) from the most
conservative down and stops at the first whose held-out perplexity ratio (with exits / full
depth) exceeds 1 + ``bound``; the chosen threshold is the last one before it. This is a point
estimate on the calibration texts, stated as such: no confidence level, unlike Learn-then-Test.
``perplexity_entry`` is its calibration entry (``loss: "perplexity"``, ``delta`` = the bound,
``epsilon`` None, no ``policy``: the teacher-forced decision is per token, and ``batch_all`` and
``auto`` exit no token earlier); ``format_table`` prints the candidates; ``main_perplexity`` is
the command's ``--loss perplexity`` path (texts: the calibration prompts' full-depth greedy
continuations, or the prompts themselves; then the entry, and a held-out check with ``--check-n``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine.plan import calibrated_threshold
from eeserve.exit_params import ExitParams
from eeserve.tuning.calibration_prompts import load_prompts, prompt_ids, run_prompts
from eeserve.tuning.calibration_store import with_calibration, write_calibration
from eeserve.tuning.ltt import order_candidates
from eeserve.tuning.provenance import provenance
from eeserve.tuning.teacher_forced import (
    ExitQuality,
    ExitScores,
    collect_scores,
    continuation_texts,
    evaluate,
    passage_texts,
)

TEXT_SOURCES = ("generated", "prompts")


@dataclass(frozen=True)
class PplRow:
    candidate: float
    quality: ExitQuality
    within: bool  # ratio <= 1 + bound
    tested: bool = True  # False after the sequence has stopped (``--full-table``)


@dataclass(frozen=True)
class PplCalibration:
    rows: list[PplRow]
    threshold: float | None  # the last candidate of the leading run within the bound
    full_perplexity: float
    tokens: int


def calibrate_perplexity(
    engine: LLMEngine,
    scores: ExitScores,
    measure: str,
    candidates: list[float],
    bound: float,
    full_table: bool = False,
) -> PplCalibration:
    """Candidates most conservative first; after the first one over the bound the sequence has
    stopped (later ones are evaluated and shown as not tested only with ``full_table``)."""
    if not 0 < bound < 1:
        raise ValueError(f"--max-ppl-increase must be in (0, 1), got {bound}")
    rows: list[PplRow] = []
    chosen: float | None = None
    stopped = False
    for cand in order_candidates(candidates):
        if stopped and not full_table:
            break
        q = evaluate(scores, engine.exit_plan(ExitParams(threshold=cand, measure=measure)))
        within = q.ratio <= 1 + bound
        rows.append(PplRow(cand, q, within and not stopped, tested=not stopped))
        stopped = stopped or not within
        if not stopped:
            chosen = cand
    full = evaluate(scores, None).full_perplexity
    return PplCalibration(rows, chosen, full, scores.tokens)


def format_row(row: PplRow, num_layers: int) -> str:
    q = row.quality
    verdict = ("yes" if row.within else "no") if row.tested else "not tested"
    return (
        f"{row.candidate:>10g} {q.perplexity:>10.3f} {q.ratio:>8.4f} {verdict:>10s} "
        f"{q.mean_exit_layer:>9.2f}/{num_layers:<3d} {q.exited:>7.1%} {q.argmax_agreement:>9.3f}"
    )


def format_table(cal: PplCalibration, num_layers: int, args: argparse.Namespace) -> str:
    head = (
        f"{'candidate':>10s} {'ppl':>10s} {'ratio':>8s} {'within':>10s} {'exit layer':>13s} "
        f"{'exited':>7s} {'argmax =':>9s}"
    )
    chosen = f"{cal.threshold:g}" if cal.threshold is not None else "none (the first is over)"
    return "\n".join(
        [
            f"teacher-forced perplexity: measure {args.measure}, bound ratio <= "
            f"{1 + args.max_ppl_increase:g}, {cal.tokens} tokens of {args.ppl_texts} texts "
            "(a point estimate on these texts, no confidence level)",
            head,
            *(format_row(r, num_layers) for r in cal.rows),
            f"full depth: perplexity {cal.full_perplexity:.3f}; chosen threshold: {chosen}",
        ]
    )


def perplexity_entry(
    args: argparse.Namespace, cal: PplCalibration, n_texts: int
) -> dict[str, object]:
    assert cal.threshold is not None
    at = next(r.quality for r in cal.rows if r.candidate == cal.threshold)
    return {
        "measure": args.measure,
        "delta": args.max_ppl_increase,
        "epsilon": None,
        "threshold": cal.threshold,
        "policy": None,
        "loss": "perplexity",
        "guarantee": "point estimate on the calibration texts",
        "n": n_texts,
        "tokens": cal.tokens,
        "perplexity_ratio": at.ratio,
        "full_perplexity": cal.full_perplexity,
        "mean_exit_layer": at.mean_exit_layer,
        "texts": args.ppl_texts,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts or f"prompt_texts(split='calib', seed={args.seed})",
        "chat": args.chat,
    }


# -- the command --------------------------------------------------------------------------------


def perplexity_scores(
    engine: LLMEngine, prompts: list[list[int]], args: argparse.Namespace
) -> ExitScores:
    """Teacher-forced scores of the prompts' full-depth continuations (``--ppl-texts
    generated``) or of the prompts themselves (``prompts``)."""
    if args.ppl_texts == "generated":
        ref = run_prompts(engine, prompts, args.max_tokens, ExitParams(enabled=False))
        texts = continuation_texts(prompts, ref.token_ids)
    else:
        texts = passage_texts(prompts, engine.max_model_len)
    return collect_scores(engine, texts, [args.measure])


def main_perplexity(
    engine: LLMEngine,
    prompts: list[list[int]],
    args: argparse.Namespace,
    out: Path,
    candidates: list[float],
) -> int:
    """The ``--loss perplexity`` half of ``eeserve calibrate``: table, entry, held-out check."""
    scores = perplexity_scores(engine, prompts, args)
    bound = args.max_ppl_increase
    cal = calibrate_perplexity(engine, scores, args.measure, candidates, bound, args.full_table)
    print(format_table(cal, engine.model_config.num_layers, args))
    report: dict[str, Any] = {
        "provenance": provenance(),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "rows": [dataclasses.asdict(r) for r in cal.rows],
        "threshold": cal.threshold,
        "full_perplexity": cal.full_perplexity,
    }
    if cal.threshold is None:
        print("the most conservative candidate is already over the bound: nothing written")
    else:
        entry = perplexity_entry(args, cal, len(prompts))
        keep = not args.keep_default
        path = write_calibration(args.model, out, engine.exit_config, entry, keep)
        print(f"wrote threshold {cal.threshold:g} for {args.measure} into {path}")
        if args.check_n > 0:
            # Reached as a request would: ``tolerance`` = the bound.
            resolved = calibrated_threshold(
                with_calibration(engine.exit_config, entry, keep), bound, args.measure
            )
            texts = load_prompts(args, args.check_split, args.check_n)
            check = perplexity_scores(engine, prompt_ids(engine, texts, args.chat), args)
            q = evaluate(
                check, engine.exit_plan(ExitParams(threshold=resolved, measure=args.measure))
            )
            report["check"] = dataclasses.asdict(q)
            print(
                f"check on {len(texts)} {args.check_split!r} prompts at threshold {resolved:g}: "
                f"perplexity ratio {q.ratio:.4f} ({'<=' if q.ratio <= 1 + bound else '>'} "
                f"{1 + bound:g}), mean exit layer {q.mean_exit_layer:.2f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if cal.threshold is not None else 1
