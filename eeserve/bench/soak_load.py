"""The soak benchmark's clients: one request and its outcome, the open and closed loops, sampling.

Contract: ``Mix`` draws request bodies (short or ~1.5k-token prompts, streaming or not, a share
of clients that disconnect on purpose), each behind a first line of its own so that no request is
served from another's prefix cache. ``send(client, req, t0, hard_timeout)`` runs one and returns
its ``Outcome``: ``completed``, ``rejected`` (429, with its latency, ``Retry-After`` and who
answered it: the engine's admission control, whose body is an OpenAI error, or Ray's proxy),
``deadline`` (504 or a stream's ``deadline_exceeded`` event), ``disconnected`` (planned),
``failed`` (any other answer) or ``hung`` (no answer within ``hard_timeout``). ``open_loop``
starts requests at Poisson arrival times at a given rate for a given time and, once that time
has passed, waits for them all; ``closed_loop`` keeps ``concurrency`` requests in flight for a
given time (the capacity measurement). ``Sampler`` reads, every few seconds, the RSS of the
server's process tree from ``/proc``, the KV-block and queue gauges from ``/metrics`` (summed
over replicas; ``read_sampled`` parses the ``SAMPLED`` families only) and the server's own
histogram of how long its 429s took (``eeserve_rejection_seconds``, cumulative counts by bucket,
summed over replicas: ``read_histogram``), all in a process of its own (``read_server``) so that
the client's event loop never waits for that work. ``renice`` lowers the priority of
every thread of a process. ``LoopLag`` records how late the
client's own event loop wakes from a short sleep: every latency the client measures includes
that lag, so the records carry it beside them. Times are ``time.perf_counter()`` seconds since
the run's ``t0``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

STATUSES = ("completed", "rejected", "deadline", "disconnected", "failed", "hung")
REJECTION_HISTOGRAM = "eeserve_rejection_seconds"  # server.metrics: 429s, arrival to headers
# The metric families a sample reads. A replicas' page holds far more (every histogram, once per
# replica): parsed whole, it held the client's loop for up to ~400 ms, which every request timed
# meanwhile (a 429's latency included) counted as the server's.
SAMPLED = (
    "eeserve_kv_blocks_used",
    "eeserve_num_requests_running",
    "eeserve_num_requests_waiting",
    "eeserve_replica_info",
    REJECTION_HISTOGRAM,
)


@dataclass
class Request:
    body: dict[str, Any]
    kind: str  # "short" | "long"
    disconnect_after: int | None = None  # streaming: tokens read before hanging up
    disconnect_at: float | None = None  # whole response: seconds before hanging up


@dataclass
class Outcome:
    kind: str
    stream: bool
    sent: float
    ended: float = 0.0
    status: str = "failed"
    http_status: int | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    reject_latency: float | None = None  # a 429: seconds to its response headers
    retry_after: int | None = None
    rejected_by: str | None = None  # a 429: "engine" (admission control) or "proxy" (Ray's)
    error: str | None = None


@dataclass
class Mix:
    model: str
    short_prompts: list[str]
    long_prompts: list[str]
    max_tokens: int
    long_share: float
    stream_share: float
    disconnect_share: float
    early_exit: dict[str, Any] | None
    rng: random.Random
    count: int = 0

    def draw(self, disconnects: bool = True) -> Request:
        self.count += 1
        long = self.rng.random() < self.long_share
        pool = self.long_prompts if long else self.short_prompts
        stream = self.rng.random() < self.stream_share
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": f"Request {self.count}.\n{self.rng.choice(pool)}",
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if self.early_exit is not None:
            body["early_exit"] = self.early_exit
        req = Request(body, "long" if long else "short")
        if disconnects and self.rng.random() < self.disconnect_share:
            if stream:
                req.disconnect_after = self.rng.randint(1, max(1, self.max_tokens // 2))
            else:
                req.disconnect_at = self.rng.uniform(0.05, 2.0)
        return req


async def send(client: httpx.AsyncClient, req: Request, t0: float, hard_timeout: float) -> Outcome:
    out = Outcome(req.kind, bool(req.body["stream"]), time.perf_counter() - t0)
    try:
        if req.disconnect_at is not None:
            try:
                await asyncio.wait_for(_run(client, req, out, t0), req.disconnect_at)
            except asyncio.TimeoutError:
                out.status = "disconnected"
        else:
            await asyncio.wait_for(_run(client, req, out, t0), hard_timeout)
    except asyncio.TimeoutError:
        out.status, out.error = "hung", f"no answer within {hard_timeout:g} s"
    except httpx.HTTPError as e:
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    out.ended = time.perf_counter() - t0
    return out


async def _run(client: httpx.AsyncClient, req: Request, out: Outcome, t0: float) -> None:
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=req.body) as r:
        headers_at = time.perf_counter()
        out.http_status = r.status_code
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            _refusal(out, r, text, headers_at - start)
            return
        if not out.stream:
            await r.aread()
            out.status = "completed"
            return
        last = start
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                code = obj["error"].get("code")
                out.status = "deadline" if code == "deadline_exceeded" else "failed"
                out.error = str(obj["error"].get("message"))
                return
            if any(c.get("text") or c.get("exit_tokens") for c in obj.get("choices", [])):
                now = time.perf_counter()
                if out.ttft is None:
                    out.ttft = now - start
                else:
                    out.itls.append(now - last)
                last = now
                if req.disconnect_after is not None and 1 + len(out.itls) >= req.disconnect_after:
                    out.status = "disconnected"
                    return  # leaving the block closes the connection
        out.status = "completed"


def _refusal(out: Outcome, r: httpx.Response, text: str, latency: float) -> None:
    out.error = f"HTTP {r.status_code}: {text[:200]}"
    if r.status_code == 429:
        out.status = "rejected"
        out.reject_latency = latency
        retry = r.headers.get("Retry-After")
        out.retry_after = int(retry) if retry and retry.isdigit() else None
        out.rejected_by = "engine" if text.lstrip().startswith("{") else "proxy"
    elif r.status_code == 504 and "deadline_exceeded" in text:
        out.status = "deadline"
    else:
        out.status = "failed"


async def open_loop(
    client: httpx.AsyncClient,
    mix: Mix,
    rate: float,
    duration: float,
    t0: float,
    hard_timeout: float,
) -> list[Outcome]:
    """Requests at Poisson arrival times (``rate`` a second) for ``duration`` seconds, whatever
    the server answers (open loop); returns every outcome once the last has ended."""
    begin = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    at = mix.rng.expovariate(rate)
    while at < duration:
        await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(client, mix.draw(), t0, hard_timeout)))
        at += mix.rng.expovariate(rate)
    await asyncio.sleep(max(0.0, begin + duration - time.perf_counter()))
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    client: httpx.AsyncClient,
    mix: Mix,
    concurrency: int,
    duration: float,
    t0: float,
    hard_timeout: float,
) -> list[Outcome]:
    """``concurrency`` clients that each send the next request when their last one ends, for
    ``duration`` seconds (no planned disconnects)."""
    stop_at = time.perf_counter() + duration
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            out = await send(client, mix.draw(disconnects=False), t0, hard_timeout)
            outcomes.append(out)
            if out.status == "rejected":
                await asyncio.sleep(0.1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


# -- sampling ------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    rss_server_mib: float | None
    rss_replicas_mib: float | None
    rss_tree_mib: float | None
    kv_blocks_used: float | None
    running: float | None
    waiting: float | None
    # eeserve_rejection_seconds: cumulative count by upper bound (s), summed over replicas
    reject_buckets: dict[float, float] = field(default_factory=dict)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


def read_gauges(text: str) -> tuple[dict[str, float], list[int]]:
    """Every sample summed by name (over replicas, and over labels: read unlabelled gauges
    only), and the replicas' pids (``eeserve_replica_info``)."""
    sums: dict[str, float] = {}
    pids: list[int] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "eeserve_replica_info":
                pids.append(int(s.labels["pid"]))
            else:  # replicas label every sample with its replica
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    return sums, pids


def only_families(text: str, names: tuple[str, ...]) -> str:
    """The lines of a Prometheus text page whose metric name starts with one of ``names``
    (samples, and their families' ``# TYPE`` and ``# HELP`` lines)."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# TYPE ", "# HELP ")) else line
        if name.startswith(names):
            keep.append(line)
    return "\n".join(keep) + "\n"


def read_sampled(text: str) -> tuple[dict[str, float], list[int], dict[float, float]]:
    """What a sample reads from a ``/metrics`` page: ``read_gauges`` and the 429 histogram
    (``read_histogram``), of the ``SAMPLED`` families only."""
    page = only_families(text, SAMPLED)
    gauges, pids = read_gauges(page)
    return gauges, pids, read_histogram(page, REJECTION_HISTOGRAM)


def read_histogram(text: str, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (``le``), summed over replicas."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + float(s.value)
    return out


def read_limits(text: str) -> dict[str, float]:
    """The admission limits a server (its first replica) reports (``eeserve_admission_limit``)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "eeserve_admission_limit":
                out.setdefault(s.labels["limit"], float(s.value))
    return out


def read_server(
    text: str | None, root: int | None
) -> tuple[dict[str, float], list[int], dict[float, float], tuple[float | None, ...]]:
    """A sample's reading of the server (run in the sampler's process): ``read_sampled`` of its
    ``/metrics`` page (None: no page) and the RSS in MiB of the server process, its replicas and
    its whole process tree (``root``: the server's pid, None: not known)."""
    gauges, pids, rejects = read_sampled(text) if text is not None else ({}, [], {})
    server = rss_mib(root) if root else None
    replicas = _total([rss_mib(p) for p in pids]) if pids else None
    tree = _total([rss_mib(p) for p in process_tree(root)]) if root else None
    return gauges, pids, rejects, (server, replicas, tree)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (a Ray cluster started by the server)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def renice(pid: int, increment: int) -> int:
    """Run every thread of ``pid`` ``increment`` nicer than this process; the number of threads
    set. On Linux a nice value belongs to a thread (``renice`` sets the main thread's alone), and a
    thread started later inherits its creator's."""
    value = os.getpriority(os.PRIO_PROCESS, 0) + increment
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), value)
            count += 1
        except ProcessLookupError:  # the thread has ended
            continue
    return count


class Sampler:
    def __init__(self, client: httpx.AsyncClient, server_pid: int | None, t0: float) -> None:
        self.client = client
        self.server_pid = server_pid
        self.t0 = t0
        self.samples: list[Sample] = []
        # Parsing a page and scanning /proc in a thread of this process held the GIL, and the
        # loop's thread then waited up to the switch interval (5 ms) after each of its system
        # calls: stalls of hundreds of ms, which every request timed meanwhile counted as the
        # server's. A process of its own takes that work off the loop's interpreter.
        # Forked, not spawned (a fresh interpreter would import torch with eeserve, for seconds),
        # and at once, while the client runs no thread but the loop's.
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
        self.pool.submit(rss_mib, os.getpid()).result()

    async def sample(self) -> Sample:
        text = None
        with suppress(httpx.HTTPError):
            text = (await self.client.get("/metrics", timeout=30)).text
        loop = asyncio.get_running_loop()
        gauges, _, rejects, (server, replicas, tree) = await loop.run_in_executor(
            self.pool, read_server, text, self.server_pid
        )
        s = Sample(
            time.perf_counter() - self.t0,
            server,
            replicas,
            tree,
            gauges.get("eeserve_kv_blocks_used"),
            gauges.get("eeserve_num_requests_running"),
            gauges.get("eeserve_num_requests_waiting"),
            rejects,
        )
        self.samples.append(s)
        return s

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    async def run(self, every: float) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(every)

    async def until_idle(self, timeout: float) -> Sample:
        """Sample until the server runs and queues nothing (or ``timeout`` passes)."""
        deadline = time.perf_counter() + timeout
        while True:
            s = await self.sample()
            if s.idle or time.perf_counter() > deadline:
                return s
            await asyncio.sleep(0.5)


class LoopLag:
    """How late the client's event loop wakes from a ``period``-second sleep, as
    ``(t, lag seconds)`` pairs: a loop busy with other requests (or a process the CPU is not
    given) adds this much to any answer the client times."""

    def __init__(self, t0: float, period: float = 0.01) -> None:
        self.t0 = t0
        self.period = period
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            due = time.perf_counter() + self.period
            await asyncio.sleep(self.period)
            now = time.perf_counter()
            self.samples.append((due - self.t0, max(0.0, now - due)))


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
