"""The 429 of admission control, and its earliest form: before a request's body is even read.

Contract: ``overloaded_error(e)`` is the ``ApiError`` an ``admission.Overloaded`` is answered
with: 429, ``Retry-After``, OpenAI's ``rate_limit_exceeded`` and a ``type`` naming the limit
(``requests``, ``tokens`` or ``queue_seconds``). ``EarlyRefusal`` is pure ASGI middleware in
front of the routes (behind authentication): while the queue could take no request at all,
whatever its body (``Admission.refusal_for_any``: even the cheapest request would pass a limit),
a ``POST`` to a generation path is answered with that 429 at once, its body drained unread,
and counted as the route would count it (``eeserve_requests_total{status="overloaded"}``,
``eeserve_admission_rejected_total``). Everything else, and every request while the engine
loop drains or has stopped (the route answers 503), goes on to the routes.

Why before the body: under a burst of hundreds of requests, parsing and validating each body
with the framework costs the event loop about 0.3 ms a request on this project's 2-core VM, so
the last refusals of a 400-request burst came about 120 ms after it began even on an idle
engine; a refusal that needs no body costs a small part of that.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from eeserve.server.admission import Limit, Overloaded
from eeserve.server.engine_loop import EngineLoop
from eeserve.server.metrics import ServerMetrics
from eeserve.server.prepare import ApiError

_API_TYPES = {
    Limit.WAITING_REQUESTS: "requests",
    Limit.QUEUED_TOKENS: "tokens",
    Limit.QUEUE_SECONDS: "queue_seconds",
}


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
        refused = loop.admission.refusal_for_any()
        if refused is None:
            await self.app(scope, receive, send)
            return
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
