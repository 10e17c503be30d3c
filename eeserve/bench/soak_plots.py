"""PNG of a soak run over time (matplotlib, Agg canvas: no display, no global pyplot state).

Contract: ``plot_soak(result, path)`` draws, per interval of the ``result`` dict that
``bench.soak`` writes: TTFT and inter-token latency p50/p99 and the client's own loop lag
(ms, log scale), requests by
outcome, RSS (MiB) and KV blocks in use (the most, and the most while idle); each load level is
shaded and labelled with its multiple of capacity. Returns ``path``.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

_OUTCOMES = (
    ("completed", "tab:green"),
    ("rejected", "tab:orange"),
    ("deadline", "tab:purple"),
    ("disconnected", "tab:gray"),
    ("failed", "tab:red"),
    ("hung", "black"),
)


def _series(rows: list[dict[str, Any]], *keys: str) -> list[float]:
    out = []
    for r in rows:
        v: Any = r
        for k in keys:
            v = None if v is None else v.get(k)
        out.append(math.nan if v is None else float(v))
    return out


def plot_soak(result: dict[str, Any], path: Path) -> Path:
    rows = result["intervals"]
    width = result["config"]["interval_s"]
    x = [(r["t_s"] + width / 2) / 60 for r in rows]  # interval midpoints, minutes
    fig = Figure(figsize=(11, 10))
    ax_lat, ax_req, ax_rss, ax_kv = fig.subplots(4, 1, sharex=True)
    for key, label, style in (
        ("ttft_ms", "TTFT", "-"),
        ("itl_ms", "inter-token", "--"),
    ):
        for p, marker in (("p50", "o"), ("p99", "^")):
            ax_lat.plot(x, _series(rows, key, p), style, marker=marker, ms=3, label=f"{label} {p}")
    lag = _series(rows, "client_lag_ms", "max")
    ax_lat.plot(x, lag, ":", color="gray", marker="x", ms=3, label="client loop lag, most")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    ax_lat.legend(fontsize=8, ncol=4)
    bottom = [0.0] * len(rows)
    for status, color in _OUTCOMES:
        counts = _series(rows, status)
        ax_req.bar(x, counts, width=width / 60 * 0.9, bottom=bottom, color=color, label=status)
        bottom = [b + (0 if math.isnan(c) else c) for b, c in zip(bottom, counts)]
    ax_req.set_ylabel(f"requests / {width:g} s")
    ax_req.legend(fontsize=8, ncol=6)
    for key, label in (
        ("rss_server_mib", "server process"),
        ("rss_replicas_mib", "replicas"),
        ("rss_tree_mib", "process tree"),
    ):
        ys = _series(rows, key)
        if any(not math.isnan(y) for y in ys):
            ax_rss.plot(x, ys, marker="o", ms=3, label=label)
    ax_rss.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax_rss.set_ylabel("RSS MiB")
    ax_rss.legend(fontsize=8)
    ax_kv.plot(x, _series(rows, "kv_blocks_used_max"), marker="o", ms=3, label="most in use")
    ax_kv.plot(x, _series(rows, "kv_blocks_used_idle_max"), "s", ms=5, label="in use when idle")
    ax_kv.set_ylabel("KV blocks")
    ax_kv.set_xlabel("minutes")
    ax_kv.legend(fontsize=8)
    for i, ph in enumerate(result["phases"]):
        for ax in (ax_lat, ax_req, ax_rss, ax_kv):
            ax.axvspan(
                ph["start"] / 60, ph["end"] / 60, color="tab:blue", alpha=0.05 + 0.05 * (i % 2)
            )
        ax_lat.annotate(
            f"{ph['load']:g}x",
            (ph["start"] / 60, 1.0),
            xycoords=("data", "axes fraction"),
            va="bottom",
            fontsize=9,
        )
    fig.suptitle("\n".join(textwrap.wrap(result["title"], 150)), fontsize=9)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
