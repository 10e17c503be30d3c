"""One background thread that owns the engine and drives ``engine.step()`` while there is work.

Contract:
- ``EngineLoop(engine, metrics, limits, nice)`` (``limits``: the engine's defaults when omitted;
  ``nice``: how much nicer than its creator the worker thread runs, ``--engine-nice``) is
  started with ``start(loop)`` from inside the asyncio event loop that will consume its
  outputs. From then on every engine call (``add_request``, ``abort_request``, ``tokenize``,
  ``step``) happens on the loop's single worker thread; other threads only post commands to it
  (a deque plus a wake-up event), so no lock is needed.
- ``reserve(estimate)`` (on the event loop, before a request is templated and tokenized) takes
  its place in admission control's queue (``admission.Admission.reserve``: ``Overloaded`` at
  once beyond the limits; ``ShuttingDown`` while draining) and returns its ``Ticket``.
- ``await add(choices, exit_params, timeout, ticket)`` settles the ticket with the group's exact
  costs (``Overloaded`` when they pass a limit; without a ticket the group is checked as it
  is), then adds its engine requests on the worker thread, all or none
  (``engine_requests.admit``: the engine's ``ValueError`` and ``RequestRejected`` are raised to
  the caller). It returns a ``Generation`` (``server.generation``) whose
  ``stream()`` yields ``(choice_index, RequestOutput)`` in engine order until every choice has
  finished; with a ``timeout`` (seconds) the generation is aborted when it runs out and its
  stream raises ``DeadlineExceeded``.
- ``Generation.cancel()`` (client gone) aborts the unfinished engine requests, freeing their KV
  blocks, and ends the stream; ``abort()`` only aborts.
- Outputs of one engine step are handed to the event loop with one ``call_soon_threadsafe``.
- ``begin_drain(timeout)`` (graceful shutdown): new work is refused with ``ShuttingDown``;
  requests still running after ``timeout`` seconds are aborted and their streams raise
  ``GenerationError``. ``stop()`` ends the thread the same way and joins it.
- Metrics (tokens, TTFT, inter-token latency, exit layers, gauges) are recorded on the thread,
  and so is each step's duration, prompt tokens computed and tokens generated
  (``throughput.ThroughputMeter``: the rates admission control turns its queue into seconds
  with).
- The engine comes built (``server.startup.build_engine``); the loop only drives it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.outputs import RequestOutput
from eeserve.server.admission import (
    Admission,
    AdmissionLimits,
    Cost,
    Estimate,
    ServingLimits,
    Ticket,
    engine_capacity,
    resolve_limits,
)
from eeserve.server.engine_requests import ChoiceSpec, admit
from eeserve.server.generation import Batch, Generation, GenerationError, put_all
from eeserve.server.metrics import ServerMetrics
from eeserve.server.throughput import ThroughputMeter

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


class ShuttingDown(RuntimeError):
    """The server is draining and takes no new requests."""


@dataclass
class _Tracked:
    generation: Generation
    index: int
    arrival: float
    last: float = 0.0
    seen_tokens: int = 0
    seen_drafted: int = 0
    seen_accepted: int = 0


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        limits: AdmissionLimits | None = None,
        nice: int = 0,
    ) -> None:
        self.engine = engine
        self.nice = nice  # the engine thread's niceness above its creator's
        self.metrics = metrics
        self.meter = ThroughputMeter()
        self.admission = Admission(
            limits or resolve_limits(ServingLimits(), engine),
            engine_capacity(engine),
            self.meter.rates,
        )
        self.num_layers = engine.model_config.num_layers
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline: float | None = None
        self._closing = threading.Lock()
        self._closed = False

    # -- lifecycle (event-loop side) ------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="eeserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        """Started once and no longer running (a crash, or ``stop``)."""
        return self._thread is not None and not self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._deadline is not None or self._stopping

    def begin_drain(self, timeout: float) -> None:
        """Refuse new work; abort what is still running ``timeout`` seconds from now."""
        if self._deadline is None:
            self._deadline = time.monotonic() + max(0.0, timeout)
            self._wake.set()

    def stop(self, join_timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(join_timeout)

    # -- requests (event-loop side) -------------------------------------------------------------

    def reserve(self, estimate: Estimate) -> Ticket:
        if self.draining or not self.alive:
            raise ShuttingDown("the server is shutting down")
        return self.admission.reserve(estimate)

    async def add(
        self,
        choices: list[ChoiceSpec],
        exit_params: ExitParams | None,
        timeout: float | None = None,
        ticket: Ticket | None = None,
    ) -> Generation:
        # What a request may hold of the KV pool: its prompt and every token it may generate.
        costs = [Cost(len(c.prompt_token_ids), c.params.max_tokens) for c in choices]
        ticket = ticket or self.reserve(Estimate.exact(costs))
        if self.draining or not self.alive:
            ticket.release()
            raise ShuttingDown("the server is shutting down")
        self.admission.settle(ticket, costs)
        gen = Generation(self.abort, len(choices))
        gen.hold(self.admission, costs)
        if timeout is not None:
            gen.set_deadline(timeout)
        future = self._post(lambda: self._add(gen, choices, exit_params))
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            gen.abort()  # queued after the add, so it runs after it; gives back the admission
            raise
        return gen

    def abort(self, request_ids: list[str]) -> None:
        self._post(lambda: self._abort(request_ids, "aborted"))

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._closing:
            if self._closed:
                future.set_exception(ShuttingDown("the engine thread has stopped"))
                return future
            self._commands.append((fn, future))
        self._wake.set()
        return future

    # -- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        message = "the server shut down before the request finished"
        if self.nice:  # Linux: a thread's own niceness (PRIO_PROCESS with its thread id)
            own = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, own, os.getpriority(os.PRIO_PROCESS, own) + self.nice)
        try:
            while not self._stopping:
                self._wake.clear()
                self._run_commands()
                if self._stopping:
                    break
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._fail_all(message)
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait(_IDLE_WAIT_S)
        except BaseException:
            log.exception("the engine thread crashed")
            message = "the engine thread crashed"
            raise
        finally:
            with self._closing:  # commands posted from now on fail at once
                self._stopping = self._closed = True
                self._run_commands()
            self._fail_all(message)
            self._update_gauges()

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the awaiting coroutine
                future.set_exception(e)
        self._update_gauges()

    def _step(self) -> None:
        prefilling = self._prefilling()
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(f"engine error: {type(e).__name__}: {e}", 500)
            return
        took = time.perf_counter() - start
        prefilled = _prefilled(prefilling)
        if not outputs:
            self.meter.record(took, prefilled, 0)
            time.sleep(0.001)  # nothing schedulable right now; do not spin
            return
        now = time.monotonic()
        batch = Batch()
        generated = 0
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            generated += self._record(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
            batch.items.append((tracked.generation, (tracked.index, out)))
        self.meter.record(took, prefilled, generated)
        self._deliver(batch)
        self._update_gauges()

    def _prefilling(self) -> list[tuple[Any, int]]:
        """The sequences with prompt tokens still to compute, and how many they have computed
        (``_prefilled`` after the step)."""
        sched = self.engine.scheduler
        return [
            (s, s.num_computed_tokens)
            for s in chain(sched.running, sched.waiting)
            if s.num_computed_tokens < s.num_prompt_tokens
        ]

    def _deliver(self, batch: Batch) -> None:
        if batch.items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(put_all, batch)

    def _add(self, gen: Generation, choices: list[ChoiceSpec], ep: ExitParams | None) -> None:
        gen.prompt_token_ids = admit(self.engine, gen.request_ids, choices, ep)
        now = time.monotonic()
        for i, rid in enumerate(gen.request_ids):
            self._tracked[rid] = _Tracked(gen, i, arrival=now, last=now)
            self.metrics.prompt_tokens.inc(len(gen.prompt_token_ids[i]))

    def _abort(self, request_ids: list[str], why: str) -> None:
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                log.debug("request %s %s", rid, why)

    def _fail_all(self, message: str, status: int = 503) -> None:
        if not self._tracked:
            return
        batch = Batch()
        gens: dict[int, Generation] = {}
        for rid, tracked in list(self._tracked.items()):
            self.engine.abort_request(rid)
            gens[id(tracked.generation)] = tracked.generation
        self._tracked.clear()
        for gen in gens.values():
            batch.items.append((gen, GenerationError(message, status)))
        self._deliver(batch)

    def _record(self, tracked: _Tracked, out: RequestOutput, now: float) -> int:
        """Record a request's new tokens in the metrics; their number."""
        c = out.outputs[0]
        new = len(c.token_ids) - tracked.seen_tokens
        if new <= 0:
            return 0
        m = self.metrics
        if tracked.seen_tokens == 0:
            m.time_to_first_token.observe(now - tracked.arrival)
        else:
            m.inter_token_latency.observe((now - tracked.last) / new)
        tracked.last = now
        m.generation_tokens.inc(new)
        for layer in c.exit_layers[tracked.seen_tokens :]:
            m.exit_layer.observe(layer)
            m.layers_saved.inc(self.num_layers - layer)
            m.layers_total.inc(self.num_layers)
        tracked.seen_tokens = len(c.token_ids)
        self._record_spec(tracked, out)
        return new

    def _record_spec(self, tracked: _Tracked, out: RequestOutput) -> None:
        """Drafted / accepted counters from the request's running totals (speculative mode)."""
        st = out.outputs[0].exit_stats
        if st is None or st.num_drafted is None:
            return
        self.metrics.spec_drafted.inc(st.num_drafted - tracked.seen_drafted)
        self.metrics.spec_accepted.inc((st.num_accepted or 0) - tracked.seen_accepted)
        tracked.seen_drafted, tracked.seen_accepted = st.num_drafted, st.num_accepted or 0

    def _update_gauges(self) -> None:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        m = self.metrics
        m.running.set(len(sched.running))
        m.waiting.set(len(sched.waiting))
        m.kv_blocks_free.set(bm.num_free_blocks)
        m.kv_blocks_used.set(bm.num_blocks - bm.num_free_blocks)


def _prefilled(before: list[tuple[Any, int]]) -> int:
    """Prompt tokens computed since ``EngineLoop._prefilling`` took ``before`` (a preempted
    sequence, which starts again from 0, counts none)."""
    return sum(
        max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - done) for seq, done in before
    )
