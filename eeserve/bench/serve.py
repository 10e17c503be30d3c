"""``eeserve bench serve``: a load generator for the HTTP server (Poisson arrivals, streaming).

Contract: ``bench_serve(base_url, model, ...)`` sends a fixed, seeded prompt set to
``/v1/completions`` as streaming requests whose start times follow a Poisson process at each
request rate (``inf`` = all at once), once with early exit off (``{"enabled": false}``) and once
with it on (the given threshold/measure, or the model's exit config), in the same run and
against the same server. Per (mode, rate) it returns request and output-token throughput, TTFT,
inter-token latency (time between streamed chunks that carry tokens) and end-to-end latency
percentiles in ms, the mean exit layer and the error count. ``run_bench_serve(args)`` is the CLI
entry: it benchmarks ``--base-url``, or starts ``python -m eeserve.server MODEL`` on a free
loopback port for the run, prints a table and writes JSON. ``one_request``, ``percentiles`` and
``server`` are shared with the long-prompt scenario (``bench.arrivals``). Only the given base URL
(default: loopback) is contacted. Every (mode, rate) run sends the same prompts behind a first line
of its own ("Run k."), so that no run is served from another run's prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eeserve.tuning.prompts import prompt_texts
from eeserve.tuning.provenance import provenance

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    exit_layer_sum: float = 0.0
    error: str | None = None


def percentiles(values: list[float], ps: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """Nearest-rank percentiles in milliseconds (NaN when there are no values)."""
    xs = sorted(values)
    out: dict[str, float] = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = math.nan
            continue
        k = min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))
        out[f"p{p}"] = xs[k] * 1000
    return out


async def one_request(
    client: httpx.AsyncClient, body: dict[str, Any], start_at: float
) -> RequestResult:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = last = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                now = time.perf_counter()
                # A chunk carries tokens when it has text or per-token exit records (a token
                # whose text is held back, or a special token, has no text of its own).
                if any(c.get("text") or c.get("exit_tokens") for c in obj.get("choices", [])):
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.completion_tokens = obj["usage"]["completion_tokens"]
                    ee = obj.get("early_exit") or {}
                    res.exit_layer_sum = ee.get("mean_exit_layer", 0.0) * res.completion_tokens
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.ok = True
    res.latency = time.perf_counter() - t0
    return res


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall > 0 else math.nan,
        "output_tokens_per_s": tokens / wall if wall > 0 else math.nan,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "completion_tokens": tokens,
        "mean_exit_layer": sum(r.exit_layer_sum for r in ok) / tokens if tokens else math.nan,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "latency_ms": percentiles([r.latency for r in ok]),
    }


async def _run_rate(
    client: httpx.AsyncClient, bodies: list[dict[str, Any]], rate: float, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    start = time.perf_counter() + 0.05
    offsets, t = [], 0.0
    for _ in bodies:
        offsets.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    tasks = [one_request(client, b, start + dt) for b, dt in zip(bodies, offsets)]
    results = await asyncio.gather(*tasks)
    return summarize(list(results), time.perf_counter() - start)


def exit_modes(threshold: float | None, measure: str | None) -> dict[str, dict[str, Any]]:
    """Full depth, and either the model's default mode (``model_default``: speculative with int8
    drafts for smollm2) or, with a threshold or measure, ``early_exit`` at that rule."""
    on: dict[str, Any] = {"enabled": True}
    if threshold is not None:
        on["threshold"] = threshold
    if measure is not None:
        on["measure"] = measure
    name = "early_exit" if len(on) > 1 else "model_default"
    return {"full_depth": {"enabled": False}, name: on}


async def bench_serve_async(
    base_url: str,
    model: str,
    prompts: list[str],
    rates: list[float],
    max_tokens: int = 64,
    modes: dict[str, dict[str, Any]] | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    modes = modes or exit_modes(None, None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(100, len(prompts)))
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=limits
    ) as client:
        for m, (mode, early_exit) in enumerate(modes.items()):
            common = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "early_exit": early_exit,
                "stream_options": {"include_usage": True},
            }
            warm = {**common, "prompt": f"Warm-up {m}.\n{prompts[0]}", "max_tokens": 2}
            await one_request(client, warm, 0.0)
            for r, rate in enumerate(rates):
                # A first line of its own per run: no run finds another's prompts in the server's
                # prefix cache (the same prompts otherwise, so the runs compare like for like).
                tag = f"Run {m * len(rates) + r}.\n"
                bodies = [{**common, "prompt": tag + p} for p in prompts]
                row = await _run_rate(client, bodies, rate, seed)
                rows.append({"mode": mode, "rate": rate, **row})
    return rows


def bench_serve(
    base_url: str, model: str, prompts: list[str], rates: list[float], **kwargs: Any
) -> list[dict[str, Any]]:
    """Synchronous wrapper of ``bench_serve_async``."""
    return asyncio.run(bench_serve_async(base_url, model, prompts, rates, **kwargs))


# -- command line -------------------------------------------------------------------------------


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model to serve (and the request's model)")
    p.add_argument(
        "--base-url", default=None, help="benchmark this running server instead of starting one"
    )
    p.add_argument("--served-model-name", default=None, help="`model` field (default: --model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-args", default="", help="extra `eeserve serve` options, quoted")
    p.add_argument(
        "--scenario",
        choices=["rates", "long-prompts"],
        default="rates",
        help="rates: Poisson arrivals per rate; long-prompts: long prompts arrive while streams "
        "decode, with chunked prefill on and off",
    )
    p.add_argument("--rates", default="1,4,inf", help="requests/s, comma-separated; inf = burst")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-chars", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument(
        "--exit-measure",
        default=None,
        choices=["softmax_margin", "max_prob", "hidden_cosine", "classifier"],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/serve/bench_serve.json")


def add_bench_serve_parser(subparsers: Any, name: str = "serve") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, help="load-test the HTTP server (Poisson arrivals)", description=__doc__
    )
    add_bench_serve_args(p)
    p.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(args: argparse.Namespace) -> int:
    prompts = prompt_texts(args.num_prompts, args.seed, "bench", max_chars=args.prompt_chars)
    rates = [float(r) for r in args.rates.split(",")]
    name = args.served_model_name or args.model
    modes = exit_modes(args.exit_threshold, args.exit_measure)
    with server(args) as base_url:
        rows = bench_serve(
            base_url,
            name,
            prompts,
            rates,
            max_tokens=args.max_tokens,
            modes=modes,
            api_key=args.api_key,
            seed=args.seed,
        )
    return report(args, rows, format_table(rows))


def report(args: argparse.Namespace, rows: list[dict[str, Any]], table: str) -> int:
    """Print ``table``, write the rows and the command's options as JSON to ``--out``; the exit
    status says whether any request failed."""
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": provenance(), "args": vars(args) | {"func": None}, "results": rows}
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 1 if any(r["errors"] for r in rows) else 0


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'mode':<11} {'rate':>5} {'req/s':>6} {'tok/s':>7} {'TTFT p50/p99 ms':>17} "
        f"{'ITL p50/p99 ms':>15} {'exit':>5} {'err':>3}"
    )
    lines = [head]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(
            f"{r['mode']:<11} {r['rate']:>5g} {r['request_throughput']:>6.2f} "
            f"{r['output_tokens_per_s']:>7.1f} {t['p50']:>8.1f}/{t['p99']:<8.1f} "
            f"{i['p50']:>7.1f}/{i['p99']:<7.1f} {r['mean_exit_layer']:>5.2f} {r['errors']:>3}"
        )
    return "\n".join(lines)


@contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """``--base-url`` as it is, or a server started for the run (``--server-args`` appended)."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "eeserve.server", args.model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--log-level", "warning", *shlex.split(args.server_args)]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Returns once ``base``/health answers 200; raises if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy in time")
