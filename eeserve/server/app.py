"""The FastAPI application: routes, bearer-token auth, OpenAI-style errors, lifespan.

Contract: ``create_app(engine, ...)`` wraps an ``LLMEngine`` (which it then owns: from startup on
only the app's engine thread touches it) and returns an ASGI app serving ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus
text; ``metrics_view`` may render it otherwise, as replicas do to show every replica's), ``GET
/v1/eeserve/exit_config`` (the model's exit layers, measures, default and calibrated thresholds),
the OpenAPI docs at ``/docs`` and, unless ``ui=False``, the playground page at ``/``
(``server.ui``). The engine thread starts in the lifespan startup and stops at shutdown. With
``api_key`` every path except ``/health`` and the playground's static files needs ``Authorization:
Bearer <api_key>`` (401 otherwise). Every error, including malformed JSON, a missing field, a wrong
type and an out-of-range value, is answered with ``{"error": {"message", "type", "param",
"code"}}``; validation problems are 400s whose ``param`` names the field. ``limits``
(``admission.ServingLimits``) bounds the waiting work in requests, tokens and seconds (429 with
``Retry-After`` beyond it; ``RejectionTimer`` times each 429 from the request's arrival;
``refusal.EarlyRefusal`` answers it before the body is read while the queue can take no request at
all) and sets the server-wide time limit of a request. Requests are templated and tokenized on a
thread of their own (``prepare_thread.Preparer``), started with the app and ended at shutdown.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eeserve import __version__
from eeserve.engine.llm_engine import LLMEngine
from eeserve.server.admission import ServingLimits, resolve_limits
from eeserve.server.cost_bound import PromptBounds
from eeserve.server.engine_loop import EngineLoop
from eeserve.server.formatting import TokenStrings, exit_config_summary
from eeserve.server.metrics import ServerMetrics
from eeserve.server.prepare import ApiError, ModelInfo, describe_validation_errors, error_body
from eeserve.server.prepare_thread import Preparer
from eeserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from eeserve.server.refusal import EarlyRefusal
from eeserve.server.serving import ServingContext, generate
from eeserve.server.ui import UI_PATHS, UI_PREFIX, add_ui_routes

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503, 504)
}


# Renders the /metrics page from this instance's metrics (replicas: every replica's page).
MetricsView = Callable[[ServerMetrics], Awaitable[tuple[bytes, str]]]


def create_app(
    engine: LLMEngine,
    *,
    model_names: list[str] | None = None,
    api_key: str | None = None,
    ui: bool = True,
    metrics_view: MetricsView | None = None,
    limits: ServingLimits | None = None,
) -> FastAPI:
    limits = limits or ServingLimits()
    ctx = _serving_context(engine, model_names, limits)
    engine_loop, metrics = ctx.engine_loop, ctx.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine_loop.stop()
            ctx.preparer.close()

    app = FastAPI(
        title="eeserve",
        version=__version__,
        description="OpenAI-compatible server for early-exit LLMs. Extension: the `early_exit` "
        "request field and the `early_exit` statistics in responses.",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.state.engine_loop = engine_loop
    # Added before authentication, so inside it: a request without the key gets its 401.
    app.add_middleware(
        EarlyRefusal, engine_loop=engine_loop, metrics=metrics, paths=GENERATION_PATHS
    )
    if api_key:
        exempt = ("/health", *UI_PATHS) if ui else ("/health",)
        prefixes = (UI_PREFIX,) if ui else ()
        app.add_middleware(BearerAuth, api_key=api_key, exempt=exempt, exempt_prefixes=prefixes)
    _install_error_handlers(app, metrics)
    _add_routes(app, ctx, metrics_view)
    if ui:
        add_ui_routes(app)
    app.add_middleware(RejectionTimer, metrics=metrics)  # added last: outermost, sees arrival
    return app


def _serving_context(
    engine: LLMEngine, model_names: list[str] | None, limits: ServingLimits
) -> ServingContext:
    """The engine loop, metrics, model facts and request preparation the routes share."""
    num_layers = engine.model_config.num_layers
    metrics = ServerMetrics(num_layers)
    engine_loop = EngineLoop(
        engine, metrics, resolve_limits(limits, engine), limits.engine_nice, limits.engine_host
    )
    metrics.track_admission(engine_loop.admission, engine_loop.meter)
    tokenizer = copy.deepcopy(engine.tokenizer)
    info = ModelInfo(
        tokenizer=tokenizer,
        model_names=list(model_names or [str(engine.config.model)]),
        max_model_len=engine.max_model_len,
        num_layers=num_layers,
    )
    return ServingContext(
        engine_loop,
        info,
        TokenStrings(tokenizer),
        metrics,
        exit_config_summary(engine.exit_config, engine.config.exit_policy),
        Preparer(info),
        PromptBounds.of(tokenizer),
        limits.request_timeout,
    )


def _add_routes(app: FastAPI, ctx: ServingContext, metrics_view: MetricsView | None) -> None:
    @app.post(
        "/v1/completions",
        responses={200: {"model": CompletionResponse}, **_ERRORS},
        response_model=None,
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion (stream with `"stream": true`: server-sent events)."""
        return await generate(ctx, request, body, "completion")

    @app.post(
        "/v1/chat/completions",
        responses={200: {"model": ChatCompletionResponse}, **_ERRORS},
        response_model=None,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion through the model's chat template."""
        return await generate(ctx, request, body, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "eeserve",
                "max_model_len": ctx.info.max_model_len,
                "num_layers": ctx.info.num_layers,
            }
            for name in ctx.info.model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/eeserve/exit_config")
    async def exit_config() -> dict[str, Any]:
        """Extension: exit layers, measures, default thresholds and calibrated tolerances."""
        return ctx.exit_config

    @app.get("/health")
    async def health() -> Response:
        loop = ctx.engine_loop
        if not loop.alive or loop.draining:
            state = "shutting down" if loop.draining else "engine stopped"
            return JSONResponse({"status": state}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if metrics_view is None:
            content, media_type = ctx.metrics.render()
        else:
            content, media_type = await metrics_view(ctx.metrics)
        return Response(content, media_type=media_type)


# -- errors -------------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def respond(
        request: Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> JSONResponse:
        if request.url.path in GENERATION_PATHS:
            metrics.request_done(request.url.path, _request_status(status))
        return JSONResponse(body, status_code=status, headers=headers)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return respond(request, exc.status, exc.body(), exc.headers)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param, code = describe_validation_errors(list(exc.errors()))
        return respond(request, 400, error_body(message, "invalid_request_error", param, code))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, None, str(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_other(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        body = error_body(f"internal error: {type(exc).__name__}", "server_error", None, "500")
        return respond(request, 500, body)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_other)


def _request_status(http_status: int) -> str:
    if http_status == 429:
        return "overloaded"
    return "rejected" if http_status < 500 else "error"


class BearerAuth:
    """Pure ASGI middleware (streaming-safe): a bearer token on every path but the exempt."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        exempt: tuple[str, ...] = (),
        exempt_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.exempt = exempt
        self.exempt_prefixes = exempt_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or path in self.exempt
            or any(path.startswith(p) for p in self.exempt_prefixes)
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            why = "missing" if not given else "invalid"
            body = error_body(
                f"{why} API key: send `Authorization: Bearer <key>`",
                "authentication_error",
                None,
                "invalid_api_key",
            )
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RejectionTimer:
    """Pure ASGI middleware: times each generation request's 429 from its arrival at the app
    (before auth, body parsing and tokenization) to its response headers."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.histogram = metrics.rejection_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                self.histogram.observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, timed_send)
