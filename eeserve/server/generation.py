"""The consumer's handle on a group of engine requests: its output queue, abort and deadline.

Contract: a ``Generation`` is made by the engine loop for one HTTP request (one engine request
per choice) and used on the event loop's thread only. ``stream()`` yields ``(choice_index,
RequestOutput)`` in engine order until every choice has finished, and raises the
``GenerationError`` the engine loop delivers (a shutdown, an engine failure) or
``DeadlineExceeded`` once the request's time limit has passed. ``abort()`` aborts the
unfinished engine requests (their KV blocks are freed), gives back what the request held in
admission control and stops its deadline timer; ``cancel()`` (client gone) also ends the stream.
``hold(admission, costs)`` makes the generation report each choice to admission control:
started when it produces its first output (``put_all``, which the engine loop schedules on the
event loop for each engine step's outputs), released when it ends without one, finished when it
ends after. ``set_deadline(timeout)``
aborts the generation ``timeout`` seconds from now and ends its stream with
``DeadlineExceeded`` (status 504).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from eeserve.outputs import RequestOutput
from eeserve.server.admission import Admission, Cost


class GenerationError(RuntimeError):
    """The engine could not finish a request: 503 for a shutdown, 500 for an engine failure."""

    def __init__(
        self, message: str, status: int = 500, type_: str = "server_error", code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.code = code


class DeadlineExceeded(GenerationError):
    """The request's time limit passed before it finished: aborted, answered with 504."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"the request did not finish within its time limit of {timeout:g} s; it was aborted",
            504,
            "timeout_error",
            "deadline_exceeded",
        )


class _Cancelled:
    """Queue sentinel: the consumer went away."""


Item = tuple[int, RequestOutput] | GenerationError | _Cancelled


class Generation:
    def __init__(self, abort: Callable[[list[str]], None], num_choices: int) -> None:
        self.id = uuid.uuid4().hex
        self.request_ids = [f"{self.id}-{i}" for i in range(num_choices)]
        self.prompt_token_ids: list[list[int]] = []
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.cancelled = False
        self.expired: DeadlineExceeded | None = None
        self._abort = abort
        self._pending = set(range(num_choices))
        self._admission: Admission | None = None
        self._costs: dict[int, Cost] = {}  # choice -> admission cost, until its first output
        self._running: dict[int, Cost] = {}  # choice -> its cost, from its first output to its end
        self._timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return not self._pending

    def hold(self, admission: Admission, costs: list[Cost]) -> None:
        self._admission = admission
        self._costs = dict(enumerate(costs))

    def set_deadline(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout, self._expire, timeout)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._pending:
            if self.expired is not None:  # before outputs that a slow reader left queued
                raise self.expired
            item = await self.queue.get()
            if isinstance(item, _Cancelled):
                return
            if isinstance(item, GenerationError):
                raise item
            index, out = item
            if out.finished:
                self._pending.discard(index)
            yield index, out
        self._stop_timer()

    def abort(self) -> None:
        self._stop_timer()
        self._release()
        if self._pending:
            self._abort([self.request_ids[i] for i in sorted(self._pending)])

    def cancel(self) -> None:
        self.cancelled = True
        self.abort()
        self.queue.put_nowait(_Cancelled())

    def deliver(self, item: Item) -> None:
        """One item from the engine thread (on the event loop)."""
        if isinstance(item, tuple):
            self._progress(*item)
        else:
            self._release()
        if not self.cancelled:
            self.queue.put_nowait(item)

    def _progress(self, index: int, out: RequestOutput) -> None:
        adm = self._admission
        if adm is None:
            return
        cost = self._costs.pop(index, None)
        if cost is not None:
            adm.started(cost)
            self._running[index] = cost
        if out.finished and index in self._running:
            adm.finished(self._running.pop(index), len(out.outputs[0].token_ids))

    def _release(self) -> None:
        if self._admission is not None:
            for cost in self._costs.values():
                self._admission.released(cost)
            for cost in self._running.values():
                self._admission.finished(cost)
        self._costs.clear()
        self._running.clear()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, timeout: float) -> None:
        self._timer = None
        if self.finished or self.cancelled:
            return
        self.expired = DeadlineExceeded(timeout)
        self.abort()
        self.queue.put_nowait(self.expired)


@dataclass
class Batch:
    """The items of one engine step, handed to the event loop in one call."""

    items: list[tuple[Generation, Item]] = field(default_factory=list)


def put_all(batch: Batch) -> None:
    for gen, item in batch.items:
        gen.deliver(item)
