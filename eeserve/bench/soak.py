"""``eeserve bench soak``: the server under sustained load at multiples of its capacity.

Contract: ``run_soak(args)`` starts ``python -m eeserve.server MODEL`` on a free loopback port,
``--server-nice`` below this client's priority (``--replicas N``: N Ray Serve replicas, each
replica's process niced once it serves, Ray's proxy and controller left at the client's priority;
or benchmarks ``--base-url`` as it is), warms it up and measures its saturation throughput: the
completion rate of a closed loop of ``--capacity-concurrency`` clients sending the request mix for
``--capacity-duration`` seconds (completed requests over the time from its start to the last
completion). ``--utilization`` of that is its capacity, the 1x rate (or ``--capacity`` requests/s
as given). Then, for each ``--loads`` multiple, it sends the mix open-loop (Poisson arrivals at
multiple x capacity, whatever the server answers) for ``--duration`` seconds (one value, or one per
load), waits until every request has ended and the server is idle, and samples the server meanwhile
(``soak_sample``). The mix: ``--long-share`` of ~1.5k-token prompts (``--long-chars``), the rest
short; ``--stream-share`` streamed; ``--disconnect-share`` of clients that hang up early on
purpose; every request asks for ``--max-tokens`` tokens (ignore_eos). It writes
``<out-dir>/<label>.json`` (``provenance``: commit, date, machine, the exact command; capacity; the
server's admission limits; per-interval records; per-load summaries; the checks of
``soak_report.checks``) and ``<label>.png`` (``soak_plots``), prints the summaries and returns 0,
or 1 when a request failed or hung or the server went down. Only the given base URL (default:
loopback) is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from eeserve.bench.arrivals import long_prompt_texts
from eeserve.bench.serve import wait_healthy
from eeserve.bench.soak_load import Mix, Outcome, closed_loop, open_loop, send
from eeserve.bench.soak_plots import plot_soak
from eeserve.bench.soak_report import Phase, checks, intervals, summarize_phase
from eeserve.bench.soak_sample import (
    LoopLag,
    Sampler,
    read_gauges,
    read_limits,
    realtime,
    renice,
)
from eeserve.tuning.prompts import prompt_texts
from eeserve.tuning.provenance import provenance

HOST = "127.0.0.1"


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
    p.add_argument("--out-dir", default="bench/results/soak")
    p.add_argument("--label", default=None, help="file name stem (default: from the options)")
    p.set_defaults(func=run_soak)
    return p


def _share(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def run_soak(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    loads = [float(x) for x in args.loads.split(",")]
    durations = [float(x) for x in args.duration.split(",")]
    if len(durations) == 1:
        durations *= len(loads)
    if len(durations) != len(loads):
        raise ValueError("--duration takes one value or one per load")
    rt = args.client_priority == "realtime"
    with _server(args) as (base, pid), realtime(rt) as priority:
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
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    client = httpx.AsyncClient(base_url=base, headers=headers, timeout=hard, limits=pool)
    async with client:
        mix = _mix(args)
        t0 = time.perf_counter()
        sampler = Sampler(client, pid, t0)
        lag = LoopLag(t0)
        lag_task = asyncio.create_task(lag.run())
        for warm in (mix.draw(disconnects=False) for _ in range(2)):
            await send(client, warm, t0, hard)
        limits = read_limits((await client.get("/metrics")).text)
        cap = await _capacity(args, client, mix, t0, hard)
        capacity = cap["requests_per_s"]
        sampler_task = asyncio.create_task(sampler.run(args.sample_every))
        phases: list[Phase] = []
        outcomes: list[list[Outcome]] = []  # per load level
        for load, duration in zip(loads, durations):
            start = time.perf_counter() - t0
            outs = await open_loop(client, mix, load * capacity, duration, t0, hard)
            phase = Phase(load, load * capacity, start, start + duration)
            idle = await sampler.until_idle(60)
            phase.drained_at, phase.idle_kv_blocks = idle.t, idle.kv_blocks_used
            phases.append(phase)
            outcomes.append(outs)
            print(f"load {load:g}x: {_counts(outs)}", flush=True)
        for task in (sampler_task, lag_task):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        up = await _healthy(client)
    warmup = min(args.interval, 0.2 * min(durations))
    summaries = [
        summarize_phase(p, outs, sampler.samples, lag.samples, warmup)
        for p, outs in zip(phases, outcomes)
    ]
    return {
        "provenance": _provenance(),
        "config": {**_config(args), "interval_s": args.interval, "warmup_s": warmup},
        "admission_limits": limits,
        "capacity": cap,
        "phases": [asdict(p) for p in phases],
        "summaries": summaries,
        "checks": checks(summaries, up),
        "intervals": intervals(
            [o for outs in outcomes for o in outs],
            sampler.samples,
            lag.samples,
            phases,
            args.interval,
        ),
        "samples": [asdict(s) for s in sampler.samples],
    }


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
    )


async def _capacity(
    args: argparse.Namespace, client: httpx.AsyncClient, mix: Mix, t0: float, hard: float
) -> dict[str, Any]:
    """The 1x rate (``requests_per_s``) and where it comes from: ``--capacity`` as given, or
    ``--utilization`` of the closed loop's completion rate (``throughput_per_s``)."""
    if args.capacity is not None:
        return {
            "requests_per_s": args.capacity,
            "throughput_per_s": None,
            "utilization": None,
            "measured": False,
            "closed_loop": {},
        }
    start = time.perf_counter() - t0
    outs = await closed_loop(
        client, mix, args.capacity_concurrency, args.capacity_duration, t0, hard
    )
    done = [o for o in outs if o.status == "completed"]
    if not done:
        raise RuntimeError(f"no request completed while measuring capacity: {_counts(outs)}")
    # The requests in flight when the loop stops run to their end and count: a window that
    # counted only completions inside it would miss every request longer than the window.
    rate = len(done) / (max(o.ended for o in done) - start)
    capacity = args.utilization * rate
    print(
        f"saturation throughput: {rate:.3f} requests/s ({_counts(outs)}); "
        f"capacity (1x): {capacity:.3f} requests/s",
        flush=True,
    )
    return {
        "requests_per_s": capacity,
        "throughput_per_s": rate,
        "utilization": args.utilization,
        "measured": True,
        "closed_loop": _counts(outs),
    }


def _counts(outs: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outs:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


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


def format_summaries(result: dict[str, Any]) -> str:
    head = (
        f"{'load':>5} {'req/s':>6} {'sent':>5} {'done':>5} {'429':>5} {'dline':>5} "
        f"{'disc':>5} {'fail':>4} {'hung':>4} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>15} "
        f"{'429 p99':>7} {'srv<=':>6} {'idle KV':>7} {'lag p99':>7}"
    )
    cap = result["capacity"]
    rated = f"capacity {cap['requests_per_s']:.3f} requests/s"
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


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The command that starts the server to soak on ``port``: ``eeserve.server`` with the
    run's options, behind ``nice -n --server-nice`` unless that is 0 or the server runs replicas."""
    cmd = [sys.executable, "-m", "eeserve.server", args.model, "--host", HOST, "--port", str(port)]
    if args.server_nice and not args.replicas:  # replicas: niced once they run (nice_replicas)
        cmd = ["nice", "-n", str(args.server_nice), *cmd]
    cmd += ["--log-level", "warning", "--request-timeout", str(args.request_timeout)]
    if args.replicas:
        cmd += ["--replicas", str(args.replicas)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd + shlex.split(args.server_args)


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """(base URL, server pid): ``--base-url`` as it is, or a server started for the run."""
    if args.base_url:
        yield args.base_url.rstrip("/"), args.server_pid
        return
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    cmd = server_command(args, port)
    with tempfile.NamedTemporaryFile(
        "w+b", prefix="eeserve-soak-", suffix=".log", delete=False
    ) as log:
        print(f"server: {shlex.join(cmd)} (log: {log.name})", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        wait_healthy(base, proc, timeout=900)
        if args.replicas and args.server_nice:
            nice_replicas(base, args.replicas, args.server_nice)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def nice_replicas(base: str, replicas: int, increment: int, timeout: float = 120.0) -> list[int]:
    """Run each of the ``replicas`` engine processes behind ``base`` (their pids from
    ``eeserve_replica_info``, which a replica publishes within seconds of starting)
    ``increment`` nicer than this client; their pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = read_gauges(httpx.get(f"{base}/metrics", timeout=30).text)[1]
        if len(pids) >= replicas:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pids)} of {replicas} replicas published their pid")
        time.sleep(1.0)
    threads = sum(renice(pid, increment) for pid in pids)
    print(f"replicas {pids}: {threads} threads at niceness +{increment}", flush=True)
    return pids
