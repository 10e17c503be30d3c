"""``eeserve calibrate``: pick an exit threshold with a stated quality guarantee and store it.

Contract:
- Calibration prompts (a file, or ``prompt_texts(n, split="calib")``, disjoint from the tuning
  data) are generated greedily (EOS respected, ``max_tokens`` at most) at full depth and, for each
  candidate threshold from the most conservative down, with early exit under the chosen engine
  policy. Each prompt's loss is 1 - ROUGE-L (``--loss rouge``, default) or 1 - token agreement
  (``--loss tokens``) of the early-exit output against the full-depth output, a number in [0, 1].
- ``tuning.ltt`` (pure) tests each candidate (Learn-then-Test, fixed sequence, stopping
  at the first non-rejection) and returns the most aggressive rejected one: with probability
  >= 1 - epsilon its mean loss on traffic drawn like the calibration prompts is <= delta.
- The result goes into the sidecar's ``exit_config.json``: a ``calibration`` entry {measure,
  delta, epsilon, threshold, policy, loss, n, ...} (replacing an entry with the same measure,
  delta, epsilon, policy and loss), ``thresholds[measure]`` and ``default_measure`` set to it and
  ``enabled_by_default`` true (``--keep-default``: the threshold only; the default measure
  stays). Target: ``--out-config DIR``; else the packaged sidecar of the default model (which
  must exist: the tuned heads), else the model folder
  (``tuning.calibration_store``). Nothing is written
  when no candidate is rejected. A table (candidate, mean loss, p-value, rejected, mean exit
  layer, decode tokens/s ratio vs full depth) is printed either way.
- ``--loss perplexity --max-ppl-increase B`` instead picks the loosest candidate whose held-out
  teacher-forced perplexity stays within (1 + B) x full depth's (``tuning.calibrate_ppl``: a
  point estimate on the calibration texts, no Learn-then-Test) and stores it the same way, with
  ``loss: "perplexity"`` and ``delta`` = B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eeserve.config import EXIT_POLICIES
from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine.plan import calibrated_threshold
from eeserve.engine_args import add_engine_args, engine_config
from eeserve.exit_params import MEASURES, ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.tuning.calibrate_ppl import TEXT_SOURCES, main_perplexity
from eeserve.tuning.calibrate_structured import (
    STRUCTURED_WORKLOADS,
    field_losses,
    structured_prompts,
)
from eeserve.tuning.calibration_prompts import RunResult, load_prompts, prompt_ids, run_prompts
from eeserve.tuning.calibration_store import target_folder, with_calibration, write_calibration
from eeserve.tuning.ltt import (
    PVALUES,
    CandidateRow,
    check_candidate,
    chosen_threshold,
    order_candidates,
)
from eeserve.tuning.provenance import provenance
from eeserve.tuning.quality import rouge_l, token_agreement
from eeserve.tuning.structured_workloads import Workload

# A shortlist's softmax leaves out the rest of the vocabulary, so it overstates confidence: its
# candidates start closer to 1 (on the default model 0.999 already loses ROUGE-L 0.02).
_SHORTLIST_CANDIDATES = [0.99999, 0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9]
DEFAULT_CANDIDATES = {
    "softmax_margin": [0.999, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.7, 0.5],
    "max_prob": [0.999, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.7, 0.5],
    "classifier": [0.999, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.85, 0.8, 0.7, 0.5],
    "hidden_cosine": [0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.95, 0.9],
    "shortlist_margin": _SHORTLIST_CANDIDATES,
    "shortlist_max_prob": _SHORTLIST_CANDIDATES,
}
LOSSES = ("rouge", "tokens", "fields")
STRUCTURED_HELP = (
    "calibrate constrained requests' threshold on this structured-output workload (use --loss "
    "fields); stored as the measure's constrained threshold"
)
CHAT_MODES = ("no", "yes", "mixed")


@dataclass
class TableRow:
    test: CandidateRow
    mean_exit_layer: float
    speed_ratio: float  # decode tokens/s at this candidate / at full depth


def candidates(args: argparse.Namespace) -> list[float]:
    """``--candidates``, else the defaults of the measure."""
    return list(args.candidates or DEFAULT_CANDIDATES[args.measure])


def consistency_losses(
    kind: str, run: RunResult, ref: RunResult, workload: Workload | None = None
) -> list[float]:
    """Per prompt 1 - ROUGE-L of the texts (``rouge``), 1 - token agreement (``tokens``) or
    1 - field agreement of a structured workload's answers (``fields``)."""
    if kind == "fields":
        if workload is None:
            raise ValueError("--loss fields needs --structured (a workload with fields)")
        return field_losses(workload, run, ref)
    if kind == "rouge":
        scores = [rouge_l(a, b) for a, b in zip(run.texts, ref.texts)]
    elif kind == "tokens":
        scores = [token_agreement(a, b) for a, b in zip(run.token_ids, ref.token_ids)]
    else:
        raise ValueError(f"loss must be one of {LOSSES}, got {kind!r}")
    return [min(1.0, max(0.0, 1.0 - s)) for s in scores]


@dataclass
class Calibration:
    rows: list[TableRow]
    threshold: float | None
    full_decode_tokens_per_s: float
    full_mean_exit_layer: float


def calibrate(
    engine: LLMEngine,
    prompts: list[list[int]],
    args: argparse.Namespace,
    full_table: bool = False,
) -> Calibration:
    """Run full depth, then the candidates most conservative first (see the module docstring).

    After the first non-rejection the sequence has stopped; later candidates are only run (and
    shown as not tested) with ``full_table``.
    """
    # Untimed warm-up over every prompt (its prefill and first decode steps): the first pass
    # of a fresh engine (its KV pool and buffers first touched) ran about a third slower, which
    # skewed every speed ratio upwards.
    constraint = args.workload.constraint if args.workload is not None else None
    run_prompts(engine, prompts, 2, ExitParams(enabled=False), constraint)
    ref = run_prompts(engine, prompts, args.max_tokens, ExitParams(enabled=False), constraint)
    print(
        f"full depth: {ref.decode_tokens_per_s:.1f} decode tok/s on {len(prompts)} prompts",
        flush=True,
    )
    rows: list[TableRow] = []
    stopped = False
    for cand in order_candidates(candidates(args)):
        if stopped and not full_table:
            break
        ep = ExitParams(threshold=cand, measure=args.measure)
        run = run_prompts(engine, prompts, args.max_tokens, ep, constraint)
        losses = consistency_losses(args.loss, run, ref, args.workload)
        test = check_candidate(cand, losses, args.delta, args.epsilon, args.pvalue)
        if stopped:
            test = dataclasses.replace(test, rejected=False, tested=False)
        stopped = stopped or not test.rejected
        row = TableRow(test, run.mean_exit_layer, run.decode_tokens_per_s / ref.decode_tokens_per_s)
        rows.append(row)
        print(format_row(row, engine.model_config.num_layers), flush=True)
    return Calibration(
        rows, chosen_threshold([r.test for r in rows]), ref.decode_tokens_per_s, ref.mean_exit_layer
    )


def format_row(row: TableRow, num_layers: int) -> str:
    t = row.test
    verdict = ("yes" if t.rejected else "no") if t.tested else "not tested"
    return (
        f"{t.candidate:>10g} {t.mean_loss:>10.4f} {t.p_value:>10.3g} {verdict:>10s} "
        f"{row.mean_exit_layer:>9.2f}/{num_layers:<3d} {row.speed_ratio:>8.2f}x"
    )


def format_table(cal: Calibration, num_layers: int, args: argparse.Namespace) -> str:
    head = (
        f"{'candidate':>10s} {'mean loss':>10s} {'p-value':>10s} {'rejected':>10s} "
        f"{'exit layer':>13s} {'tok/s ratio':>9s}"
    )
    lines = [
        f"Learn-then-Test: measure {args.measure}, policy {args.exit_policy}, loss {args.loss}, "
        f"delta {args.delta}, epsilon {args.epsilon}, p-value {args.pvalue}, n {cal.rows[0].test.n}"
        if cal.rows
        else "Learn-then-Test: no candidates",
        head,
        *(format_row(r, num_layers) for r in cal.rows),
        f"full depth: {cal.full_decode_tokens_per_s:.1f} decode tok/s; chosen threshold: "
        + (f"{cal.threshold:g}" if cal.threshold is not None else "none (no candidate rejected)"),
    ]
    return "\n".join(lines)


def calibration_entry(args: argparse.Namespace, threshold: float, n: int) -> dict[str, object]:
    return {
        "measure": args.measure,
        "delta": args.delta,
        "epsilon": args.epsilon,
        "threshold": threshold,
        "policy": args.exit_policy,
        "loss": args.loss,
        "n": n,
        "pvalue": args.pvalue,
        "max_tokens": args.max_tokens,
        "prompts": args.prompts or f"prompt_texts(split='calib', seed={args.seed})",
        "chat": args.chat,
        **(
            {"structured": args.structured, "prompts": f"{args.structured}(split='calib')"}
            if args.structured
            else {}
        ),
    }


# -- prompts and the command ------------------------------------------------------------------


def heldout_check(
    engine: LLMEngine, args: argparse.Namespace, cfg: ExitConfig, threshold: float
) -> dict[str, float]:
    """Loss and speed at the calibrated threshold, reached through ``tolerance=delta`` (a
    constrained workload's: as stored, the constrained threshold)."""
    w = args.workload
    if w is None:
        resolved = calibrated_threshold(cfg, args.delta, args.measure)
        assert resolved == threshold, (resolved, threshold)
        prompts = prompt_ids(engine, load_prompts(args, args.check_split, args.check_n), args.chat)
    else:
        resolved = float(cfg.constrained_thresholds[args.measure])  # type: ignore[arg-type]
        prompts, w = structured_prompts(engine, args.structured, args.check_n, args.check_split)
    constraint = w.constraint if w is not None else None
    ref = run_prompts(engine, prompts, args.max_tokens, ExitParams(enabled=False), constraint)
    ep = ExitParams(threshold=resolved, measure=args.measure)
    run = run_prompts(engine, prompts, args.max_tokens, ep, constraint)
    losses = consistency_losses(args.loss, run, ref, w)
    result = {
        "n": float(len(prompts)),
        "mean_loss": statistics.mean(losses),
        "speed_ratio": run.decode_tokens_per_s / ref.decode_tokens_per_s,
        "mean_exit_layer": run.mean_exit_layer,
    }
    print(
        f"check on {len(prompts)} {args.check_split!r} prompts at threshold {resolved:g}: "
        f"mean loss {result['mean_loss']:.4f} ({'<=' if result['mean_loss'] <= args.delta else '>'}"
        f" delta {args.delta}), decode tok/s ratio {result['speed_ratio']:.2f}x, "
        f"mean exit layer {run.mean_exit_layer:.2f}",
        flush=True,
    )
    return result


def main(args: argparse.Namespace) -> int:
    if args.exit_policy == "none":
        raise ValueError("calibrate needs an exit policy (per_sequence or batch_all), not none")
    for name in ("delta", "epsilon"):
        if not 0 < getattr(args, name) < 1:
            raise ValueError(f"--{name} must be in (0, 1), got {getattr(args, name)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = LLMEngine(engine_config(args))
    args.measure = args.measure or engine.exit_config.default_measure
    out = target_folder(args.model, args.out_config)  # fail before the long run, not after
    args.workload = None
    if args.structured:
        prompts, args.workload = structured_prompts(engine, args.structured, args.n, "calib")
    else:
        prompts = prompt_ids(engine, load_prompts(args, "calib", args.n), args.chat)
    if args.loss == "perplexity":
        return main_perplexity(engine, prompts, args, out, candidates(args))
    cal = calibrate(engine, prompts, args, full_table=args.full_table)
    print(format_table(cal, engine.model_config.num_layers, args))
    report: dict[str, Any] = {
        "provenance": provenance(),
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "workload")},
        "rows": [dataclasses.asdict(r) for r in cal.rows],
    }
    report["threshold"] = cal.threshold
    if cal.threshold is None:
        print("no candidate passed the test: nothing written (try more prompts or fewer tokens)")
    else:
        entry = calibration_entry(args, cal.threshold, len(prompts))
        keep = not args.keep_default
        path = write_calibration(args.model, out, engine.exit_config, entry, keep)
        print(f"wrote threshold {cal.threshold:g} for {args.measure} into {path}")
        if args.check_n > 0:
            new_cfg = with_calibration(engine.exit_config, entry, keep)
            report["check"] = heldout_check(engine, args, new_cfg, cal.threshold)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if cal.threshold is not None else 1


def add_calibrate_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "calibrate",
        help="calibrate the exit threshold for a quality target (Learn-then-Test)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="smollm2, an HF folder or a .gguf file")
    p.add_argument("--delta", type=float, default=0.05, help="allowed mean consistency loss")
    p.add_argument("--epsilon", type=float, default=0.05, help="allowed failure probability")
    p.add_argument("--measure", default=None, choices=MEASURES, help="default: the model's")
    p.add_argument("--policy", dest="exit_policy", choices=EXIT_POLICIES, help="= --exit-policy")
    p.add_argument(
        "--loss",
        default="rouge",
        choices=(*LOSSES, "perplexity"),
        help="1-ROUGE-L or 1-token agreement (Learn-then-Test), or the teacher-forced perplexity",
    )
    p.add_argument(
        "--max-ppl-increase",
        type=float,
        default=0.05,
        help="--loss perplexity: allowed relative increase of the held-out perplexity",
    )
    p.add_argument(
        "--ppl-texts",
        default="generated",
        choices=TEXT_SOURCES,
        help="--loss perplexity: score the prompts' full-depth continuations, or the prompts",
    )
    p.add_argument(
        "--pvalue", default="hb", choices=sorted(PVALUES), help="Hoeffding-Bentkus or Hoeffding"
    )
    p.add_argument("--prompts", default=None, help="prompt file: one a line, or .jsonl with prompt")
    p.add_argument("--n", type=int, default=200, help="number of calibration prompts (at most)")
    p.add_argument("--structured", default=None, choices=STRUCTURED_WORKLOADS, help=STRUCTURED_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed of the offline prompt sets")
    p.add_argument(
        "--chat", default="no", choices=CHAT_MODES, help="chat template: no, yes, every other"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--candidates", type=float, nargs="+", default=None, help="thresholds to test")
    p.add_argument("--full-table", action="store_true", help="also run candidates after the stop")
    p.add_argument("--out-config", default=None, help="sidecar folder to write exit_config.json to")
    p.add_argument(
        "--keep-default",
        action="store_true",
        help="store the threshold beside the sidecar's default measure, which stays the default",
    )
    p.add_argument("--check-n", type=int, default=0, help="then check N held-out prompts")
    p.add_argument("--check-split", default="heldout", help="prompt split of the check")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the table and settings as JSON here")
    add_engine_args(p.add_argument_group("engine options"))
    p.set_defaults(func=main, kv_cache_memory=float(2 * 2**30), exit_policy="per_sequence")
    return p
