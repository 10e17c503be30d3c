"""The two generation endpoints: validated request -> engine requests -> JSON or an SSE stream.

Contract: ``generate(ctx, request, body, kind)`` checks the model name (404), turns the body into
one engine request per (prompt, choice) with ``SamplingParams`` (choice ``i`` of ``n`` gets
``seed + i``) and ``ExitParams``, queues them atomically on the engine loop (a prompt that does
not fit the context is a 400 naming the lengths) and answers either with one JSON body or with
``text/event-stream`` chunks ending in ``data: [DONE]``. A client that goes away (mid-stream or
while waiting for a whole response) gets its engine requests aborted, which frees their KV
blocks. Every problem is an ``ApiError`` rendered as an OpenAI error body by the app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from eeserve.exit_params import ExitParams
from eeserve.outputs import CompletionOutput
from eeserve.sampling_params import SamplingParams
from eeserve.server.engine_loop import (
    ChoiceSpec,
    EngineLoop,
    Generation,
    GenerationError,
    RequestRejected,
    ShuttingDown,
)
from eeserve.server.formatting import Formatter, Kind, TokenStrings
from eeserve.server.metrics import ServerMetrics
from eeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EarlyExitOptions,
)

MAX_CHOICES = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ServingContext:
    engine_loop: EngineLoop
    tokenizer: Any  # the HTTP side's own copy; the engine thread keeps the engine's
    strings: TokenStrings
    metrics: ServerMetrics
    model_names: list[str]
    max_model_len: int
    num_layers: int
    exit_config: dict[str, Any]  # GET /v1/eeserve/exit_config (formatting.exit_config_summary)


# -- request -> engine requests -----------------------------------------------------------------


def to_exit_params(opts: EarlyExitOptions | None, num_layers: int) -> ExitParams | None:
    if opts is None:
        return None
    if opts.min_layer > num_layers:
        raise ApiError(
            400,
            f"early_exit.min_layer must be <= {num_layers} (the model's layers), "
            f"got {opts.min_layer}",
            param="early_exit.min_layer",
        )
    kwargs: dict[str, Any] = dict(
        enabled=opts.enabled, threshold=opts.threshold, measure=opts.measure
    )
    kwargs["min_layer"] = opts.min_layer
    kwargs["mode"] = opts.mode
    kwargs["num_draft_tokens"] = opts.num_draft_tokens
    if opts.tolerance is not None:
        if "tolerance" not in {f.name for f in dataclasses.fields(ExitParams)}:
            raise ApiError(
                400,
                "early_exit.tolerance is not supported by this engine version",
                param="early_exit.tolerance",
                code="unsupported",
            )
        kwargs["tolerance"] = opts.tolerance
    try:
        return ExitParams(**kwargs)
    except (ValueError, TypeError) as e:
        m = re.search(r"ExitParams\.(\w+)", str(e))
        param = f"early_exit.{m.group(1)}" if m else "early_exit"
        raise ApiError(400, f"early_exit: {e}", param=param) from e


def _sampling(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=None if req.seed is None else req.seed + choice,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as e:
        m = re.search(r"SamplingParams\.(\w+)", str(e))
        raise ApiError(400, str(e), param=m.group(1) if m else None) from e


def completion_specs(
    ctx: ServingContext, req: CompletionRequest
) -> tuple[list[ChoiceSpec], list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts: list[Any] = [p]
    else:
        prompts = list(p)
    _check_choices(len(prompts) * req.n)
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    specs: list[ChoiceSpec] = []
    lens: list[int] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = list(ctx.tokenizer(prompt).input_ids)
            if not ids:
                raise ApiError(400, "prompt is empty (no tokens)", param="prompt")
        else:
            text, ids = None, list(prompt)
        lens.append(len(ids))
        for i in range(req.n):
            specs.append(ChoiceSpec(text, ids, _sampling(req, max_tokens, req.logprobs, i)))
    return specs, lens


def chat_specs(
    ctx: ServingContext, req: ChatCompletionRequest
) -> tuple[list[ChoiceSpec], list[int]]:
    _check_choices(req.n)
    messages = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in req.messages
    ]
    try:
        out = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template may raise anything (jinja errors, its own checks)
        raise ApiError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from e
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, ctx.max_model_len - len(ids))
    top = (req.top_logprobs or 0) if req.logprobs else None
    specs = [ChoiceSpec(None, ids, _sampling(req, max_tokens, top, i)) for i in range(req.n)]
    return specs, [len(ids)]


def _check_choices(n: int) -> None:
    if n > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices per request, got {n}", param="n")


# -- running ------------------------------------------------------------------------------------


async def generate(
    ctx: ServingContext,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    kind: Kind,
) -> Response:
    if req.model not in ctx.model_names:
        raise ApiError(
            404, f"The model `{req.model}` does not exist", param="model", code="model_not_found"
        )
    if isinstance(req, CompletionRequest):
        specs, prompt_lens = completion_specs(ctx, req)
        top, prompt_param = req.logprobs, "prompt"
    else:
        specs, prompt_lens = chat_specs(ctx, req)
        top, prompt_param = specs[0].params.logprobs, "messages"
    exit_params = to_exit_params(req.early_exit, ctx.num_layers)
    try:
        gen = await ctx.engine_loop.add(specs, exit_params)
    except ShuttingDown as e:
        raise ApiError(503, str(e), type_="service_unavailable", code="shutting_down") from e
    except RequestRejected as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from e
    except ValueError as e:
        code = "context_length_exceeded" if "maximum model length" in str(e) else "invalid_value"
        raise ApiError(400, str(e), param=prompt_param, code=code) from e
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    fmt = Formatter(kind, req.model, ctx.strings, ctx.num_layers, len(specs), top, stop)
    run = _Run(ctx, request.url.path, gen, fmt, prompt_lens)
    if req.stream:
        run.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(run)
    return await run.whole(request)


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
            self.status = "error"
            return JSONResponse(error_body(str(e), "server_error"), status_code=e.status)
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
            self.status = "error"
            yield _sse(error_body(str(e), "server_error", code=str(e.status)))
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


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not gen.finished:
                gen.cancel()
            return
