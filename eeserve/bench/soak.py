"""``eeserve bench soak``: the server under sustained load at multiples of its capacity.

Contract: ``run_soak(args)`` runs against ``soak_server``'s server (``python -m eeserve.server
MODEL`` started on a free loopback port ``--server-nice`` below this client's priority, or, with
``--replicas N``, N Ray Serve replicas each niced once it serves; or ``--base-url`` as it is),
warms it up and takes its capacity, the 1x rate, from ``soak_capacity`` (``--utilization`` of
the saturation throughput a closed loop measures, or ``--capacity`` requests/s as given). Then,
for each ``--loads`` multiple, it sends the mix open-loop (Poisson arrivals at multiple x
capacity, whatever the server answers) for ``--duration`` seconds (one value, or one per load),
waits until every request has ended and the server is idle, and samples the server meanwhile
(``soak_sample``). The mix: ``--long-share`` of ~1.5k-token prompts (``--long-chars``), the rest
short; ``--stream-share`` streamed; ``--disconnect-share`` of clients that hang up early on
purpose; ``--chat-share`` sent as chat requests; every request asks for ``--max-tokens`` tokens
(ignore_eos). With ``--burst N`` each load level also sends N requests at once every
``--burst-every`` seconds (``soak_burst``; a load of 0 sends the bursts alone, and a run whose
loads are all 0 measures no capacity), and the JSON holds a record per burst and the bursts'
checks. ``/health`` is probed throughout (``soak_sample.HealthProbe``). It writes
``<out-dir>/<label>.json`` (``provenance``: commit, date, machine, the exact command; capacity; the
server's admission limits; the 429s it counted, by the replicas and by an ingress gate
(``rejected_by``); per-interval records; per-load summaries; the checks of
``soak_report.checks``) and ``<label>.png`` (``soak_plots``), prints the summaries
(``soak_report.format_summaries``) and returns 0, or 1 when a request failed or hung or the
server went down. Only the given base URL (default: loopback) is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from eeserve.bench.arrivals import long_prompt_texts
from eeserve.bench.soak_burst import Burst, burst_checks, burst_record, bursts, format_bursts
from eeserve.bench.soak_capacity import given_capacity, measure_capacity
from eeserve.bench.soak_http import LeanClient
from eeserve.bench.soak_load import Mix, Outcome, open_loop, send, status_counts
from eeserve.bench.soak_plots import plot_soak
from eeserve.bench.soak_report import (
    Phase,
    checks,
    format_summaries,
    intervals,
    service_alone,
    summarize_phase,
)
from eeserve.bench.soak_sample import (
    HealthProbe,
    LoopLag,
    Sampler,
    read_limits,
    read_refusals,
    realtime,
)
from eeserve.bench.soak_server import soak_server
from eeserve.tuning.prompts import prompt_texts
from eeserve.tuning.provenance import provenance


def add_soak_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "soak",
        help="overload and endurance: open-loop load at multiples of capacity",
        description=__doc__,
    )
    p.add_argument("--model", default="smollm2", help="model to serve (and the request's model)")
    p.add_argument("--base-url", default=None, help="soak this running server instead")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: for RSS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--replicas", type=int, default=None, help="serve N Ray Serve replicas")
    p.add_argument("--server-args", default="", help="extra `eeserve serve` options, quoted")
    p.add_argument(
        "--server-nice",
        type=int,
        default=10,
        help="the niceness, above this client's, of the engines of a server this command "
        "starts (the single process; with --replicas, every thread of each replica, not Ray's "
        "proxy): on a machine they share, the load generator and the proxy that turns requests "
        "away are then not starved by the engines' compute (0: equal priority)",
    )
    p.add_argument(
        "--client-priority",
        choices=("realtime", "normal"),
        default="realtime",
        help="the client's event loop at the lowest real-time priority while it runs (where "
        "permitted: root or CAP_SYS_NICE; else normal, and the JSON says why), so that the "
        "latencies it times are not its own waits for a CPU the server keeps busy",
    )
    p.add_argument("--request-timeout", type=float, default=120.0, help="the server's, seconds")
    p.add_argument("--loads", default="0.5,1,2", help="multiples of capacity, comma-separated")
    p.add_argument("--duration", default="600", help="seconds per load: one, or one per load")
    p.add_argument(
        "--capacity", type=float, default=None, help="the 1x rate, requests/s (default: measure)"
    )
    p.add_argument(
        "--utilization",
        type=_share,
        default=0.8,
        help="the share of the measured saturation throughput that is 1x: at 1, arrivals at the "
        "server's own rate queue without a steady state and now and then reach the limits",
    )
    p.add_argument("--capacity-duration", type=float, default=120.0)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--long-share", type=float, default=0.3)
    p.add_argument("--long-chars", type=int, default=6000, help="~1.5k tokens at ~4 chars/token")
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--disconnect-share", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--early-exit", default=None, help="request `early_exit` JSON (default: the model's)"
    )
    p.add_argument("--interval", type=float, default=60.0, help="seconds per record")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    _add_burst_args(p)
    p.add_argument("--out-dir", default="bench/results/soak")
    p.add_argument("--label", default=None, help="file name stem (default: from the options)")
    p.set_defaults(func=run_soak)
    return p


def _add_burst_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-share",
        type=float,
        default=0.0,
        help="the share of requests sent to /v1/chat/completions (the prompt as one user message)",
    )
    p.add_argument(
        "--burst",
        type=int,
        default=0,
        help="also send N requests at once every --burst-every seconds at each load level "
        "(a load of 0: the bursts alone); per burst, the time to each 429 and first token",
    )
    p.add_argument("--burst-every", type=float, default=5.0, help="seconds between bursts")


def _share(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def run_soak(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /metrics sample
    loads = [float(x) for x in args.loads.split(",")]
    durations = [float(x) for x in args.duration.split(",")]
    if len(durations) == 1:
        durations *= len(loads)
    if len(durations) != len(loads):
        raise ValueError("--duration takes one value or one per load")
    if min(loads) < 0 or args.burst < 0 or not args.burst_every > 0:
        raise ValueError("--loads and --burst must be >= 0 and --burst-every > 0")
    if max(loads) == 0 and not args.burst:
        raise ValueError("every load is 0 and there is no --burst: nothing to send")
    rt = args.client_priority == "realtime"
    with soak_server(args) as (base, pid), realtime(rt) as priority:
        print(f"client priority: {priority}", flush=True)
        # The imports (torch with eeserve) leave ~270k objects that each full collection walks:
        # 140 ms quiet, stalls of hundreds of ms while the server holds the cores, which every
        # latency timed meanwhile would count. The server freezes its startup heap alike; the
        # caller's heap is given back as it was.
        gc.freeze()
        try:
            result = asyncio.run(_soak(args, base, pid, loads, durations))
        finally:
            gc.unfreeze()
    result["client_priority"] = priority
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = args.label or _label(args, durations)
    result["title"] = f"{label}: {result['provenance']['command']}"
    path = out_dir / f"{label}.json"
    path.write_text(json.dumps(result, indent=1))
    plot_soak(result, out_dir / f"{label}.png")
    print(format_summaries(result))
    if result["bursts"]:
        print(format_bursts(result["bursts"]))
    print(f"wrote {path} and {label}.png")
    bad = any(s["failed"] or s["hung"] for s in result["summaries"])
    return 1 if bad or not result["checks"]["server_up_at_end"] else 0


def _label(args: argparse.Namespace, durations: list[float]) -> str:
    model = Path(args.model).name or "model"
    where = f"r{args.replicas}" if args.replicas else "single"
    dur = "-".join(f"{d:g}" for d in dict.fromkeys(durations))
    return f"soak_{model}_{where}_{dur}s"


async def _soak(
    args: argparse.Namespace, base: str, pid: int | None, loads: list[float], durations: list[float]
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    hard = args.request_timeout + 120  # past the server's own limit: the request hangs
    client = httpx.AsyncClient(base_url=base, headers=headers, timeout=hard)  # /metrics only
    async with client:
        mix = _mix(args)
        t0 = time.perf_counter()
        sampler = Sampler(client, pid, t0)
        load = LeanClient(base, headers)  # after the sampler's fork: no socket of its inherited
        run = _Watch(sampler, LoopLag(t0), HealthProbe(base, t0))
        tasks = [asyncio.create_task(run.lag.run()), asyncio.create_task(run.health.run())]
        for warm in (mix.draw(disconnects=False) for _ in range(2)):
            await send(load, warm, t0, hard)
        alone = {k: await send(load, mix.alone(k == "long"), t0, hard) for k in ("short", "long")}
        limits = read_limits((await client.get("/metrics")).text)
        needed = max(loads) > 0
        cap = await measure_capacity(args, load, mix, t0, hard) if needed else given_capacity(None)
        tasks.append(asyncio.create_task(sampler.run(args.sample_every)))
        levels = list(zip(loads, durations))
        phases, outcomes, burst_list = await _phases(
            load, mix, args, run, cap["requests_per_s"] or 0.0, levels, t0, hard
        )
        for task in tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await load.aclose()
        up = await _healthy(client)
        refused = read_refusals((await client.get("/metrics", timeout=30)).text)
    warmup = min(args.interval, 0.2 * min(durations))
    summaries = [
        summarize_phase(p, outs, sampler.samples, run.lag.samples, run.health.samples, warmup)
        for p, outs in zip(phases, outcomes)
    ]
    every = [o for outs in outcomes for o in outs]
    records = [
        burst_record(b, run.lag.samples, run.health.samples, args.burst_every) for b in burst_list
    ]
    return {
        "provenance": _provenance(),
        "config": {**_config(args), "interval_s": args.interval, "warmup_s": warmup},
        "admission_limits": limits,
        "rejected_by": refused,
        "capacity": cap,
        "alone": {k: service_alone(o) for k, o in alone.items()},
        "phases": [asdict(p) for p in phases],
        "summaries": summaries,
        "checks": {
            **checks(summaries, up, limits.get("queue_seconds"), alone["long"]),
            **burst_checks(records, [p.idle_kv_blocks for p in phases]),
        },
        "bursts": records,
        "intervals": intervals(
            every, sampler.samples, run.lag.samples, run.health.samples, phases, args.interval
        ),
        "samples": [asdict(s) for s in sampler.samples],
    }


@dataclass
class _Watch:
    """What watches a run besides its requests: the server's gauges, the client's own loop lag
    and ``/health``."""

    sampler: Sampler
    lag: LoopLag
    health: HealthProbe


async def _phases(
    client: LeanClient,
    mix: Mix,
    args: argparse.Namespace,
    run: _Watch,
    capacity: float,
    levels: list[tuple[float, float]],
    t0: float,
    hard: float,
) -> tuple[list[Phase], list[list[Outcome]], list[Burst]]:
    """Each (load, duration) level in turn: the mix open-loop at load x ``capacity`` for its
    duration, and ``--burst`` requests at once every ``--burst-every`` seconds, then until every
    request has ended and the server is idle. The phases, each one's outcomes (its bursts'
    included), and every burst."""
    phases: list[Phase] = []
    outcomes: list[list[Outcome]] = []
    every_burst: list[Burst] = []
    for load, duration in levels:
        start = time.perf_counter() - t0
        outs, sent = await asyncio.gather(
            open_loop(client, mix, load * capacity, duration, t0, hard),
            bursts(client, mix, args.burst, args.burst_every, duration, t0, hard),
        )
        phase = Phase(load, load * capacity, start, start + duration)
        idle = await run.sampler.until_idle(60)
        phase.drained_at, phase.idle_kv_blocks = idle.t, idle.kv_blocks_used
        phases.append(phase)
        outs += [o for b in sent for o in b.outcomes]
        outcomes.append(outs)
        every_burst += sent
        print(f"load {load:g}x, {len(sent)} bursts: {status_counts(outs)}", flush=True)
    return phases, outcomes, every_burst


def _mix(args: argparse.Namespace) -> Mix:
    shorts = prompt_texts(64, args.seed, "bench", max_chars=400)
    longs = long_prompt_texts(16, args.long_chars, args.seed)
    early_exit = json.loads(args.early_exit) if args.early_exit else None
    return Mix(
        model=args.model,
        short_prompts=shorts,
        long_prompts=longs,
        max_tokens=args.max_tokens,
        long_share=args.long_share,
        stream_share=args.stream_share,
        disconnect_share=args.disconnect_share,
        early_exit=early_exit,
        rng=random.Random(args.seed),
        chat_share=args.chat_share,
    )


async def _healthy(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/health", timeout=10)).status_code == 200
    except httpx.HTTPError:
        return False


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _provenance() -> dict[str, Any]:
    """``bench.measure.provenance`` and what else says how quiet the machine was; a thread
    count set in the environment (the server inherits it) goes in front of the command."""
    prov = {**provenance(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    env = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS",) if k in os.environ]
    prov["command"] = " ".join([*env, prov["command"]])
    return prov
