"""PNG plots of ``eeserve bench report`` (matplotlib, Agg canvas: no display needed).

Contract: ``plot_all(results, out)`` writes ``frontier.png`` (speed ratio against ROUGE-L and
token agreement, one curve per measure), ``throughput.png`` (decode tokens/s and inter-token
latency by batch size: full depth, early exit per policy and KV-debt strategy, HF) and
``exit_layers.png`` (share of generated tokens per exit layer at the operating point) and, with
the paper section, ``paper_sweep.png`` (speed against quality per policy and batch size) from the
results dict of ``report.json``, and returns their paths. No global pyplot state is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Row = dict[str, Any]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def frontier(results: dict[str, Any], path: Path) -> Path:
    rows = results["frontier"]
    meta = results["meta"]
    fig = Figure(figsize=(11, 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    by_measure: dict[str, list[Row]] = {}
    for r in rows:
        by_measure.setdefault(r["measure"], []).append(r)
    for ax, key, label in zip(axes, ("rouge_l", "token_agreement"), ("ROUGE-L", "token agreement")):
        for measure, pts in sorted(by_measure.items()):
            pts = sorted(pts, key=lambda r: r["threshold"])
            (line,) = ax.plot([r[key] for r in pts], [r["ratio"] for r in pts], "o-", label=measure)
            for r in pts:
                star = r["source"] != "sweep"
                if star:
                    ax.plot(r[key], r["ratio"], "*", ms=14, color=line.get_color())
                ax.annotate(
                    f"{r['threshold']:g}",
                    (r[key], r["ratio"]),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.axhline(1.0, color="black", ls="--", lw=1)
        ax.plot([1.0], [1.0], "ks")
        ax.annotate(
            "full depth", (1.0, 1.0), fontsize=8, xytext=(-50, -12), textcoords="offset points"
        )
        ax.set_xlabel(f"{label} vs full-depth text")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode speed / full depth")
    axes[0].legend(fontsize=8, title="measure (★ default/calibrated)", title_fontsize=8)
    first = rows[0] if rows else {"policy": "", "kv_fill": ""}
    fig.suptitle(
        f"{meta['model']}: early-exit frontier, batch {meta['frontier_batch']}, "
        f"{first['policy']} / {first['kv_fill']}, {meta['max_tokens']} tokens (labels: thresholds)",
        fontsize=10,
    )
    return _save(fig, path)


def throughput(results: dict[str, Any], path: Path) -> Path:
    meta = results["meta"]
    fig = Figure(figsize=(11, 4.5))
    ax_tps, ax_itl = fig.subplots(1, 2)
    series: list[tuple[str, list[Row], dict[str, Any]]] = [
        ("full depth", results["full_depth"], {"color": "black", "lw": 2}),
    ]
    configs = list(dict.fromkeys((r["policy"], r["kv_fill"]) for r in results["paper"]))
    for p, f in configs:
        rows = [r for r in results["paper"] if (r["policy"], r["kv_fill"]) == (p, f)]
        style = {"ls": "-" if f == "fill" else ":"}
        series.append((f"early exit {p} / {f}", rows, style))
    if results["hf"]:
        series.append(("HF generate", results["hf"], {"color": "gray", "ls": "--"}))
    for label, rows, style in series:
        bs = [r["batch"] for r in rows]
        ax_tps.plot(bs, [r["decode_tok_s"] for r in rows], marker="o", label=label, **style)
        ax_itl.plot(bs, [r["itl_ms"] for r in rows], marker="o", label=label, **style)
    for ax, ylabel in ((ax_tps, "decode tokens/s"), (ax_itl, "mean inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(meta["batch_sizes"], [str(b) for b in meta["batch_sizes"]])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_tps.legend(fontsize=8)
    op = meta["operating_point"]
    fig.suptitle(
        f"{meta['model']} ({meta['dtype']}): throughput by batch size; early exit at "
        f"{op['measure']} ≥ {op['threshold']:g}",
        fontsize=10,
    )
    return _save(fig, path)


def exit_layers(results: dict[str, Any], path: Path) -> Path:
    meta = results["meta"]
    batch = max(meta["batch_sizes"])
    rows = [r for r in results["paper"] if r["batch"] == batch]
    layers = layer_axis(results)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        t = r["telemetry"]
        share = [t["histogram"].get(str(x), 0) / max(1, t["tokens"]) for x in layers]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(layers))]
        label = f"{r['policy']} / {r['kv_fill']} ({t['mean_layers_per_token']:.1f} layers/token)"
        ax.bar(xs, share, width, label=label)
    ax.set_xticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xlabel(f"exit layer ({meta['num_layers']} = full depth, incl. each prefill token)")
    ax.set_ylabel("share of generated tokens")
    ax.legend(fontsize=8, loc="upper left")
    op = meta["operating_point"]
    ax.set_title(
        f"{meta['model']}: exit layers at {op['measure']} ≥ {op['threshold']:g}, batch {batch}",
        fontsize=10,
    )
    return _save(fig, path)


def layer_axis(results: dict[str, Any]) -> list[int]:
    """The model's exit layers and full depth, plus any other layer a run exited at."""
    meta = results["meta"]
    seen = {
        int(k) for r in results["paper"] + results["frontier"] for k in r["telemetry"]["histogram"]
    }
    return sorted(seen | set(meta["exit_config"]["exit_layers"]) | {meta["num_layers"]})


def paper_sweep(results: dict[str, Any], path: Path) -> Path:
    """Per batch size (columns): speed ratio against ROUGE-L (top) and against the teacher-forced
    perplexity ratio (bottom), a curve per policy over the thresholds, and dashed beside it the
    same points at the policy's ``ideal_pass`` (what the layers it ran allow)."""
    sweep, meta = results["paper_sweep"], results["meta"]
    batches = sorted({r["batch"] for r in sweep["rows"]})
    measures = list(dict.fromkeys(x["measure"] for x in sweep["settings"]))
    fig = Figure(figsize=(4.2 * max(1, len(batches)), 8))
    axes = fig.subplots(2, max(1, len(batches)), squeeze=False)
    for col, b in enumerate(batches):
        for row, (key, label) in enumerate(
            (
                ("rouge_l", "ROUGE-L vs full-depth text"),
                ("ppl_ratio", "held-out perplexity / full depth's (teacher-forced)"),
            )
        ):
            ax = axes[row][col]
            for i, policy in enumerate(sweep["policies"]):
                for marker, measure in zip("os^Dv", measures):
                    pts = [
                        r
                        for r in sweep["rows"]
                        if (r["batch"], r["policy"], r["measure"]) == (b, policy, measure)
                    ]
                    pts.sort(key=lambda r: -r["threshold"])
                    xs = [r[key] for r in pts]
                    color = f"C{i}"
                    name = policy if len(measures) == 1 else f"{policy}, {measure}"
                    ax.plot(xs, [r["ratio"] for r in pts], marker=marker, color=color, label=name)
                    ax.plot(xs, [r["ideal_pass"] for r in pts], "x--", color=color, lw=1)
                    for r in pts:
                        ax.annotate(
                            f"{r['threshold']:g}",
                            (r[key], r["ratio"]),
                            fontsize=6,
                            xytext=(3, 3),
                            textcoords="offset points",
                        )
            ax.axhline(1.0, color="black", ls=":", lw=1)
            ax.set_xlabel(label, fontsize=8)
            ax.set_title(f"batch {b}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][col].invert_xaxis()  # quality falls to the right, as the perplexity ratio rises
    axes[0][0].set_ylabel("decode speed / full depth")
    axes[1][0].set_ylabel("decode speed / full depth")
    axes[0][0].legend(fontsize=7, title="policy (x--: its ideal_pass)", title_fontsize=7)
    fig.suptitle(
        f"{meta['model']}: batch policies across thresholds (labels), {meta['max_tokens']} tokens",
        fontsize=10,
    )
    return _save(fig, path)


def plot_all(results: dict[str, Any], out: Path) -> list[Path]:
    """The plots of the sections present in ``results``."""
    paths = []
    if "paper" in results:
        paths += [
            frontier(results, out / "frontier.png"),
            throughput(results, out / "throughput.png"),
            exit_layers(results, out / "exit_layers.png"),
        ]
    if "paper_sweep" in results:
        paths.append(paper_sweep(results, out / "paper_sweep.png"))
    return paths
