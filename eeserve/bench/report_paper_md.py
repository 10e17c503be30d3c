"""Markdown of the paper section of ``eeserve bench report`` (``bench.report_paper``).

Contract: ``paper_sweep_section(results, plot)`` is a pure function of ``results["paper_sweep"]``
(as written to ``report.json``) and the plot's file name: per batch size a table of full depth
and every policy and threshold (speed next to its two ideals, quality, depth), the teacher-forced
quality per threshold, and per batch size the fastest point of each policy within a perplexity
budget.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]
PPL_BUDGET = 1.05  # the summary's quality bar: held-out perplexity within 5% of full depth's

_HEAD = ["policy", "measure", "threshold", "tok/s", "speed", "ideal (pass)", "ideal (token)",
         "ROUGE-L", "ppl ratio", "exit layer", "layers/iteration", "layers/token"]  # fmt: skip


_TF_HEAD = ["measure", "threshold", "perplexity", "ratio", "mean exit layer", "exited",
            "argmax = full depth"]  # fmt: skip


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_line(head), "|" + "---|" * len(head), *(_line(r) for r in rows)])


def _batch_table(sweep: dict[str, Any], b: int) -> str:
    full = next(r for r in sweep["full_depth"] if r["batch"] == b)
    rows = [["full depth", "–", "–", f"{full['decode_tok_s']:.1f}", "1.00×", "1.00×", "1.00×",
             "1.000", "1.000", f"{full['mean_exit_layer']:.1f}",
             f"{full['layers_per_iteration']:.1f}", f"{full['layers_per_token']:.1f}"]]  # fmt: skip
    for r in sweep["rows"]:
        if r["batch"] == b:
            rows.append([r["policy"], r["measure"], f"{r['threshold']:g}",
                         f"{r['decode_tok_s']:.1f}", f"**{r['ratio']:.2f}×**",
                         f"{r['ideal_pass']:.2f}×", f"{r['ideal_token']:.2f}×",
                         f"{r['rouge_l']:.3f}", f"{r['ppl_ratio']:.3f}",
                         f"{r['mean_exit_layer']:.1f}", f"{r['layers_per_iteration']:.1f}",
                         f"{r['layers_per_token']:.1f}"])  # fmt: skip
    return f"### Batch {b}\n\n" + _table(_HEAD, rows)


def _teacher_forced(sweep: dict[str, Any]) -> str:
    tf = sweep["teacher_forced"]
    t = tf["texts"]
    rows = [
        [s["measure"], f"{s['threshold']:g}", f"{q['perplexity']:.3f}", f"{q['ratio']:.3f}",
         f"{q['mean_exit_layer']:.2f}", f"{q['exited']:.1%}", f"{q['argmax_agreement']:.3f}"]
        for s in sweep["settings"]
        for q in [tf["points"][f"{s['measure']}@{s['threshold']:g}"]]
    ]  # fmt: skip
    source = (
        f"the full-depth greedy continuations (EOS respected, ≤ {t['max_tokens']} tokens) of "
        f"{t['count']} `heldout` prompts, scored from their second token"
        if t["source"] == "generated"
        else f"{t['count']} `heldout` passages, every token but the first"
    )
    return (
        f"Teacher-forced on {source}: {t['scored_tokens']} tokens, full-depth perplexity "
        f"{tf['full_perplexity']:.3f}. Each token exits at the first exit layer whose confidence "
        "reaches the threshold and is scored by that exit's head.\n\n" + _table(_TF_HEAD, rows)
    )


def _summary(sweep: dict[str, Any]) -> list[str]:
    out = []
    for b in sorted({r["batch"] for r in sweep["rows"]}):
        parts = []
        for policy in sweep["policies"]:
            ok = [r for r in sweep["rows"] if r["batch"] == b and r["policy"] == policy
                  and r["ppl_ratio"] <= PPL_BUDGET]  # fmt: skip
            if ok:
                best = max(ok, key=lambda r: r["ratio"])
                parts.append(
                    f"`{policy}` {best['ratio']:.2f}× at {best['threshold']:g} (ideal "
                    f"{best['ideal_pass']:.2f}× per pass, {best['layers_per_iteration']:.1f} "
                    f"layers/iteration, ROUGE-L {best['rouge_l']:.2f})"
                )
        out.append(f"- batch {b}: " + ("; ".join(parts) or "no point within the budget"))
    return out


def paper_sweep_section(results: dict[str, Any], plot: str | None) -> str:
    sweep = results["paper_sweep"]
    img = f"![batch policies across thresholds]({plot})\n\n" if plot else ""
    batches = sorted({r["batch"] for r in sweep["full_depth"]})
    return "\n\n".join(
        [
            "## The paper's comparison: batch policies across thresholds\n\n"
            "Full depth and each batch policy (KV debt `fill`) at each threshold, measured side "
            "by side in the same interleaved repeats. *speed*: decode tokens/s over full "
            "depth's. *ideal (pass)*: full depth's cost (L·layer + head) over the mean cost of "
            "the passes as run, a pass that ran P < L layers costing P·layer + head + adapter + "
            "(L − P)·kv_fill (the weights it read; checks left out): what the layers the "
            "hardware ran allow when a pass is bound by reading weights. *ideal (token)*: the "
            "same with each token paying only its own exit layer (compute-bound). "
            "*layers/iteration*: decoder layers per decode pass (a layer counts once if any "
            "row ran it); *layers/token*: summed over rows; *exit layer*: mean over decode "
            "tokens. *ROUGE-L*: the text against full depth's (one early divergence changes "
            "the rest); *ppl ratio*: held-out perplexity with the exits applied per token, "
            "teacher-forced, over full depth's (the same for every policy and batch).\n\n"
            + img
            + "Fastest point of each policy with a perplexity ratio ≤ "
            f"{PPL_BUDGET:g}:\n\n" + "\n".join(_summary(sweep)),
            *(_batch_table(sweep, b) for b in batches),
            "### Held-out quality per threshold\n\n" + _teacher_forced(sweep),
        ]
    )
