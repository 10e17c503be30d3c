"""The soak benchmark's view of the server and of itself: sampling, and the client's loop lag.

Contract: ``Sampler`` reads, every few seconds, the RSS of the server's process tree from ``/proc``,
the KV-block and queue gauges from ``/metrics`` (summed over replicas; ``read_sampled`` parses the
``SAMPLED`` families only) and the server's own histogram of how long its 429s took
(``eeserve_rejection_seconds``, cumulative counts by bucket, summed over replicas:
``read_histogram``), all in a forked process of its own (``read_server``), so that the client's
event loop never waits for that work. ``read_gauges`` and ``read_limits`` read a ``/metrics`` page;
``renice`` lowers the priority of every thread of a process; ``realtime`` raises the client's loop
above every normal process while the load runs. ``LoopLag`` records how late the client's own event
loop wakes from a short sleep: every latency the client measures includes that lag, so the records
carry it beside them. ``HealthProbe`` asks ``/health`` every few tens of ms on a connection of its
own and records how long each answer took (None: no answer within its timeout, or not 200): what a
load balancer's health check sees. Times are ``time.perf_counter()`` seconds since the run's ``t0``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eeserve.bench.soak_http import HTTPFailure, LeanClient

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


def read_refusals(text: str) -> dict[str, float]:
    """The 429s a server counted (``/metrics``, summed over replicas): ``replicas``, by admission
    control in the app; ``ingress``, by the ingress gate in Ray's proxy (0 without one)."""
    out = {"replicas": 0.0, "ingress": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "eeserve_admission_rejected_total":
                out["replicas"] += float(s.value)
            elif s.name == "eeserve_ingress_rejected_total":
                out["ingress"] += float(s.value)
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


@contextmanager
def realtime(enabled: bool = True) -> Iterator[str]:
    """While the block runs, the calling thread (the client's event loop) runs at the lowest
    real-time priority, SCHED_RR 1: above every normal process, so that the moments it records
    are when the server's bytes arrive, not when a CPU the server under test keeps busy is next
    free (as with a client on a machine of its own). Processes and threads it starts meanwhile
    run at normal priority (SCHED_RESET_ON_FORK). The thread's policy is restored afterwards.
    Yields what the thread got: ``"SCHED_RR 1"``, or ``"normal"`` and why (not enabled; not
    permitted, which takes root or CAP_SYS_NICE; not Linux)."""
    if not enabled:
        yield "normal"
        return
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except (AttributeError, OSError) as e:
        yield f"normal (real-time refused: {e})"
        return
    try:
        yield "SCHED_RR 1"
    finally:
        os.sched_setscheduler(0, before[0], before[1])


class Sampler:
    """Samples the server through ``client``. Make it before ``client`` opens a connection: its
    process is forked then, and a socket it inherited would stay open after the client closed
    it (a planned disconnect the server would never see)."""

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
        # and at once, while the client runs no thread but the loop's and holds no socket.
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

    async def run(self, every: float) -> None:
        """Sample every ``every`` seconds until cancelled; then the sampling process ends (a
        later ``until_idle`` or ``sample`` is refused)."""
        try:
            while True:
                await self.sample()
                await asyncio.sleep(every)
        finally:
            self.pool.shutdown(cancel_futures=True)

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


class HealthProbe:
    """``GET /health`` every ``period`` seconds on a ``LeanClient`` (and connection) of its own, as
    ``(t, seconds to the answer or None)`` pairs; None: no 200 within ``timeout`` seconds."""

    def __init__(self, base: str, t0: float, period: float = 0.05, timeout: float = 5.0) -> None:
        self.client = LeanClient(base)
        self.t0 = t0
        self.period = period
        self.timeout = timeout
        self.samples: list[tuple[float, float | None]] = []

    async def run(self) -> None:
        try:
            while True:
                start = time.perf_counter()
                took: float | None = None
                with suppress(HTTPFailure, asyncio.TimeoutError):
                    if await asyncio.wait_for(self._ask(), self.timeout) == 200:
                        took = time.perf_counter() - start
                self.samples.append((start - self.t0, took))
                await asyncio.sleep(max(0.0, start + self.period - time.perf_counter()))
        finally:
            await self.client.aclose()

    async def _ask(self) -> int:
        async with self.client.stream("GET", "/health") as r:
            await r.aread()
            return r.status_code


def _total(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
