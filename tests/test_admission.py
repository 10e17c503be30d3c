"""Overload: admission control (429 with Retry-After) and per-request deadlines (504), on the
tiny model: the accounting alone, the engine loop in-process, and a live server whose one running
slot is held by a long stream so that what waits behind it is known."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.sampling_params import SamplingParams
from eeserve.server import main
from eeserve.server.admission import (
    DEFAULT_MAX_QUEUE_SECONDS,
    Admission,
    AdmissionLimits,
    Cost,
    Estimate,
    Limit,
    Overloaded,
    ServingLimits,
    resolve_limits,
)
from eeserve.server.app import create_app
from eeserve.server.engine_loop import EngineLoop
from eeserve.server.engine_requests import ChoiceSpec
from eeserve.server.generation import DeadlineExceeded
from eeserve.server.metrics import ServerMetrics
from eeserve.server.throughput import Capacity
from tests.live_server import Server
from tests.tiny_model import build_tiny_model

KV_BYTES = 4_000_000
LONG = 480  # tokens: hundreds of engine steps, far longer than any deadline below


# -- the accounting ------------------------------------------------------------------------------


def _admission(waiting: int, tokens: int, seconds: float = math.inf, **kw: Any) -> Admission:
    limits = AdmissionLimits(waiting, tokens, seconds)
    return Admission(limits, Capacity(slots=64, pool_tokens=10**6), **kw)


def _admit(adm: Admission, *costs: Cost) -> None:
    adm.settle(adm.reserve(Estimate.exact(list(costs))), list(costs))


def test_admission_limits_and_release() -> None:
    adm = _admission(3, 100)
    _admit(adm, Cost(400, 100))  # nothing waits: admitted whatever it costs
    with pytest.raises(Overloaded) as e:
        _admit(adm, Cost(1, 1))
    assert e.value.limit == Limit.QUEUED_TOKENS and e.value.retry_after >= 1
    adm.released(Cost(400, 100))
    _admit(adm, Cost(30, 10), Cost(30, 10))
    with pytest.raises(Overloaded) as e:
        _admit(adm, Cost(20, 10))
    assert e.value.limit == Limit.QUEUED_TOKENS
    _admit(adm, Cost(5, 5))
    with pytest.raises(Overloaded) as e:
        _admit(adm, Cost(1, 1))
    assert e.value.limit == Limit.WAITING_REQUESTS and "3 requests wait" in str(e.value)
    assert adm.refusal_for_any() is not None  # no request at all fits: refused unread
    for cost in (Cost(30, 10), Cost(30, 10), Cost(5, 5)):
        adm.started(cost)
    assert adm.waiting_requests == adm.queued_tokens == 0 and adm.running_requests == 3
    _admit(adm, Cost(1, 1), Cost(1, 1), Cost(1, 1))
    for cost in (Cost(30, 10), Cost(30, 10), Cost(5, 5)):
        adm.finished(cost, 10)
    assert adm.running_requests == 0 and adm.running == Cost(0, 0)


def test_reservations_hold_the_least_and_the_exact_cost_decides() -> None:
    """A request in preparation holds the least it can cost; once tokenized, its exact cost is
    checked against the queue as it is then (near a limit: refused after tokenizing), except for
    one that found the queue empty."""
    adm = _admission(10, 100)
    big = adm.reserve(Estimate(choices=1, low=Cost(1, 10)))  # the queue is empty
    held = adm.reserve(Estimate(choices=1, low=Cost(1, 10)))
    assert adm.waiting_requests == 2 and adm.queued_tokens == 22
    adm.settle(big, [Cost(150, 10)])  # over the limit alone, but it came first
    assert adm.queued_tokens == 171
    with pytest.raises(Overloaded) as e:  # 160 + 20 > 100: refused once tokenized
        adm.settle(held, [Cost(10, 10)])
    assert e.value.limit == Limit.QUEUED_TOKENS and adm.queued_tokens == 160
    with pytest.raises(Overloaded):  # even its least does not fit now: refused untokenized
        adm.reserve(Estimate(choices=1, low=Cost(1, 10)))
    adm.started(Cost(150, 10))
    fits = adm.reserve(Estimate(choices=2, low=Cost(2, 20)))
    adm.settle(fits, [Cost(20, 10), Cost(30, 10)])
    assert adm.queued_tokens == 70 and adm.waiting_requests == 2
    with pytest.raises(ValueError, match="settled or released"):
        adm.settle(fits, [Cost(20, 10), Cost(30, 10)])
    late = adm.reserve(Estimate(choices=1, low=Cost(1, 1)))  # given back unsettled (a 400)
    late.release()
    late.release()
    assert adm.queued_tokens == 70 and adm.waiting_requests == 2


def test_limits_default_to_the_engine_and_reject_nonsense(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    got = resolve_limits(ServingLimits(), engine)
    bm = engine.block_manager
    assert got.max_waiting_requests == engine.config.max_num_seqs
    assert got.max_queued_tokens == bm.num_blocks * bm.block_size
    assert got.max_queue_seconds == DEFAULT_MAX_QUEUE_SECONDS
    assert resolve_limits(ServingLimits(7, 99), engine) == AdmissionLimits(7, 99, 20.0)
    unbounded = resolve_limits(ServingLimits(max_queue_seconds=math.inf), engine)
    assert unbounded.max_queue_seconds == math.inf
    for bad in (dict(max_waiting_requests=0), dict(max_queued_tokens=-1)):
        with pytest.raises(ValueError, match="must be >= 1"):
            ServingLimits(**bad)
    for t in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request_timeout"):
            ServingLimits(request_timeout=t)
    for n in (-1, 20):
        with pytest.raises(ValueError, match="engine_nice"):
            ServingLimits(engine_nice=n)
    for q in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_queue_seconds"):
            ServingLimits(max_queue_seconds=q)
    # The command line refuses them before loading anything.
    assert main([str(tiny_model_dir), "--max-waiting-requests", "0"]) == 2
    assert main([str(tiny_model_dir), "--request-timeout", "-3"]) == 2
    assert main([str(tiny_model_dir), "--engine-nice", "20"]) == 2
    assert main([str(tiny_model_dir), "--max-queue-seconds", "0"]) == 2


# -- the engine loop in-process ------------------------------------------------------------------


def test_deadline_aborts_and_frees_blocks(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    loop = EngineLoop(engine, ServerMetrics(engine.model_config.num_layers))
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    seen: list[int] = []

    async def run() -> None:
        loop.start(asyncio.get_running_loop())
        gen = await loop.add([ChoiceSpec(None, [1, 2, 3], params)], None, timeout=0.001)
        with pytest.raises(DeadlineExceeded) as e:
            async for _, out in gen.stream():
                seen.append(len(out.outputs[0].token_ids))
        assert e.value.status == 504 and e.value.code == "deadline_exceeded"
        # Another request still runs to its end: the loop is unharmed.
        done = await loop.add([ChoiceSpec(None, [4, 5], params)], None)
        outs = [out async for _, out in done.stream()]
        assert len(outs[-1].outputs[0].token_ids) == LONG
        loop.stop()

    asyncio.run(run())
    assert not seen or seen[-1] < LONG
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()
    assert loop.admission.waiting_requests == loop.admission.queued_tokens == 0
    assert loop.admission.running_requests == 0 and loop.admission.running == Cost(0, 0)


def test_engine_thread_runs_nicer_than_the_event_loop(tiny_model_dir: Path) -> None:
    """``--engine-nice``: the engine's worker thread lowers its own priority, the loop's stays."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    loop = EngineLoop(engine, ServerMetrics(engine.model_config.num_layers), nice=3)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def run() -> int:
        loop.start(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=2, temperature=0)
        gen = await loop.add([ChoiceSpec(None, [1, 2], params)], None)  # the worker has run
        _ = [out async for _, out in gen.stream()]
        assert loop.engine_thread_id is not None
        nice = os.getpriority(os.PRIO_PROCESS, loop.engine_thread_id)
        loop.stop()
        return nice

    assert asyncio.run(run()) == min(19, base + 3)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base


def test_server_request_timeout_flag(tiny_model_dir: Path) -> None:
    """``--request-timeout`` (``ServingLimits.request_timeout``): a 504 with an OpenAI body; a
    request's own ``request_timeout`` only shortens it."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    app = create_app(engine, model_names=["tiny"], limits=ServingLimits(request_timeout=0.001))
    body = {"model": "tiny", "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    with TestClient(app) as client:
        for extra in ({}, {"request_timeout": 3600.0}):
            r = client.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error"
            assert "0.001 s" in err["message"]
        metrics = client.get("/metrics").text
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)  # the aborts reach the engine thread after its current step
    assert 'eeserve_requests_total{endpoint="/v1/completions",status="timeout"} 2.0' in metrics
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# -- a live server -------------------------------------------------------------------------------

# One running slot; behind it at most 2 waiting requests holding 300 tokens; no bound in seconds
# (the slot's stream of HOLD tokens would put what waits behind it past any).
LIMIT_ARGS = (
    "--max-num-seqs",
    "1",
    "--max-waiting-requests",
    "2",
    "--max-queued-tokens",
    "300",
    "--max-queue-seconds",
    "inf",
)
HOLD = 6000  # tokens of the stream that holds the running slot (seconds of engine steps)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A context long enough for a stream that holds the slot for seconds (HOLD), whatever the
    # machine's speed: the tests below queue requests behind it.
    folder = build_tiny_model(tmp_path_factory.mktemp("admission") / "m", max_pos=HOLD + 64)
    srv = Server(folder, *LIMIT_ARGS)
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


def _metrics(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def _until(base: str, name: str, value: float, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        if m[name] == value or time.monotonic() > deadline:
            assert m[name] == value, (name, m[name])
            return m
        await asyncio.sleep(0.02)


@asynccontextmanager
async def _running_stream(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> AsyncIterator[httpx.Response]:
    """A stream that holds the one running slot, open until the block ends."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: {")  # generating: it runs
        yield r


def _sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
def test_over_the_limits_is_429_with_retry_after(server: Server) -> None:
    base = server.base
    body = {"model": server.model, "prompt": "x", "ignore_eos": True, "temperature": 0}
    waiting = "eeserve_admission_waiting_requests"

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            async with _running_stream(c, {**body, "max_tokens": HOLD}):
                await _until(base, waiting, 0)
                # Waits behind the stream (cost 1 + 150 tokens of the 300).
                behind = asyncio.create_task(
                    c.post("/v1/completions", json={**body, "max_tokens": 150})
                )
                await _until(base, waiting, 1)
                too_big = await c.post("/v1/completions", json={**body, "max_tokens": 200})
                fits = asyncio.create_task(
                    c.post("/v1/completions", json={**body, "max_tokens": 100})
                )
                await _until(base, waiting, 2)
                # Both at once, while the stream still holds the slot (it ends within a second).
                one_more, chat = await asyncio.gather(
                    c.post("/v1/completions", json={**body, "max_tokens": 1}),
                    c.post(
                        "/v1/chat/completions",
                        json={
                            "model": server.model,
                            "messages": [{"role": "user", "content": "x"}],
                        },
                    ),
                )
            return [too_big, one_more, chat, await behind, await fits]

    too_big, one_more, chat, behind, fits = asyncio.run(run())
    for r, kind in ((too_big, "tokens"), (one_more, "requests"), (chat, "requests")):
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "rate_limit_exceeded" and err["type"] == kind
    assert "300" in too_big.json()["error"]["message"]
    assert behind.status_code == fits.status_code == 200
    assert behind.json()["usage"]["completion_tokens"] == 150
    m = _metrics(base)
    assert m['eeserve_admission_rejected_total{limit="queued_tokens"}'] == 1
    assert m['eeserve_admission_rejected_total{limit="waiting_requests"}'] == 2
    assert m['eeserve_requests_total{endpoint="/v1/completions",status="overloaded"}'] == 2
    assert m['eeserve_admission_limit{limit="queued_tokens"}'] == 300
    assert m[waiting] == m["eeserve_admission_queued_tokens"] == 0
    # Each 429 timed from arrival to headers; nothing else (200s, the metrics page) is counted.
    assert m["eeserve_rejection_seconds_count"] == 3
    assert 0 < m["eeserve_rejection_seconds_sum"] < 3 * 120


@pytest.mark.slow
def test_request_timeout_field_aborts_waiting_and_streaming(server: Server) -> None:
    """A request whose time limit passes while it waits behind a running stream: a 504 (whole
    response) or a final error event before [DONE] (stream); its blocks are freed."""
    base = server.base
    body = {"model": server.model, "prompt": "x", "ignore_eos": True, "max_tokens": 8}
    timeout = 'eeserve_requests_total{endpoint="/v1/completions",status="timeout"}'
    before = _metrics(base)[timeout]

    async def run() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            async with _running_stream(c, {**body, "max_tokens": HOLD}):
                whole = await c.post("/v1/completions", json={**body, "request_timeout": 0.001})
                req = c.build_request(
                    "POST",
                    "/v1/completions",
                    json={**body, "request_timeout": 0.001, "stream": True},
                )
                streamed = await c.send(req, stream=True)
                events = [line[6:] async for line in streamed.aiter_lines()
                          if line.startswith("data: ")]  # fmt: skip
                await streamed.aclose()
            return whole, events

    whole, events = asyncio.run(run())
    assert whole.status_code == 504, whole.text
    assert whole.json()["error"]["code"] == "deadline_exceeded"
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error"
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(base)
        if m["eeserve_kv_blocks_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m["eeserve_kv_blocks_used"] == 0
    assert m[timeout] == before + 2
    assert m["eeserve_admission_waiting_requests"] == 0


@pytest.mark.parametrize("value", ["5", 0, -1.0, 10**6, True])
def test_request_timeout_field_is_validated(tiny_model_dir: Path, value: Any) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "request_timeout": value}
    with TestClient(create_app(engine, model_names=["tiny"])) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "request_timeout"


# -- the soak benchmark, in miniature ------------------------------------------------------------


def test_soak_starts_the_server_below_its_own_priority() -> None:
    from eeserve.bench.soak import add_soak_parser
    from eeserve.bench.soak_server import server_command

    parser = argparse.ArgumentParser()
    add_soak_parser(parser.add_subparsers())
    niced = server_command(parser.parse_args(["soak"]), 8123)
    assert niced[:3] == ["nice", "-n", "10"] and niced[4:6] == ["-m", "eeserve.server"]
    plain = server_command(parser.parse_args(["soak", "--server-nice", "0"]), 8123)
    assert plain[1:3] == ["-m", "eeserve.server"] and "nice" not in plain
    # Replicas are niced once they run (nice_replicas), so that Ray's proxy is not.
    replicas = server_command(parser.parse_args(["soak", "--replicas", "2"]), 8123)
    assert "nice" not in replicas and replicas[replicas.index("--replicas") + 1] == "2"


def test_soak_rates_capacity_below_the_saturation_throughput() -> None:
    from eeserve.bench.soak import add_soak_parser

    parser = argparse.ArgumentParser()
    add_soak_parser(parser.add_subparsers())
    assert parser.parse_args(["soak"]).utilization == 0.8
    assert parser.parse_args(["soak", "--utilization", "1"]).utilization == 1.0
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["soak", "--utilization", bad])


def test_soak_client_runs_realtime_only_while_it_runs() -> None:
    from eeserve.bench.soak_sample import realtime

    def policy() -> int:
        return os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK

    child = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
    before = os.sched_getscheduler(0)
    with realtime() as got:
        if got == "SCHED_RR 1":
            assert policy() == os.SCHED_RR and os.sched_getparam(0).sched_priority == 1
            # What the client starts (the sampler's process, a server) runs at normal priority.
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            assert int(out) == os.SCHED_OTHER
        else:  # not permitted here: the run goes on at normal priority and says why
            assert got.startswith("normal (real-time refused") and policy() == before
    assert os.sched_getscheduler(0) == before
    with realtime(False) as got:
        assert got == "normal" and os.sched_getscheduler(0) == before


def test_renice_lowers_every_thread_of_a_process() -> None:
    from eeserve.bench.soak_sample import renice

    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print('up', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert renice(proc.pid, 3) == 2
        base = os.getpriority(os.PRIO_PROCESS, 0)
        tids = [int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()]
        assert len(tids) == 2
        assert all(os.getpriority(os.PRIO_PROCESS, tid) == base + 3 for tid in tids)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("body", "by", "limit"),
    [
        ('{"error": {"message": "busy", "type": "tokens"}}', "engine", "tokens"),
        ('{"error": {"message": "busy", "type": "requests"}}', "engine", "requests"),
        ('{"error": "busy"}', "engine", None),
        ("Too many requests", "proxy", None),
    ],
)
def test_soak_client_says_who_turned_a_request_away(body: str, by: str, limit: str | None) -> None:
    from starlette.responses import Response

    from eeserve.bench.soak_load import Request
    from eeserve.bench.soak_load import send as soak_send

    app = Response(body, status_code=429, headers={"Retry-After": "2"})

    async def one() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as client:
            return await soak_send(client, Request({"stream": False}, "short"), 0.0, 5.0)

    out = asyncio.run(one())
    assert (out.status, out.http_status, out.retry_after, out.rejected_by) == (
        "rejected",
        429,
        2,
        by,
    )
    assert out.rejected_limit == limit
    assert out.reject_latency is not None and out.reject_latency >= 0


def test_server_reject_ms_reads_the_buckets_between_two_samples() -> None:
    from eeserve.bench.soak_report import server_reject_ms
    from eeserve.bench.soak_sample import Sample

    def at(t: float, buckets: dict[float, float]) -> Sample:
        return Sample(t, None, None, None, None, None, None, buckets)

    inf = float("inf")
    samples = [
        at(0.0, {0.01: 5, 0.1: 5, inf: 5}),  # before the window: 5 fast 429s
        at(5.0, {0.01: 50, 0.1: 95, inf: 105}),
        at(9.0, {0.01: 55, 0.1: 104, inf: 105}),  # in the window: 50 / 49 / 1 by bucket
        at(12.0, {0.01: 500, 0.1: 500, inf: 500}),  # after it
    ]
    assert server_reject_ms(samples, 1.0, 10.0) == {"p50": 10.0, "p99": 100.0}
    assert server_reject_ms(samples, 1.0, 6.0)["p99"] == inf  # 10 of 100 above the last bound
    nothing = server_reject_ms(samples, 20.0, 30.0)
    assert math.isnan(nothing["p50"]) and math.isnan(nothing["p99"])


def test_soak_sampler_reads_its_families_only() -> None:
    """``read_sampled`` reads from a page what a parse of the whole page does for the sampled
    families (summed over replicas), and nothing of the others."""
    from eeserve.bench.soak_sample import read_gauges, read_histogram, read_sampled

    page = "".join(
        f"# HELP eeserve_{n} x\n# TYPE eeserve_{n} {t}\n"
        + "".join(f'eeserve_{n}{{replica="{r}"{lab}}} {v}\n' for r, v in ((0, 2.0), (1, 3.0)))
        for n, t, lab in (
            ("kv_blocks_used", "gauge", ""),
            ("num_requests_waiting", "gauge", ""),
            ("kv_blocks_total", "gauge", ""),  # not sampled
            ("replica_info", "gauge", ',pid="7"'),
        )
    )
    page += "# HELP eeserve_rejection_seconds x\n# TYPE eeserve_rejection_seconds histogram\n"
    for le, count in (("0.01", 4.0), ("+Inf", 5.0)):
        page += f'eeserve_rejection_seconds_bucket{{le="{le}",replica="0"}} {count}\n'
    page += "eeserve_rejection_seconds_count 5.0\neeserve_rejection_seconds_sum 0.1\n"
    gauges, pids, rejects = read_sampled(page)
    full, full_pids = read_gauges(page)
    assert gauges["eeserve_kv_blocks_used"] == full["eeserve_kv_blocks_used"] == 5.0
    assert gauges["eeserve_num_requests_waiting"] == 5.0 and pids == full_pids == [7, 7]
    assert "eeserve_kv_blocks_total" in full and "eeserve_kv_blocks_total" not in gauges
    assert (
        rejects
        == read_histogram(page, "eeserve_rejection_seconds")
        == {0.01: 4.0, float("inf"): 5.0}
    )


@pytest.mark.slow
def test_soak_smoke(server: Server, tmp_path: Path) -> None:
    """``eeserve bench soak`` against the one-slot server: every request is accounted for
    (completed, 429, deadline or a planned disconnect), the records and the plot are written."""
    from eeserve.bench.soak import add_soak_parser, run_soak

    parser = argparse.ArgumentParser()
    add_soak_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["soak", "--model", server.model, "--base-url", server.base, "--server-pid",
         str(server.proc.pid), "--loads", "1,3", "--duration", "2", "--capacity-duration", "2",
         "--capacity-concurrency", "3", "--long-chars", "300", "--max-tokens", "16",
         "--disconnect-share", "0.3", "--interval", "1", "--sample-every", "0.5",
         "--out-dir", str(tmp_path), "--label", "smoke"]
    )  # fmt: skip
    assert run_soak(args) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    cap = result["capacity"]
    assert cap["measured"] and cap["utilization"] == 0.8 and result["provenance"]["commit"]
    assert cap["throughput_per_s"] > 0
    assert cap["requests_per_s"] == pytest.approx(0.8 * cap["throughput_per_s"])
    assert [s["load"] for s in result["summaries"]] == [1.0, 3.0]
    for s in result["summaries"]:
        answered = s["completed"] + s["rejected"] + s["deadline"] + s["disconnected"]
        assert s["requests"] > 0 and answered == s["requests"] and s["hung"] == s["failed"] == 0
        assert s["kv_blocks_used_after_drain"] == 0 and s["rejected_by_proxy"] == 0
        assert 0 <= s["client_lag_ms"]["p99"] <= s["client_lag_ms"]["max"]
        # Every 429 names the limit that refused it; the kinds add up to the whole.
        assert sum(s["rejected_by_limit"].values()) == s["rejected"]
        kinds = s["by_kind"].values()
        assert sum(k["requests"] for k in kinds) == s["requests"]
        assert sum(k["rejected"] for k in kinds) == s["rejected"]
    assert sum(s["rejected"] for s in result["summaries"]) > 0  # one slot: overloaded
    for s in result["summaries"]:  # the server's own timing of its 429s, where there were any
        assert (s["rejected"] > 0) == (s["server_reject_ms"]["p99"] > 0), s
    rows = result["intervals"]
    assert sum(r["requests"] for r in rows) == sum(s["requests"] for s in result["summaries"])
    assert all(r["rss_server_mib"] for r in rows if r["t_s"] < result["phases"][-1]["end"])
    assert result["checks"]["server_up_at_end"] is True
