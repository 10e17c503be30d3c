"""The serving side of the engine: admission control, the consumers' generations and the
metrics, over an engine core that runs on a thread of its own or in a process of its own.

Contract:
- ``EngineLoop(engine, metrics, limits, nice, host)`` (``limits``: the engine's defaults when
  omitted; ``nice``: how much nicer than the serving threads the engine's thread runs,
  ``--engine-nice``; ``host``: ``EngineHost.THREAD``, the default, or ``EngineHost.PROCESS``,
  ``--engine-host``) is started with ``start(loop)`` from inside the asyncio event loop that
  will consume its outputs. From then on every engine call happens in the engine core
  (``engine_core.EngineCore``: a worker thread, or a forked engine process, ``engine_host``);
  this object lives on the event loop's thread and talks to the core in commands and reports.
- ``reserve(estimate)`` (on the event loop, before a request is templated and tokenized) takes
  its place in admission control's queue (``admission.Admission.reserve``: ``Overloaded`` at
  once beyond the limits; ``ShuttingDown`` while draining) and returns its ``Ticket``.
- ``await add(choices, exit_params, timeout, ticket)`` settles the ticket with the group's exact
  costs (``Overloaded`` when they pass a limit; without a ticket the group is checked as it
  is), then adds its engine requests in the core, all or none (``engine_requests.admit``: the
  engine's ``ValueError`` and ``RequestRejected`` are raised to the caller). It returns a
  ``Generation`` (``server.generation``) whose ``stream()`` yields ``(choice_index,
  RequestOutput)`` in engine order until every choice has finished; with a ``timeout``
  (seconds) the generation is aborted when it runs out and its stream raises
  ``DeadlineExceeded``.
- ``Generation.cancel()`` (client gone) aborts the unfinished engine requests, freeing their KV
  blocks, and ends the stream; ``abort()`` only aborts.
- Outputs of one engine step reach the generations in one call on the event loop.
- ``begin_drain(timeout)`` (graceful shutdown): new work is refused with ``ShuttingDown``;
  requests still running after ``timeout`` seconds are aborted and their streams raise
  ``GenerationError``. ``stop()`` ends the core the same way and waits for it. An engine
  process that dies ends every request it held with a 503 and leaves the loop stopped.
- Metrics (tokens, TTFT, inter-token latency, exit layers, gauges) are recorded on the event
  loop from the core's reports, and so is each step's duration, prompt tokens computed and
  tokens generated (``throughput.ThroughputMeter``: the rates admission control turns its queue
  into seconds with).
- The engine comes built (``server.startup.build_engine``); the loop only drives it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from itertools import count

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
from eeserve.server.engine_core import (
    Abort,
    Add,
    Drain,
    EngineHost,
    Failed,
    Gauges,
    Reply,
    Report,
    Stepped,
)
from eeserve.server.engine_host import ProcessHost, ThreadHost, host_for
from eeserve.server.engine_requests import ChoiceSpec
from eeserve.server.generation import Batch, Generation, GenerationError, put_all
from eeserve.server.metrics import ServerMetrics
from eeserve.server.throughput import ThroughputMeter


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
        host: EngineHost = EngineHost.THREAD,
    ) -> None:
        self.metrics = metrics
        self.meter = ThroughputMeter()
        self.admission = Admission(
            limits or resolve_limits(ServingLimits(), engine),
            engine_capacity(engine),
            self.meter.rates,
        )
        self.num_layers = engine.model_config.num_layers
        self._host = host_for(host, engine, nice)
        self._host.on_end = self._on_end
        bm = engine.block_manager
        self._update_gauges(
            Gauges(running=0, waiting=0, kv_blocks_free=bm.num_free_blocks, kv_blocks=bm.num_blocks)
        )
        self._tracked: dict[str, _Tracked] = {}
        self._calls: dict[int, tuple[asyncio.Future[None], Generation]] = {}
        self._ids = count()
        self._deadline: float | None = None
        self._stopping = False

    # -- lifecycle (event-loop side) ------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._host.start(loop, self._on_report)

    @property
    def alive(self) -> bool:
        return self._host.alive

    @property
    def stopped(self) -> bool:
        """Started once and no longer running (a crash, or ``stop``)."""
        return self._host.started and not self._host.alive

    @property
    def engine_thread_id(self) -> int | None:
        """The native id of the thread that steps the engine, where it is one of this process's
        (``EngineHost.THREAD``, once started); None otherwise."""
        host = self._host
        if not isinstance(host, ThreadHost) or host.thread is None:
            return None
        return host.thread.native_id

    @property
    def engine_process_id(self) -> int | None:
        """The engine process's pid (``EngineHost.PROCESS``, once started); None otherwise."""
        host = self._host
        if not isinstance(host, ProcessHost) or host.process is None:
            return None
        return host.process.pid

    @property
    def draining(self) -> bool:
        return self._deadline is not None or self._stopping

    def begin_drain(self, timeout: float) -> None:
        """Refuse new work; abort what is still running ``timeout`` seconds from now."""
        if self._deadline is None:
            self._deadline = time.monotonic() + max(0.0, timeout)
            self._host.post(Drain(deadline=self._deadline))

    def stop(self, join_timeout: float = 10.0) -> None:
        self._stopping = True
        self._host.stop(join_timeout)

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
        # Tracked before the core hears of them: their outputs may come right after its reply.
        now = time.monotonic()
        for i, rid in enumerate(gen.request_ids):
            self._tracked[rid] = _Tracked(gen, i, arrival=now, last=now)
        call = Add(
            id=next(self._ids),
            request_ids=gen.request_ids,
            choices=choices,
            exit_params=exit_params,
        )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[call.id] = (future, gen)
        if not self._host.post(call):
            del self._calls[call.id]
            future.set_exception(ShuttingDown("the engine thread has stopped"))
        try:
            await future  # the reply has set the prompt ids (before any output could come)
        except BaseException:
            gen.abort()  # posted after the add, so it runs after it; gives back the admission
            raise
        for ids in gen.prompt_token_ids:
            self.metrics.prompt_tokens.inc(len(ids))
        return gen

    def abort(self, request_ids: list[str]) -> None:
        mine = [rid for rid in request_ids if self._tracked.pop(rid, None) is not None]
        if mine:
            self._host.post(Abort(request_ids=mine))

    # -- reports (event-loop side) --------------------------------------------------------------

    def _on_report(self, report: Report) -> None:
        if isinstance(report, Stepped):
            self._stepped(report)
        elif isinstance(report, Reply):
            self._replied(report)
        elif isinstance(report, Failed):
            self._fail(report.request_ids, report.message, report.status)
        self._update_gauges(report.gauges)

    def _replied(self, reply: Reply) -> None:
        future, gen = self._calls.pop(reply.id, (None, None))
        if future is None or gen is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            gen.prompt_token_ids = reply.prompt_token_ids
            future.set_result(None)

    def _stepped(self, report: Stepped) -> None:
        batch = Batch()
        generated = 0
        for out in report.outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            gen = tracked.generation
            out.prompt_token_ids = gen.prompt_token_ids[tracked.index]
            generated += self._record(tracked, out, report.at)
            if out.finished:
                del self._tracked[out.request_id]
            batch.items.append((gen, (tracked.index, out)))
        self.meter.record(report.seconds, report.prefilled, generated)
        put_all(batch)

    def _fail(self, request_ids: list[str], message: str, status: int) -> None:
        gens: dict[int, Generation] = {}
        for rid in request_ids:
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                gens[id(tracked.generation)] = tracked.generation
        put_all(Batch([(gen, GenerationError(message, status)) for gen in gens.values()]))

    def _on_end(self) -> None:
        """The engine process is gone: what it held ends with a 503, pending adds with a
        shutdown."""
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(ShuttingDown("the engine process has stopped"))
        self._calls.clear()
        message = (
            "the server shut down before the request finished"
            if self.draining
            else "the engine process stopped"
        )
        self._fail(list(self._tracked), message, 503)

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

    def _update_gauges(self, g: Gauges) -> None:
        m = self.metrics
        m.running.set(g.running)
        m.waiting.set(g.waiting)
        m.kv_blocks_free.set(g.kv_blocks_free)
        m.kv_blocks_used.set(g.kv_blocks - g.kv_blocks_free)
