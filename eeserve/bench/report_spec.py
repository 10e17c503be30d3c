"""The speculative section of ``eeserve bench report``: self-speculative decoding vs full depth.

Contract: ``speculative_blocks(run)`` gives, per batch size, one block measuring full depth and
speculative mode for each draft source of the report config (``exits``: the model's exit rule
drafts; ``int8``: an int8 copy of the weights drafts, on its own engine) and ``num_draft_tokens``
side by side in the same interleaved repeats; ``speculative_rows`` turns the measured blocks into
rows: decode speed ratio against full depth, token agreement with full depth (1.000: the mode
is lossless), acceptance rate (accepted / drafted) and drafts per generated token; the mean draft
layer and the acceptance per exit layer come from the per-token record (accepted drafts and the
first rejected one of each verification). ``speculative_section`` renders them as markdown.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product
from typing import Any

from eeserve.bench.measure import Run, token_agreement_mean
from eeserve.bench.report_blocks import Block, Job
from eeserve.bench.report_run import ReportRun
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams


def _params(run: ReportRun, draft: str, n: int) -> ExitParams:
    if draft == "int8":  # the int8 copy drafts at full depth: no exit rule to give
        return ExitParams(mode="speculative", num_draft_tokens=n)
    measure, threshold, _ = run.op
    return ExitParams(mode="speculative", measure=measure, threshold=threshold, num_draft_tokens=n)


def _engine(run: ReportRun, draft: str) -> LLMEngine:
    if draft == "int8":
        assert run.int8_drafter is not None, "the int8 drafter's engine is built with the run"
        return run.int8_drafter
    return run.first


def speculative_blocks(run: ReportRun) -> list[Block]:
    out = []
    for b in run.batch_sizes:
        jobs: list[Job] = [("full", run.engine_job(run.first, b, ExitParams(enabled=False)))]
        jobs += [
            (f"spec/{d}/{n}", run.engine_job(_engine(run, d), b, _params(run, d, n)))
            for d, n in product(run.cfg.speculative_drafts, run.cfg.num_draft_tokens)
        ]
        out.append(Block(f"speculative, batch {b}", b, jobs))
    return out


def warm_up(run: ReportRun) -> None:
    for d in run.cfg.speculative_drafts:
        run.engine_job(_engine(run, d), 2, _params(run, d, run.cfg.num_draft_tokens[0]))()


def _per_layer(r: Run) -> dict[str, dict[str, float]]:
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for layer, ok in r.draft_records:
        counts[layer][0] += int(ok)
        counts[layer][1] += 1
    return {
        str(lay): {"accepted": a, "verified": n, "rate": a / n}
        for lay, (a, n) in sorted(counts.items())
    }


def speculative_rows(run: ReportRun, blocks: list[Block]) -> list[dict[str, Any]]:
    rows = []
    for block in blocks:
        med = block.median()
        full = med["full"]
        for d, n in product(run.cfg.speculative_drafts, run.cfg.num_draft_tokens):
            r = med[f"spec/{d}/{n}"]
            layers = [lay for lay, _ in r.draft_records]
            rows.append(
                {
                    "batch": block.batch,
                    "draft": d,
                    "num_draft_tokens": n,
                    "decode_tok_s": r.decode_tokens_per_s,
                    "full_decode_tok_s": full.decode_tokens_per_s,
                    "ratio": r.decode_tokens_per_s / full.decode_tokens_per_s,
                    "token_agreement": token_agreement_mean(full.outputs, r.outputs),
                    "identical": full.outputs == r.outputs,
                    "acceptance_rate": r.accepted / r.drafted if r.drafted else 0.0,
                    "drafted": r.drafted,
                    "accepted": r.accepted,
                    "drafted_per_token": r.drafted / max(1, sum(map(len, r.outputs))),
                    "mean_draft_layer": sum(layers) / len(layers) if layers else None,
                    "per_layer": _per_layer(r),
                }
            )
    return rows


def speculative_section(results: dict[str, Any]) -> str:
    rows = results["speculative"]
    head = [
        "batch",
        "draft",
        "drafts ≤",
        "full tok/s",
        "speculative tok/s",
        "speed",
        "token agreement",
        "acceptance",
        "drafted/token",
        "mean draft layer",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        layer = f"{r['mean_draft_layer']:.1f}" if r["mean_draft_layer"] else "–"
        cells = [
            str(r["batch"]),
            r["draft"],
            str(r["num_draft_tokens"]),
            f"{r['full_decode_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['ratio']:.2f}×",
            f"{r['token_agreement']:.3f}",
            f"{r['acceptance_rate']:.1%}",
            f"{r['drafted_per_token']:.2f}",
            layer,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    per_layer = [
        f"- batch {r['batch']}, {r['draft']} drafts ≤ {r['num_draft_tokens']}: "
        + ", ".join(
            f"L{lay} {v['rate']:.0%} of {v['verified']}" for lay, v in r["per_layer"].items()
        )
        for r in rows
        if r["per_layer"]
    ]
    return (
        "## Speculative mode (a draft proposes, full depth verifies)\n\nDecode tokens/s of "
        "speculative mode against full depth, measured side by side; token agreement with full "
        "depth must be 1.000 (the output is full depth's). Acceptance = accepted / drafted. "
        "Draft `exits`: the exit heads at the exit rule's layers; `int8`: an int8 copy of the "
        "model's own weights at full depth (draft layer = the last layer).\n\n"
        + "\n".join(lines)
        + "\n\nAcceptance per draft exit layer (drafts in the output record: accepted ones and the "
        "first rejected draft of each verification):\n\n" + ("\n".join(per_layer) or "- no drafts")
    )
