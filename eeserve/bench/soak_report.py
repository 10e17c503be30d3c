"""The soak benchmark's figures: per-interval records, per-load summaries and the pass checks.

Contract: ``intervals(outcomes, samples, phases, width)`` cuts the run, from the first load level
on, into ``width``-second intervals (a minute by default) and gives, per interval, the requests that
ended in it by status, TTFT and inter-token p50/p99 (ms, streamed requests that completed), the
429s' answer latency as the client saw it and as the server timed it (``server_reject_ms``: the
upper bound of the server histogram's bucket that holds p50 / p99, over the 429s answered between
the samples around the interval), the last RSS sample (MiB: the server process, its replicas, its
whole process tree), the KV blocks in use and the most found in use while the server was idle, the
client's own loop lag and how long ``/health`` took (``health_ms``: p50 / p99 / max of the probes
answered with 200; ``unanswered``: the probes that were not). ``summarize_phase`` gives the same
over one load level, the RSS growth after warm-up and the KV blocks in use once it drained.
``checks(summaries, server_up)`` compares them with the targets: at 2x capacity every request
answered (completed, 429, deadline or a planned disconnect), the p99 TTFT of accepted requests
within 3x of its value at 1x and 429s answered in under 100 ms at p99; at 1x, RSS growth after
warm-up <= 5%, no KV block in use while idle, and no outcome but completed or a planned disconnect;
under a queue bound, the 2x TTFT p99 within the bound plus one long request's service time
(``service_alone``: served alone on the idle server). ``format_summaries(result)`` is the text the
run prints: its capacity, a table row per load level and the checks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from eeserve.bench.serve import percentiles
from eeserve.bench.soak_load import STATUSES, Outcome
from eeserve.bench.soak_sample import Sample

TTFT_RATIO_2X = 3.0
REJECT_P99_MS = 100.0
RSS_GROWTH_1X = 0.05


@dataclass
class Phase:
    """One load level: ``load`` x capacity from ``start`` to ``end`` (run seconds)."""

    load: float
    rate: float
    start: float
    end: float
    drained_at: float = math.nan  # when the server was idle again after the last request ended
    idle_kv_blocks: float | None = None


def _latency(outs: list[Outcome]) -> dict[str, Any]:
    streamed = [o for o in outs if o.status == "completed" and o.stream]
    counts = {s: sum(o.status == s for o in outs) for s in STATUSES}
    return {
        "requests": len(outs),
        **counts,
        "ttft_ms": percentiles([o.ttft for o in streamed if o.ttft is not None], (50, 99)),
        "itl_ms": percentiles([x for o in streamed for x in o.itls], (50, 99)),
        "rejected_by_proxy": sum(o.rejected_by == "proxy" for o in outs),
        # Which limit refused, and whether long prompts bear the refusals: how to size the limits.
        "rejected_by_limit": {
            lim: sum(o.rejected_limit == lim for o in outs)  # set on 429s only
            for lim in ("requests", "tokens", "queue_seconds")
        },
        "by_kind": {
            kind: {
                "requests": sum(o.kind == kind for o in outs),
                "rejected": sum(o.kind == kind and o.status == "rejected" for o in outs),
            }
            for kind in ("short", "long")
        },
        "reject_ms": percentiles(
            [o.reject_latency for o in outs if o.reject_latency is not None], (50, 99)
        ),
    }


def server_reject_ms(samples: list[Sample], lo: float, hi: float) -> dict[str, float]:
    """p50 / p99 of the server-timed 429s answered between run seconds ``lo`` and ``hi``, as the
    upper bound (ms) of the bucket that holds each (``inf`` above the last bucket; NaN: none)."""
    before = [s.reject_buckets for s in samples if s.t < lo and s.reject_buckets]
    inside = [s.reject_buckets for s in samples if lo <= s.t < hi and s.reject_buckets]
    out = {"p50": math.nan, "p99": math.nan}
    if not inside:
        return out
    base, end = (before[-1] if before else {}), inside[-1]
    counts = sorted((le, n - base.get(le, 0.0)) for le, n in end.items())
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return out
    for key, q in (("p50", 0.50), ("p99", 0.99)):
        out[key] = next(le for le, n in counts if n >= q * total) * 1000
    return out


def client_lag(lags: list[tuple[float, float]], lo: float, hi: float) -> dict[str, float]:
    """p99 and most of the client's loop lag between run seconds ``lo`` and ``hi``, in ms."""
    xs = [lag for t, lag in lags if lo <= t < hi]
    return {**percentiles(xs, (99,)), "max": max(xs) * 1000 if xs else math.nan}


def health_ms(health: list[tuple[float, float | None]], lo: float, hi: float) -> dict[str, float]:
    """p50, p99 and most of the ``/health`` probes started between run seconds ``lo`` and
    ``hi`` (ms), and how many got no 200 (``unanswered``)."""
    probes = [took for t, took in health if lo <= t < hi]
    answered = [x for x in probes if x is not None]
    return {
        **percentiles(answered, (50, 99)),
        "max": max(answered) * 1000 if answered else math.nan,
        "unanswered": sum(x is None for x in probes),
    }


def _last(samples: list[Sample], key: str) -> float | None:
    values = [getattr(s, key) for s in samples if getattr(s, key) is not None]
    return values[-1] if values else None


def intervals(
    outcomes: list[Outcome],
    samples: list[Sample],
    lags: list[tuple[float, float]],
    health: list[tuple[float, float | None]],
    phases: list[Phase],
    width: float,
) -> list[dict[str, Any]]:
    ends = [p.end for p in phases] + [p.drained_at for p in phases if not math.isnan(p.drained_at)]
    begin = phases[0].start if phases else 0.0
    rows = []
    for k in range(math.ceil((max(ends, default=begin) - begin) / width)):
        lo, hi = begin + k * width, begin + (k + 1) * width
        outs = [o for o in outcomes if lo <= o.ended < hi]
        smp = [s for s in samples if lo <= s.t < hi]
        idle = [s.kv_blocks_used for s in smp if s.idle and s.kv_blocks_used is not None]
        used = [s.kv_blocks_used for s in smp if s.kv_blocks_used is not None]
        load = next((p.load for p in phases if p.start <= lo < p.end), None)
        rows.append(
            {
                "t_s": lo,
                "load": load,
                **_latency(outs),
                "rss_server_mib": _last(smp, "rss_server_mib"),
                "rss_replicas_mib": _last(smp, "rss_replicas_mib"),
                "rss_tree_mib": _last(smp, "rss_tree_mib"),
                "kv_blocks_used_max": max(used) if used else None,
                "kv_blocks_used_idle_max": max(idle) if idle else None,
                "server_reject_ms": server_reject_ms(samples, lo, hi),
                "client_lag_ms": client_lag(lags, lo, hi),
                "health_ms": health_ms(health, lo, hi),
            }
        )
    return rows


def summarize_phase(
    phase: Phase,
    outs: list[Outcome],
    samples: list[Sample],
    lags: list[tuple[float, float]],
    health: list[tuple[float, float | None]],
    warmup: float,
) -> dict[str, Any]:
    """``outs``: the requests this load level sent (a client that falls behind its arrival
    times may start some after the level's end; they still count here)."""
    smp = [s for s in samples if phase.start <= s.t <= phase.end]
    after = [s for s in smp if s.t >= phase.start + warmup]
    growth: dict[str, float | None] = {}
    for key in ("rss_server_mib", "rss_replicas_mib", "rss_tree_mib"):
        vals = [getattr(s, key) for s in after if getattr(s, key) is not None]
        growth[key] = (vals[-1] - vals[0]) / vals[0] if len(vals) >= 2 and vals[0] else None
    idle = [s.kv_blocks_used for s in smp if s.idle and s.kv_blocks_used is not None]
    return {
        "load": phase.load,
        "rate_per_s": phase.rate,
        "duration_s": phase.end - phase.start,
        **_latency(outs),
        "rss_growth_after_warmup": growth,
        "rss_tree_mib_first_last": [_first(after, "rss_tree_mib"), _last(after, "rss_tree_mib")],
        "kv_blocks_used_idle_max": max(idle) if idle else None,
        "kv_blocks_used_after_drain": phase.idle_kv_blocks,
        "drain_s": phase.drained_at - phase.end,
        "server_reject_ms": server_reject_ms(samples, phase.start, _drained(phase)),
        "client_lag_ms": client_lag(lags, phase.start, phase.end),
        "health_ms": health_ms(health, phase.start, _drained(phase)),
        "errors": _errors(outs),
    }


def _drained(phase: Phase) -> float:
    """Just past the sample that found the server idle after ``phase`` (its end if none did)."""
    last = phase.end if math.isnan(phase.drained_at) else phase.drained_at
    return math.nextafter(last, math.inf)


def _errors(outs: list[Outcome], most: int = 8) -> dict[str, int]:
    """What failed, hung or hit its deadline said, by message (the first ``most`` messages)."""
    counts: dict[str, int] = {}
    for o in outs:
        if o.status in ("failed", "hung", "deadline") and o.error:
            key = f"{o.status}: {o.error[:160]}"
            if key in counts or len(counts) < most:
                counts[key] = counts.get(key, 0) + 1
    return counts


def _first(samples: list[Sample], key: str) -> float | None:
    values = [getattr(s, key) for s in samples if getattr(s, key) is not None]
    return values[0] if values else None


def service_alone(out: Outcome) -> dict[str, Any]:
    """A request served alone on the idle server: how it ended, its TTFT and its whole time
    (ms): one request's service time."""
    ttft = math.nan if out.ttft is None else out.ttft * 1000
    return {"status": out.status, "ttft_ms": ttft, "total_ms": (out.ended - out.sent) * 1000}


def checks(
    summaries: list[dict[str, Any]],
    server_up: bool,
    queue_bound_s: float | None = None,
    alone: Outcome | None = None,
) -> dict[str, Any]:
    """The targets (module docstring); with the server's queue bound (``queue_bound_s``,
    ``eeserve_admission_limit{limit="queue_seconds"}``) and a long request served ``alone``, also
    whether the 2x TTFT p99 stays within the bound plus that request's service time."""
    by_load = {s["load"]: s for s in summaries}
    out: dict[str, Any] = {"server_up_at_end": server_up}
    one, two = by_load.get(1.0), by_load.get(2.0)
    bound = math.inf if queue_bound_s is None else queue_bound_s
    served = alone is not None and alone.status == "completed"
    if two is not None and math.isfinite(bound) and alone is not None and served:
        within = bound * 1000 + service_alone(alone)["total_ms"]
        out["2x_ttft_p99_bound_ms"] = within
        out["2x_ttft_p99_within_queue_bound"] = two["ttft_ms"]["p99"] <= within
    if two is not None:
        out["2x_every_request_answered"] = two["failed"] == 0 and two["hung"] == 0
        if one is not None:
            ratio = two["ttft_ms"]["p99"] / one["ttft_ms"]["p99"]
            out["2x_ttft_p99_over_1x"] = ratio
            out["2x_ttft_p99_within_3x"] = ratio <= TTFT_RATIO_2X
        p99 = two["reject_ms"]["p99"]
        out["2x_reject_p99_ms"] = p99
        out["2x_client_lag_p99_ms"] = two["client_lag_ms"]["p99"]
        out["2x_server_reject_p99_ms_at_most"] = two["server_reject_ms"]["p99"]
        out["2x_reject_p99_under_100ms"] = None if math.isnan(p99) else p99 < REJECT_P99_MS
    if one is not None:
        growth = [
            g
            for key in ("rss_server_mib", "rss_replicas_mib")
            if (g := one["rss_growth_after_warmup"][key]) is not None
        ]
        out["1x_rss_growth_max"] = max(growth) if growth else None
        out["1x_rss_growth_within_5pct"] = max(growth) <= RSS_GROWTH_1X if growth else None
        idle = [one["kv_blocks_used_idle_max"], one["kv_blocks_used_after_drain"]]
        out["1x_kv_blocks_zero_when_idle"] = all(v in (0, None) for v in idle) and any(
            v is not None for v in idle
        )
        errors = one["rejected"] + one["deadline"] + one["failed"] + one["hung"]
        out["1x_errors_other_than_disconnects"] = errors
    return out


def format_summaries(result: dict[str, Any]) -> str:
    """The run's capacity, one line per load level's summary and the checks, as printed."""
    head = (
        f"{'load':>5} {'req/s':>6} {'sent':>5} {'done':>5} {'429':>5} {'dline':>5} "
        f"{'disc':>5} {'fail':>4} {'hung':>4} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} "
        f"{'429 p99':>7} {'srv<=':>6} {'idle KV':>7} {'lag p99':>7}"
    )
    cap = result["capacity"]
    rate = cap["requests_per_s"]
    rated = "no 1x rate (bursts alone)" if rate is None else f"capacity {rate:.3f} requests/s"
    if cap.get("throughput_per_s") is not None:
        rated += f" ({cap['utilization']:g} of {cap['throughput_per_s']:.3f} measured)"
    priority = result.get("client_priority", "normal")
    lines = [f"{rated}; client priority {priority}", head]
    for s in result["summaries"]:
        t, i = s["ttft_ms"], s["itl_ms"]
        lines.append(
            f"{s['load']:>5g} {s['rate_per_s']:>6.2f} {s['requests']:>5} {s['completed']:>5} "
            f"{s['rejected']:>5} {s['deadline']:>5} {s['disconnected']:>5} {s['failed']:>4} "
            f"{s['hung']:>4} {t['p50']:>8.0f}/{t['p99']:<8.0f} {i['p50']:>7.1f}/{i['p99']:<7.1f} "
            f"{s['reject_ms']['p99']:>7.1f} {s['server_reject_ms']['p99']:>6g} "
            f"{s['kv_blocks_used_after_drain']!s:>7} "
            f"{s['client_lag_ms']['p99']:>7.1f}"
        )
    lines.append("checks: " + json.dumps(result["checks"]))
    return "\n".join(lines)
