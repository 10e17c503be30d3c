"""One validated OpenAI request body -> engine requests: shared by the HTTP server and batch files.

Contract: ``parse_body(kind, body)`` validates a decoded JSON body against the strict request
models of ``protocol.py`` (the batch reader's path; FastAPI validates the server's bodies with the
same models) and ``describe_validation_errors`` turns pydantic's errors into the one OpenAI error
both report. ``prepare(info, req, kind)`` checks the model name (404), tokenizes (chat messages
with the tokenizer's chat template, and the tools the request offers as ``tools.py`` lays them
out; for a base model without one, their texts joined by newlines as a completion prompt), builds
one
``ChoiceSpec`` per (prompt, choice) with ``SamplingParams`` (choice ``i`` of ``n`` gets
``seed + i``) and the request's ``ExitParams``. ``engine_refusal`` maps what the engine says
when it refuses a request (a prompt longer than the context, exit parameters the model's exits
cannot honour) to the same 400s. Every problem is an ``ApiError``: status, message, the field in
``param``, a ``code`` (and response headers where the status needs some: ``Retry-After``).
``check_model`` (404) and ``check_choices`` (400 beyond ``MAX_CHOICES``) are also what the server
checks before it reserves a place in the queue for a request.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from eeserve.exit_params import ExitParams
from eeserve.sampling_params import SamplingParams
from eeserve.server.engine_requests import ChoiceSpec, RequestRejected
from eeserve.server.formatting import Kind
from eeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EarlyExitOptions,
)
from eeserve.server.structured import ConstraintError
from eeserve.server.tools import offers_tools, output_constraint, output_field, prompt_messages

MAX_CHOICES = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

GenerationRequest = CompletionRequest | ChatCompletionRequest


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ModelInfo:
    """What request preparation needs to know about the served model."""

    tokenizer: Any  # a copy owned by the caller's thread (the engine thread keeps the engine's)
    model_names: list[str]
    max_model_len: int
    num_layers: int


@dataclass
class Prepared:
    """A request ready for the engine, with what formatting its answer needs."""

    specs: list[ChoiceSpec]
    prompt_lens: list[int]
    exit_params: ExitParams | None
    top_logprobs: int | None
    stop: list[str]
    prompt_param: str  # the field a refusal of the prompt is reported against
    constraint_param: str | None = None  # the field that set the output's constraint, if any
    tool_calls: bool = False  # the output may hold tool calls (tools.py, tool_output.py)


# -- validation ---------------------------------------------------------------------------------


def parse_body(kind: Kind, body: Any) -> GenerationRequest:
    """A decoded JSON body -> the request model of ``kind`` (``ApiError`` 400 when invalid)."""
    model = CompletionRequest if kind == "completion" else ChatCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param, code = describe_validation_errors(list(e.errors()))
        raise ApiError(400, message, param=param, code=code) from None


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None, str]:
    """Pydantic errors -> (message, param, code) for the first offending field."""
    if not errors:
        return "invalid request", None, "invalid_request"
    # Text that matches no alternative of a union only because it cannot be encoded: say so alone.
    errors = [e for e in errors if e.get("type") == "invalid_unicode"] or errors
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', '')}", None, "json_invalid"
    param = _param(tuple(first.get("loc", ())))
    if param is None:
        return f"request body: {first.get('msg', 'invalid')}", None, str(first.get("type"))
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    msgs = list(dict.fromkeys(str(e.get("msg", "")) for e in same))
    if len(msgs) > 1:
        message = f"{param}: invalid value (" + "; or ".join(msgs[:4]) + ")"
    else:
        message = f"{param}: {msgs[0]}"
    return message, param, str(first.get("type"))


def _param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for x in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif isinstance(x, str) and x.isidentifier() and x not in _TYPE_TAGS:
            parts.append(x)
        else:
            break
    return ".".join(parts) or None


# -- request -> engine requests -----------------------------------------------------------------


def check_model(info: ModelInfo, req: GenerationRequest) -> None:
    if req.model not in info.model_names:
        raise ApiError(
            404, f"The model `{req.model}` does not exist", param="model", code="model_not_found"
        )


def prepare(info: ModelInfo, req: GenerationRequest, kind: Kind) -> Prepared:
    check_model(info, req)
    if isinstance(req, CompletionRequest):
        specs, prompt_lens = completion_specs(info, req)
        top, prompt_param = req.logprobs, "prompt"
    else:
        specs, prompt_lens = chat_specs(info, req)
        top, prompt_param = specs[0].params.logprobs, "messages"
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    exit_params = to_exit_params(req.early_exit, info.num_layers)
    constraint = output_field(req)
    return Prepared(
        specs, prompt_lens, exit_params, top, stop, prompt_param, constraint, offers_tools(req)
    )


def engine_refusal(e: ValueError, prep: Prepared) -> ApiError:
    """The engine refused a prepared request: the 400 that names the reason (the grammar library
    refused its constraint: the field that set it)."""
    if isinstance(e, RequestRejected):
        return ApiError(400, str(e), param=e.param, code="invalid_value")
    field = prep.constraint_param
    if str(e).startswith("structured_outputs") and field is not None:
        reason = str(e).partition(": ")[2] or str(e)
        return ApiError(400, f"{field}: {reason}", param=field, code="invalid_constraint")
    code = "context_length_exceeded" if "maximum model length" in str(e) else "invalid_value"
    return ApiError(400, str(e), param=prep.prompt_param, code=code)


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
    req: GenerationRequest, max_tokens: int, logprobs: int | None, choice: int
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
            structured_outputs=output_constraint(req),
        )
    except ConstraintError as e:
        raise ApiError(400, str(e), param=e.param) from e
    except ValueError as e:
        m = re.search(r"SamplingParams\.(\w+)", str(e))
        raise ApiError(400, str(e), param=m.group(1) if m else None) from e


def completion_specs(info: ModelInfo, req: CompletionRequest) -> tuple[list[ChoiceSpec], list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        prompts: list[Any] = [p]
    else:
        prompts = list(p)
    check_choices(len(prompts) * req.n)
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    specs: list[ChoiceSpec] = []
    lens: list[int] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = list(info.tokenizer(prompt).input_ids)
            if not ids:
                raise ApiError(400, "prompt is empty (no tokens)", param="prompt")
        else:
            text, ids = None, list(prompt)
        lens.append(len(ids))
        for i in range(req.n):
            specs.append(ChoiceSpec(text, ids, _sampling(req, max_tokens, req.logprobs, i)))
    return specs, lens


def chat_specs(info: ModelInfo, req: ChatCompletionRequest) -> tuple[list[ChoiceSpec], list[int]]:
    check_choices(req.n)
    messages, template_kwargs = prompt_messages(req, info.tokenizer)
    try:
        if getattr(info.tokenizer, "chat_template", None) is None:
            # A base model (no template): the messages' texts, one per line, as a completion.
            out = info.tokenizer("\n".join(m["content"] for m in messages)).input_ids
        else:
            out = info.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
    except Exception as e:  # a template may raise anything (jinja errors, its own checks)
        raise ApiError(
            400, f"the chat template rejected the messages: {e}", param="messages"
        ) from e
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    room = max(1, info.max_model_len - len(ids))
    max_tokens = req.max_completion_tokens or req.max_tokens or room
    top = (req.top_logprobs or 0) if req.logprobs else None
    specs = [ChoiceSpec(None, ids, _sampling(req, max_tokens, top, i)) for i in range(req.n)]
    return specs, [len(ids)]


def check_choices(n: int) -> None:
    if n > MAX_CHOICES:
        raise ApiError(400, f"at most {MAX_CHOICES} choices per request, got {n}", param="n")
