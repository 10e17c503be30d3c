"""``eeserve bench serve --scenario long-prompts``: do long prompts stall the decoding streams?

Contract: ``arrivals(base_url, model, streams, long_prompts, ...)`` starts one streaming request
per ``streams`` prompt at once (each decodes ``stream_tokens`` tokens at full depth), and while
they decode, sends the ``long_prompts`` one every ``period`` seconds (each asks for
``long_tokens``). It returns
the inter-token gaps of the decoding streams (median, p99, max, in ms), the time to first token
of the long prompts, and the output throughput. ``run_arrivals(args)`` is the command: it starts
the server twice on a free loopback port, with chunked prefill on and off (or benchmarks
``--base-url`` once as it is), prints one row per mode and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from typing import Any

import httpx

from eeserve.bench.serve import RequestResult, one_request, percentiles, report, server
from eeserve.tuning.prompts import prompt_texts


def add_arrival_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--scenario long-prompts")
    g.add_argument("--streams", type=int, default=8, help="decoding streams")
    g.add_argument("--stream-tokens", type=int, default=256, help="tokens each stream decodes")
    g.add_argument("--long-prompts", type=int, default=4, help="long prompts sent meanwhile")
    g.add_argument("--long-chars", type=int, default=6000, help="~4 characters per token")
    g.add_argument("--long-tokens", type=int, default=16, help="tokens each long prompt asks")
    g.add_argument("--period", type=float, default=2.0, help="seconds between long prompts")
    g.add_argument("--first-after", type=float, default=1.0, help="seconds before the first")


def long_prompt_texts(n: int, chars: int, seed: int) -> list[str]:
    """``n`` distinct texts of ``chars`` characters (passages joined in turn), no shared prefix."""
    pool = iter(prompt_texts(n * (chars // 200 + 2), seed + 1, "bench", max_chars=1200))
    out = []
    for _ in range(n):
        parts: list[str] = []
        while sum(len(x) + 1 for x in parts) < chars:
            parts.append(next(pool))
        out.append(" ".join(parts)[:chars])
    return out


async def arrivals_async(
    base_url: str,
    model: str,
    streams: list[str],
    long_prompts: list[str],
    *,
    stream_tokens: int,
    long_tokens: int,
    period: float,
    first_after: float,
    api_key: str | None = None,
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(streams) + len(long_prompts) + 4)
    # Full depth: the scenario measures scheduling (comparable across sessions); speculative
    # streams would deliver their tokens in bursts of verified drafts.
    common = {
        "model": model,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "early_exit": {"enabled": False},
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=limits
    ) as client:
        await one_request(client, {**common, "prompt": streams[0], "max_tokens": 2}, 0.0)
        start = time.perf_counter() + 0.05
        decoding = [
            one_request(client, {**common, "prompt": p, "max_tokens": stream_tokens}, start)
            for p in streams
        ]
        arriving = [
            one_request(
                client,
                {**common, "prompt": p, "max_tokens": long_tokens},
                start + first_after + k * period,
            )
            for k, p in enumerate(long_prompts)
        ]
        results: list[RequestResult] = await asyncio.gather(*decoding, *arriving)
        wall = time.perf_counter() - start
    ds, ls = results[: len(streams)], results[len(streams) :]
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    gaps = percentiles([x for r in ds if r.ok for x in r.itls], (50, 99, 100))
    return {
        "stream_itl_ms": {"p50": gaps["p50"], "p99": gaps["p99"], "max": gaps["p100"]},
        "long_ttft_ms": percentiles([r.ttft for r in ls if r.ok and r.ttft is not None]),
        "long_prompt_tokens": [r.prompt_tokens for r in ls],
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall,
        "wall_s": wall,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def run_arrivals(args: argparse.Namespace) -> int:
    streams = prompt_texts(args.streams, args.seed, "bench", max_chars=args.prompt_chars)
    longs = long_prompt_texts(args.long_prompts, args.long_chars, args.seed)
    name = args.served_model_name or args.model
    modes = (
        {"as_is": ""}
        if args.base_url
        else {
            "chunked": "--enable-chunked-prefill",
            "unchunked": "--no-enable-chunked-prefill",
        }
    )
    rows = []
    for mode, flag in modes.items():
        run_args = copy.copy(args)
        run_args.server_args = f"{args.server_args} {flag}".strip()
        with server(run_args) as base_url:
            row = asyncio.run(
                arrivals_async(
                    base_url,
                    name,
                    streams,
                    longs,
                    stream_tokens=args.stream_tokens,
                    long_tokens=args.long_tokens,
                    period=args.period,
                    first_after=args.first_after,
                    api_key=args.api_key,
                )
            )
        rows.append({"mode": mode, **row})
    return report(args, rows, format_arrivals(rows))


def format_arrivals(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'mode':<10} {'stream gap p50/p99/max ms':>27} {'max/p50':>7} {'p99/p50':>7} "
        f"{'long TTFT p50/p99 ms':>21} {'tok/s':>7} {'err':>3}"
    )
    lines = [head]
    for r in rows:
        g, t = r["stream_itl_ms"], r["long_ttft_ms"]
        lines.append(
            f"{r['mode']:<10} {g['p50']:>8.1f}/{g['p99']:>8.1f}/{g['max']:<8.1f} "
            f"{g['max'] / g['p50']:>7.1f} {g['p99'] / g['p50']:>7.1f} "
            f"{t['p50']:>10.0f}/{t['p99']:<10.0f} {r['output_tokens_per_s']:>7.1f} {r['errors']:>3}"
        )
    return "\n".join(lines)
