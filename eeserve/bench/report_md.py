"""Markdown of ``eeserve bench report``: the raw figures of ``report.json`` as tables.

Contract: ``render(results, plots)`` is a pure function of the results dict (as written to
``report.json``) and the plot file names; it states the command, machine, model, dtype and prompt
set, and puts every speed figure next to the quality it came with. ``headline_table`` is the
compact table the README quotes.
"""

from __future__ import annotations

from typing import Any

from eeserve.bench.plots import layer_axis
from eeserve.bench.report_paper_md import paper_sweep_section
from eeserve.bench.report_peer import peer_section
from eeserve.bench.report_spec import speculative_section

Row = dict[str, Any]


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ratio(x: float) -> str:
    return f"{x:.2f}×"


def _op(meta: dict[str, Any]) -> str:
    op = meta["operating_point"]
    return f"`{op['measure']}` ≥ {op['threshold']:g} ({op['source']})"


def _repeats(meta: dict[str, Any]) -> str:
    done, planned = meta["repeats_done"], meta["repeats"]
    budget = meta["config"]["time_budget_min"]
    return str(done) if done == planned else f"{done} (of {planned}: {budget:g}-minute budget)"


def setup_section(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m, p, xc = meta["machine"], meta["prompts"], meta["exit_config"]
    skipped = meta["skipped_batch_sizes"]
    load = meta.get("load_average") or {}
    cal = ", ".join(
        f"{c.get('measure')} δ={c.get('delta')}: {c.get('threshold')}" for c in xc["calibration"]
    )
    rows = [
        [
            "machine",
            f"{m['platform']}; {m['processor']}; {m['os_cpu_count']} CPUs visible, "
            f"{m['torch_threads']} torch threads; torch {m['torch']}; device {m['device']}"
            + (f" ({m['cuda']})" if m.get("cuda") else ""),
        ],
        [
            "load average (1 min)",
            f"{load.get('start')} at the start, {load.get('end')} at the end "
            f"(other work on the machine; {m['os_cpu_count']} CPUs)",
        ],
        ["code", f"eeserve {meta.get('git_revision') or 'unknown revision'}"],
        ["model", f"`{meta['model']}` ({meta['num_layers']} layers), `{meta['model_path']}`"],
        ["dtype", meta["dtype"]],
        [
            "exit heads",
            f"{xc['head']} head, exit layers {xc['exit_layers']}, classifier probes "
            f"{'yes' if xc['classifier'] else 'no'}, default measure `{xc['default_measure']}`, "
            f"thresholds {xc['thresholds'] or 'none'}, calibration {cal or 'none'}",
        ],
        [
            "prompts",
            f"{p['count']} prompts from `{p['source']}(split={p['split']!r}, "
            f"seed={p['seed']})`, {p['format']} format, {p['tokens_min']}–{p['tokens_max']} tokens "
            f"(median {p['tokens_median']:g})",
        ],
        [
            "generation",
            f"greedy, EOS ignored: {meta['max_tokens']} new tokens per request; "
            f"median of {_repeats(meta)} interleaved repeat(s)",
        ],
        [
            "batch sizes",
            ", ".join(map(str, meta["batch_sizes"]))
            + (f" (skipped, not enough memory: {skipped})" if skipped else ""),
        ],
        ["operating point", _op(meta)],
        ["wall time", ", ".join(f"{k} {v:.0f} s" for k, v in meta["wall_s"].items())],
    ]
    return "## Setup\n\n" + _table(["", ""], rows)


def headline_table(results: dict[str, Any]) -> str:
    """Per batch size: HF, full depth, and early exit per policy/strategy with its ROUGE-L."""
    configs = list(dict.fromkeys((r["policy"], r["kv_fill"]) for r in results["paper"]))
    hf = {r["batch"]: r for r in results["hf"]}
    head = ["batch", "HF tok/s", "full depth tok/s"] + [f"{p} / {f}" for p, f in configs]
    rows = []
    for full in results["full_depth"]:
        b = full["batch"]
        cells = [str(b), f"{hf[b]['decode_tok_s']:.1f}" if b in hf else "–"]
        cells.append(f"{full['decode_tok_s']:.1f}")
        for p, f in configs:
            r = next(
                r for r in results["paper"] if (r["batch"], r["policy"], r["kv_fill"]) == (b, p, f)
            )
            cells.append(f"{_ratio(r['ratio'])} (ROUGE-L {r['rouge_l']:.2f})")
        rows.append(cells)
    return _table(head, rows)


def _verdicts(results: dict[str, Any]) -> list[str]:
    paper = results["paper"]
    slower = [r for r in paper if r["ratio"] < 1]
    out = [
        f"- Early exit at {_op(results['meta'])} is **slower** than full depth in "
        f"{len(slower)} of {len(paper)} policy/strategy/batch settings."
        if slower
        else f"- Early exit at {_op(results['meta'])} is faster than full depth in every setting."
    ]
    by_measure: dict[str, list[Row]] = {}
    for r in results["frontier"]:
        by_measure.setdefault(r["measure"], []).append(r)
    for m, rows in by_measure.items():
        good = [r for r in rows if r["rouge_l"] >= 0.9]
        if good:
            best = max(good, key=lambda r: r["ratio"])
            out.append(
                f"- `{m}`: fastest point with ROUGE-L ≥ 0.9 is threshold {best['threshold']:g}: "
                f"{_ratio(best['ratio'])} full depth (ROUGE-L {best['rouge_l']:.3f}, "
                f"token agreement {best['token_agreement']:.3f})."
            )
        else:
            best = max(rows, key=lambda r: r["rouge_l"])
            out.append(
                f"- `{m}`: no threshold reaches ROUGE-L 0.9; the best is {best['rouge_l']:.3f} "
                f"(threshold {best['threshold']:g}, {_ratio(best['ratio'])} full depth)."
            )
    return out


def _ee_cells(r: Row) -> list[str]:
    t = r["telemetry"]
    return [
        f"{r['decode_tok_s']:.1f}",
        f"{r['full_decode_tok_s']:.1f}",
        f"**{_ratio(r['ratio'])}**",
        f"{r['itl_ms']:.1f} / {r['full_itl_ms']:.1f}",
        f"{r['token_agreement']:.3f}",
        f"{r['rouge_l']:.3f}",
        f"{t['mean_layers_per_token']:.1f}",
    ]


_EE_HEAD = [
    "EE tok/s",
    "full tok/s",
    "ratio",
    "ITL ms EE / full",
    "token agreement",
    "ROUGE-L",
    "layers/token",
]


def paper_section(results: dict[str, Any]) -> str:
    rows = [[str(r["batch"]), r["policy"], r["kv_fill"], *_ee_cells(r)] for r in results["paper"]]
    return (
        f"## 1. Early exit vs full depth\n\nOperating point {_op(results['meta'])}; decode "
        "tokens/s (after each request's first token), mean inter-token latency per request; "
        "ratio = early exit / full depth, same engine, same prompts, same repeats; quality of "
        "the early-exit text against the full-depth text.\n\n"
        + _table(["batch", "policy", "KV debt", *_EE_HEAD], rows)
    )


def frontier_section(results: dict[str, Any], plot: str | None) -> str:
    meta, rows = results["meta"], results["frontier"]
    cfg = f"{rows[0]['policy']} / {rows[0]['kv_fill']}" if rows else ""
    body = [
        [r["measure"], f"{r['threshold']:g}", r["source"], *_ee_cells(r)]
        for r in sorted(rows, key=lambda r: (r["measure"], r["threshold"]))
    ]
    img = f"![frontier]({plot})\n\n" if plot else ""
    return (
        f"## 2. Frontier: speed vs quality\n\nBatch {meta['frontier_batch']}, {cfg}; one "
        f"curve per confidence measure.\n\n{img}"
        + _table(["measure", "threshold", "source", *_EE_HEAD], body)
    )


def hf_section(results: dict[str, Any], plot: str | None) -> str:
    rows = [
        [
            str(r["batch"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r['itl_ms']:.1f}",
            f"{r['engine_full_decode_tok_s']:.1f}",
            _ratio(r["engine_vs_hf"]),
            f"{r['token_agreement_engine_vs_hf']:.3f}",
        ]
        for r in results["hf"]
    ]
    img = f"![throughput]({plot})\n\n" if plot else ""
    text = "HF transformers `generate` (greedy, left-padded batch) on the same weights and prompts."
    table = (
        _table(
            [
                "batch",
                "HF tok/s",
                "HF ITL ms",
                "engine full-depth tok/s",
                "engine / HF",
                "token agreement engine vs HF",
            ],
            rows,
        )
        if rows
        else "(HF baseline not run: `--no-hf`)"
    )
    return f"## 3. Baseline: HF transformers\n\n{img}{text}\n\n{table}"


def telemetry_section(results: dict[str, Any], plot: str | None) -> str:
    runs = [(f"{r['policy']} / {r['kv_fill']}, batch {r['batch']}", r) for r in results["paper"]]
    runs += [(f"frontier {r['measure']} ≥ {r['threshold']:g}", r) for r in results["frontier"]]
    layers = layer_axis(results)
    rows = []
    for label, r in runs:
        t = r["telemetry"]
        rows.append(
            [label, str(t["tokens"])]
            + [str(t["histogram"].get(str(lay), 0)) for lay in layers]
            + [f"{t['mean_layers_per_token']:.2f}", f"{t['layers_saved_fraction']:.1%}"]
        )
    img = f"![exit layers]({plot})\n\n" if plot else ""
    return (
        "## 4. Exit telemetry\n\nGenerated tokens per exit layer (the first token of every "
        f"request comes from the prefill, at layer {results['meta']['num_layers']}).\n\n{img}"
        + _table(
            ["run", "tokens", *[f"L{x}" for x in layers], "layers/token", "layers saved"], rows
        )
    )


def render(results: dict[str, Any], plots: list[str]) -> str:
    meta = results["meta"]
    plot = {name.split(".")[0]: name for name in plots}
    note = f"> **Note:** {meta['config']['note']}\n\n" if meta["config"].get("note") else ""
    parts = [
        f"# Early-exit benchmark report: `{meta['model']}`\n\n{note}"
        f"Command: `{meta['command']}`\n\nAll options: `{meta['canonical_command']}`\n\n"
        f"Started {meta['started']}. Absolute figures compare only within this report; ratios "
        "are measured side by side in the same run.",
        setup_section(results),
    ]
    if "paper" in results:
        parts += _exit_sections(results, plot)
    if "speculative" in results:
        parts.append(speculative_section(results))
    if "paper_sweep" in results:
        parts.append(paper_sweep_section(results, plot.get("paper_sweep")))
    if "peer" in results:
        parts.append(peer_section(results))
    return "\n\n".join(parts) + "\n"


def _exit_sections(results: dict[str, Any], plot: dict[str, str]) -> list[str]:
    return [
        "## Headline\n\nDecode tokens/s; early exit as speed ratio against full depth "
        "(> 1 is faster) with the ROUGE-L of its text against full depth.\n\n"
        + headline_table(results)
        + "\n\n"
        + "\n".join(_verdicts(results)),
        paper_section(results),
        frontier_section(results, plot.get("frontier")),
        hf_section(results, plot.get("throughput")),
        telemetry_section(results, plot.get("exit_layers")),
    ]
