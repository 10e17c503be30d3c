"""Pydantic models of the OpenAI-compatible API (requests validated strictly, responses documented).

Contract: request models are strict (no coercion: ``"1"`` is not a number, ``1.0`` is not an
integer, ``1`` is not a boolean), reject NaN/inf, ignore unknown fields, and carry the
range limits of ``SamplingParams`` so that a bad value is reported against its field name before
anything reaches the engine. Every string must be encodable Unicode (no lone surrogates).
``early_exit`` is this server's extension, mapped to ``ExitParams``; so is ``request_timeout``
(seconds the request may take before it is aborted). Chat requests carry OpenAI's ``tools``,
``tool_choice`` and ``parallel_tool_calls``; their messages, assistant ``tool_calls`` (arguments
as JSON text) and ``tool`` results (``tool_call_id``).
Response models document the JSON the handlers build (they are not used to validate it).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


def _encodable(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (``"\\ud800"``) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_unicode",
            "text is not valid Unicode: a lone surrogate {char} at position {pos}",
            {"char": f"U+{ord(text[e.start]):04X}", "pos": e.start},
        ) from None
    return text


# Every string of a request: checked before it reaches a tokenizer, a template or a response.
Text = Annotated[str, AfterValidator(_encodable)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class EarlyExitOptions(_Strict):
    """Per-request early exit (extension). Omitted: the server's default exit configuration."""

    enabled: bool = True
    threshold: float | list[float] | None = Field(
        None, description="confidence threshold (one, or one per exit layer)"
    )
    tolerance: float | None = Field(
        None, gt=0, lt=1, description="allowed quality loss vs full depth (needs calibration)"
    )
    measure: (
        Literal[
            "softmax_margin",
            "max_prob",
            "hidden_cosine",
            "classifier",
            "shortlist_margin",
            "shortlist_max_prob",
        ]
        | None
    ) = None
    min_layer: int = Field(1, ge=1, description="no exit below this layer (1-based)")
    mode: Literal["exit", "speculative"] | None = Field(
        None, description="speculative: exits draft, the deep layers verify (output = full depth)"
    )
    num_draft_tokens: int | None = Field(
        None, ge=1, le=64, description="speculative: most drafts before a verification"
    )

    @field_validator("threshold")
    @classmethod
    def _in_measure_range(cls, v: float | list[float] | None) -> float | list[float] | None:
        # Every measure lies in [-1, 1] (cosine) or [0, 1]: anything else is a typo, not a setting.
        values = v if isinstance(v, list) else [] if v is None else [v]
        bad = [t for t in values if not -1 <= t <= 1]
        if bad:
            raise ValueError(
                f"threshold must lie in [-1, 1] (confidence measures do), got {bad[0]}; "
                "to run at full depth send enabled=false"
            )
        return v

    @model_validator(mode="after")
    def _one_criterion(self) -> EarlyExitOptions:
        if self.threshold is not None and self.tolerance is not None:
            raise ValueError("give either threshold or tolerance, not both")
        return self


class JsonSchemaFormat(_Strict):
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: dict[str, object] = Field(
        default_factory=dict, alias="schema", description="the JSON schema the output follows"
    )
    strict: bool | None = Field(
        None, description="true: objects take no properties beyond those the schema lists"
    )


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (extension): exactly one constraint."""

    json_: dict[str, object] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


def _json_text(text: str) -> str:
    """A tool call's ``arguments``: JSON text (the chat template may need the object)."""
    try:
        json.loads(text)
    except ValueError as e:
        raise PydanticCustomError(
            "arguments_not_json", "arguments must be JSON text: {error}", {"error": str(e)}
        ) from None
    return text


class FunctionDefinition(_Strict):
    name: Text = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, object] | None = Field(
        None, description="JSON schema of the arguments (omitted: no arguments)"
    )
    strict: bool | None = Field(
        None, description="true: objects take no properties beyond those the schema lists"
    )


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: Text
    arguments: Annotated[Text, AfterValidator(_json_text)]


class ToolCall(_Strict):
    """A call the assistant made: in a response, and in the messages a client sends back."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="choice i of n uses seed + i")
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: bool = False
    early_exit: EarlyExitOptions | None = None
    # The output's shape: OpenAI's response_format, vLLM's guided_* and structured_outputs (at
    # most one of them; docs/structured-outputs.md).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, object] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    request_timeout: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="extension: seconds this request may take from its arrival; then it is "
        "aborted and answered with 504 (a final error event when streaming). Shortens, never "
        "extends, the server's --request-timeout",
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v


class CompletionRequest(_GenerationRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="text, list of texts, token ids, or list of token-id lists"
    )
    logprobs: int | None = Field(None, ge=0, le=20, description="top log-probabilities per token")

    @field_validator("prompt")
    @classmethod
    def _non_empty(
        cls, p: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise ValueError("prompt must not be an empty list")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: Text | None = Field(None, description="tool: the call this result answers")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calls (docs/structured-outputs.md#tool-calls).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="omitted: auto when tools are given, else none"
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call a turn")


# -- responses (documentation) -------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class EarlyExitStats(BaseModel):
    mean_exit_layer: float = Field(
        description="over the tokens the model chose (forced ones apart); num_layers = full depth"
    )
    layers_saved_fraction: float
    num_layers: int
    num_forced: int = Field(0, description="tokens a structured output's grammar forced")
    acceptance_rate: float | None = Field(None, description="speculative: accepted / drafted")
    mean_draft_length: float | None = Field(None, description="speculative: drafts/verification")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]
    exit_layers: list[int] = Field(description="extension: the exit layer of each token")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    early_exit: EarlyExitStats | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: Text
    choices: list[CompletionChoice]
    usage: Usage
    early_exit: EarlyExitStats


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    exit_layer: int = Field(description="extension: the layer this token exited at")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the answer is only tool calls")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    early_exit: EarlyExitStats | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: Text
    choices: list[ChatChoice]
    usage: Usage
    early_exit: EarlyExitStats


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo
