"""The 429 of admission control, and its earliest form: before a request's body is even read.

Contract: ``overloaded_error(e)`` is the ``ApiError`` an ``admission.Overloaded`` is answered
with: 429, ``Retry-After``, OpenAI's ``rate_limit_exceeded`` and a ``type`` naming the limit
(``requests``, ``tokens`` or ``queue_seconds``). ``EarlyRefusal`` is pure ASGI middleware in
front of the routes (behind authentication). A ``POST`` to a generation path takes a place in
the queue at the least any request can cost (``LEAST``: one engine request of one prompt token
and one output token) before its body is read. Where even that passes a limit it is answered
with that 429 at once, its body drained unread, and counted as the route would count it
(``eeserve_requests_total{status="overloaded"}``, ``eeserve_admission_rejected_total``).
Otherwise it waits until the burst it came in has stopped arriving (``arrivals.Arrivals``:
at most 50 ms) and goes on to the route with its place in the
ASGI scope's ``state``; the route takes it out with ``held_ticket(state)`` and trades it for a
reservation from its body, and whatever the route does, the place is given back when the
request ends. Everything else, and every request while the engine loop drains or has stopped
(the route answers 503), goes on to the routes untouched.

Why before the body: under a burst of hundreds of requests, parsing and validating each body
with the framework costs the event loop about 0.3 ms a request on this project's 2-core VM, so
the last refusals of a 400-request burst came about 120 ms after it began even on an idle
engine; a refusal that needs no body costs a small part of that (14 us against 0.6 ms,
measured in-process). Why a place before the body, and the wait: a burst's requests are
handled in the order they came, each up to its first wait, so without them the requests that
the queue takes were each parsed before the refusals behind them were answered (~60 of them,
~30 ms of the event loop); held at their least from the start, they count against the queue at
once, and the refusals go first.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from eeserve.server.admission import Cost, Estimate, Limit, Overloaded, Ticket
from eeserve.server.arrivals import Arrivals
from eeserve.server.engine_loop import EngineLoop
from eeserve.server.metrics import ServerMetrics
from eeserve.server.prepare import ApiError

# The least a generation request can cost: one engine request, one prompt and one output token.
LEAST = Estimate(choices=1, low=Cost(1, 1))
# Where a request that passed carries its place in the queue to the route (``held_ticket``).
HELD_STATE = "eeserve_held"

_API_TYPES = {
    Limit.WAITING_REQUESTS: "requests",
    Limit.QUEUED_TOKENS: "tokens",
    Limit.QUEUE_SECONDS: "queue_seconds",
}


def held_ticket(state: dict[str, Any]) -> Ticket | None:
    """The place ``EarlyRefusal`` took in the queue for a request (from its ASGI scope's
    ``state``), handed over once: the route releases it as it reserves its own."""
    held = state.pop(HELD_STATE, None)
    return held if isinstance(held, Ticket) else None


def limit_type(limit: Limit) -> str:
    """The 429 error's ``type`` for a refusal by ``limit``."""
    return _API_TYPES[limit]


def overloaded_error(e: Overloaded) -> ApiError:
    return ApiError(
        429,
        str(e),
        type_=limit_type(e.limit),
        code="rate_limit_exceeded",
        headers={"Retry-After": str(e.retry_after)},
    )


class EarlyRefusal:
    def __init__(
        self,
        app: ASGIApp,
        engine_loop: EngineLoop,
        metrics: ServerMetrics,
        paths: tuple[str, ...],
    ) -> None:
        self.app = app
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.paths = paths
        self.arrivals = Arrivals()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = self.engine_loop
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or path not in self.paths
            or loop.draining
            or not loop.alive
        ):
            await self.app(scope, receive, send)
            return
        self.arrivals.arrived()
        try:
            held = loop.admission.reserve(LEAST)
        except Overloaded as e:
            await self._refuse(e, path, receive, send)
            return
        scope.setdefault("state", {})[HELD_STATE] = held
        try:
            # Behind the requests that came with it: those the queue has no room for left are
            # refused (microseconds each) before this one's body is parsed (the better part of
            # a millisecond).
            await self.arrivals.settled()
            await self.app(scope, receive, send)
        finally:
            held.release()  # a no-op once the route has traded it for its own reservation

    async def _refuse(self, refused: Overloaded, path: str, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass  # already buffered: reading it keeps the connection usable
        self.metrics.admission_rejected.labels(refused.limit).inc()
        self.metrics.request_done(path, "overloaded")
        error = overloaded_error(refused)
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
