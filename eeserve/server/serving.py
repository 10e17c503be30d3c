"""The two generation endpoints: validated request -> engine requests -> JSON or an SSE stream.

Contract: ``generate(ctx, request, body, kind)`` checks the model name and the number of choices and
takes the request's place in admission control's queue from what its body alone says it may cost
(``cost_bound.estimate``: no templating, no tokenizing), so that a request beyond the limits is
refused before any expensive work. Then it turns the body into engine requests with ``prepare`` (the
one implementation shared with batch files: tokenization, ``SamplingParams``, ``ExitParams``) on the
preparation thread (``prepare_thread.Preparer``), queues them atomically on the engine loop with
their exact costs (a prompt that does not fit the context is a 400 naming the lengths) and answers
either with one JSON body or with ``text/event-stream`` chunks ending in ``data: [DONE]``. A client
that goes away (mid-stream or while waiting for a whole response) gets its engine requests aborted,
which frees their KV blocks. A request beyond the admission limits is a 429 with ``Retry-After``
(OpenAI's ``rate_limit_exceeded``; ``type`` says which limit: ``requests``, ``tokens`` or
``queue_seconds``). A request whose time limit (its ``request_timeout`` field or the server's,
whichever is shorter) passes is aborted and answered with a 504 ``deadline_exceeded`` body, or, once
streaming, with an error event before ``[DONE]``. Every problem is an ``ApiError`` rendered as an
OpenAI error body by the app.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from eeserve.outputs import CompletionOutput
from eeserve.server.admission import Overloaded, Ticket
from eeserve.server.cost_bound import PromptBounds, estimate
from eeserve.server.engine_loop import EngineLoop, ShuttingDown
from eeserve.server.formatting import Formatter, Kind, TokenStrings
from eeserve.server.generation import DeadlineExceeded, Generation, GenerationError
from eeserve.server.metrics import ServerMetrics
from eeserve.server.prepare import (
    ApiError,
    GenerationRequest,
    ModelInfo,
    Prepared,
    check_model,
    engine_refusal,
    error_body,
)
from eeserve.server.prepare_thread import Preparer
from eeserve.server.refusal import held_ticket, overloaded_error


@dataclass
class ServingContext:
    engine_loop: EngineLoop
    info: ModelInfo
    strings: TokenStrings
    metrics: ServerMetrics
    exit_config: dict[str, Any]  # GET /v1/eeserve/exit_config (formatting.exit_config_summary)
    preparer: Preparer
    bounds: PromptBounds
    request_timeout: float | None = None  # seconds; the server-wide time limit of a request


# -- running ------------------------------------------------------------------------------------


async def generate(
    ctx: ServingContext,
    request: Request,
    req: GenerationRequest,
    kind: Kind,
) -> Response:
    check_model(ctx.info, req)
    held = held_ticket(request.scope.setdefault("state", {}))
    if held is not None:
        held.release()  # traded for the reservation from its body, at once
    try:
        ticket = ctx.engine_loop.reserve(estimate(ctx.bounds, ctx.info, req))
    except (Overloaded, ShuttingDown) as e:
        raise _refused(ctx, e) from e
    try:
        prep = await ctx.preparer.prepare(req, kind)
        gen = await _queue(ctx, req, prep, ticket)
    finally:
        ticket.release()  # nothing to give back once the engine loop settled it
    fmt = Formatter(
        kind,
        req.model,
        ctx.strings,
        ctx.info.num_layers,
        len(prep.specs),
        prep.top_logprobs,
        prep.stop,
        tool_calls=prep.tool_calls,
    )
    run = _Run(ctx, request.url.path, gen, fmt, prep.prompt_lens)
    if req.stream:
        run.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(run)
    return await run.whole(request)


async def _queue(
    ctx: ServingContext, req: GenerationRequest, prep: Prepared, ticket: Ticket
) -> Generation:
    """The prepared request's engine requests, queued on the engine loop."""
    limits = [t for t in (req.request_timeout, ctx.request_timeout) if t is not None]
    timeout = min(limits) if limits else None
    try:
        return await ctx.engine_loop.add(prep.specs, prep.exit_params, timeout, ticket)
    except (Overloaded, ShuttingDown) as e:
        raise _refused(ctx, e) from e
    except ValueError as e:
        raise engine_refusal(e, prep) from e


def _refused(ctx: ServingContext, e: Overloaded | ShuttingDown) -> ApiError:
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), type_="service_unavailable", code="shutting_down")
    ctx.metrics.admission_rejected.labels(e.limit).inc()
    return overloaded_error(e)


@dataclass
class _Run:
    ctx: ServingContext
    endpoint: str
    gen: Generation
    fmt: Formatter
    prompt_lens: list[int]
    include_usage: bool = False
    status: str | None = None

    def close(self) -> None:
        self.gen.abort()  # a no-op once every choice has finished
        if self.status is None:
            self.status = "aborted"
        self.ctx.metrics.request_done(self.endpoint, self.status)

    async def whole(self, request: Request) -> Response:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, self.gen))
        finals: dict[int, CompletionOutput] = {}
        try:
            async for index, out in self.gen.stream():
                if out.finished:
                    finals[index] = out.outputs[0]
            if not self.gen.cancelled:
                self.status = "success"
        except GenerationError as e:
            self.status = _status(e)
            return JSONResponse(error_body(str(e), e.type, None, e.code), status_code=e.status)
        finally:
            watcher.cancel()
            self.close()
        if self.gen.cancelled:
            return Response(status_code=499)  # nobody is listening any more
        body = self.fmt.response([finals[i] for i in range(len(finals))], self.prompt_lens)
        return JSONResponse(body)

    async def events(self) -> AsyncIterator[str]:
        try:
            for start in self.fmt.start_chunks():
                yield _sse(start)
            async for index, out in self.gen.stream():
                chunk = self.fmt.delta_chunk(index, out.outputs[0])
                if chunk is not None:
                    yield _sse(chunk)
            if self.gen.cancelled:
                return
            if self.include_usage:
                yield _sse(self.fmt.usage_chunk(self.prompt_lens))
            self.status = "success"
        except GenerationError as e:
            self.status = _status(e)
            yield _sse(error_body(str(e), e.type, code=e.code or str(e.status)))
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """SSE response that aborts the generation however the response ends (even unstarted)."""

    def __init__(self, run: _Run) -> None:
        super().__init__(
            run.events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()


def _status(e: GenerationError) -> str:
    return "timeout" if isinstance(e, DeadlineExceeded) else "error"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not gen.finished:
                gen.cancel()
            return
