"""The soak's bursts: many requests at once, every few seconds, and what each burst saw.

Contract: ``bursts(client, mix, size, every, duration, t0, hard_timeout)`` sends ``size`` requests
of the mix at once every ``every`` seconds while ``duration`` seconds run (the first at once; each
over ``size`` connections the client opened before it, as a load balancer's pool holds them), waits
until every one has ended and returns one ``Burst`` per burst: its start (run seconds since ``t0``)
and its outcomes. ``burst_record(burst, lags, health, window)`` sums one up over the ``window``
seconds from its start: its requests by status; the time to each 429 and to each streamed request's
first token, from the request's own start (``reject_ms``, ``ttft_ms``) and from the burst's start
(``reject_from_burst_ms``, ``ttft_from_burst_ms``: what a client that sent them all at once waits,
the client's own work to send them included), p50 / p99 / max; the 429s without a ``Retry-After``;
answers with a 5xx status; the client's own loop lag (p99, max) and how long ``/health`` took
meanwhile (p50, p99, max; ``unanswered``: probes without a 200). ``burst_checks(records,
kv_blocks_after)`` compares them with the targets: every request answered (completed, 429, deadline
or a planned disconnect), 429s in at most ``REJECT_P50_MS`` at p50 and ``REJECT_P99_MS`` at p99
(from each request's start), every 429 with ``Retry-After``, no 5xx, no KV block in use once the
server drained, and ``/health`` answered within ``HEALTH_MS`` throughout. ``format_bursts(records)``
is a line per burst, as printed. Times are ``time.perf_counter()`` seconds since ``t0``.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from eeserve.bench.serve import percentiles
from eeserve.bench.soak_http import LeanClient
from eeserve.bench.soak_load import STATUSES, LoadClient, Mix, Outcome, send
from eeserve.bench.soak_report import client_lag, health_ms

REJECT_P50_MS = 20.0
REJECT_P99_MS = 100.0
HEALTH_MS = 100.0
_PS = (50, 99, 100)  # nearest rank: p100 is the most
_SETTLE_S = 0.5  # after opening a burst's connections, for the server to take them all in


@dataclass
class Burst:
    start: float
    outcomes: list[Outcome]


async def bursts(
    client: LoadClient,
    mix: Mix,
    size: int,
    every: float,
    duration: float,
    t0: float,
    hard_timeout: float,
) -> list[Burst]:
    """``size`` requests at once every ``every`` seconds for ``duration`` seconds; each burst's
    start and outcomes once all have ended (none when ``size`` is 0)."""
    if size <= 0:
        return []
    begin = time.perf_counter()
    started: list[tuple[float, asyncio.Future[list[Outcome]]]] = []
    k = 0
    while k * every < duration:
        await asyncio.sleep(max(0.0, begin + k * every - time.perf_counter()))
        # Built, and their connections open, before the clock starts: the burst is its requests
        # leaving, not the client building them or the kernels shaking hands.
        reqs = [mix.draw() for _ in range(size)]
        if isinstance(client, LeanClient):
            await client.preconnect(size)
            await asyncio.sleep(_SETTLE_S)
        start = time.perf_counter() - t0
        tasks = [send(client, r, t0, hard_timeout) for r in reqs]
        started.append((start, asyncio.gather(*tasks)))
        k += 1
    await asyncio.sleep(max(0.0, begin + duration - time.perf_counter()))
    return [Burst(start, list(await outs)) for start, outs in started]


def _ms(values: list[float]) -> dict[str, float]:
    out = percentiles(values, _PS)
    out["max"] = out.pop("p100")
    return out


def burst_record(
    burst: Burst,
    lags: list[tuple[float, float]],
    health: list[tuple[float, float | None]],
    window: float,
) -> dict[str, Any]:
    outs = burst.outcomes
    lo, hi = burst.start, burst.start + window
    rejected = [o for o in outs if o.status == "rejected" and o.reject_latency is not None]
    streamed = [o for o in outs if o.ttft is not None]
    probes = health_ms(health, lo, hi)
    return {
        "t_s": burst.start,
        "requests": len(outs),
        **{s: sum(o.status == s for o in outs) for s in STATUSES},
        "reject_ms": _ms([o.reject_latency for o in rejected if o.reject_latency is not None]),
        "reject_from_burst_ms": _ms(
            [o.sent - lo + o.reject_latency for o in rejected if o.reject_latency is not None]
        ),
        "ttft_ms": _ms([o.ttft for o in streamed if o.ttft is not None]),
        "ttft_from_burst_ms": _ms([o.sent - lo + o.ttft for o in streamed if o.ttft is not None]),
        "rejected_without_retry_after": sum(o.retry_after is None for o in rejected),
        "server_errors": sum((o.http_status or 0) >= 500 for o in outs),
        "client_lag_ms": client_lag(lags, lo, hi),
        "health_ms": probes,
    }


def burst_checks(
    records: list[dict[str, Any]], kv_blocks_after: list[float | None]
) -> dict[str, Any]:
    """The bursts' targets (see the module docstring), over every burst of the run."""
    if not records:
        return {}
    rejects = [r["reject_ms"] for r in records if r["rejected"]]
    p50 = max((x["p50"] for x in rejects), default=math.nan)
    p99 = max((x["p99"] for x in rejects), default=math.nan)
    health = max(r["health_ms"]["max"] for r in records)
    return {
        "burst_every_request_answered": all(r["failed"] == r["hung"] == 0 for r in records),
        "burst_reject_p50_ms_most": p50,
        "burst_reject_p99_ms_most": p99,
        "burst_reject_p50_within": None if math.isnan(p50) else p50 <= REJECT_P50_MS,
        "burst_reject_p99_within": None if math.isnan(p99) else p99 <= REJECT_P99_MS,
        "burst_every_429_with_retry_after": all(
            r["rejected_without_retry_after"] == 0 for r in records
        ),
        "burst_no_5xx": all(r["server_errors"] == 0 for r in records),
        "burst_kv_blocks_zero_after": all(v == 0 for v in kv_blocks_after),
        "burst_health_max_ms": health,
        "burst_health_within": health <= HEALTH_MS
        and all(r["health_ms"]["unanswered"] == 0 for r in records),
    }


def format_bursts(records: list[dict[str, Any]]) -> str:
    """A line per burst: when, what it got, its 429s' and first tokens' times, /health, lag."""
    lines = [
        f"{'burst at s':>10} {'sent':>5} {'done':>5} {'429':>5} {'5xx':>4} "
        f"{'429 p50/p99/max ms':>20} {'TTFT p50/p99 ms':>17} {'health p99/max':>15} "
        f"{'lag max':>7}"
    ]
    for r in records:
        rj, tt, h = r["reject_ms"], r["ttft_ms"], r["health_ms"]
        lines.append(
            f"{r['t_s']:>10.1f} {r['requests']:>5} {r['completed']:>5} {r['rejected']:>5} "
            f"{r['server_errors']:>4} {rj['p50']:>6.1f}/{rj['p99']:>6.1f}/{rj['max']:<6.1f} "
            f"{tt['p50']:>8.0f}/{tt['p99']:<8.0f} {h['p99']:>7.1f}/{h['max']:<7.1f} "
            f"{r['client_lag_ms']['max']:>7.1f}"
        )
    return "\n".join(lines)
