"""Tool calls, request side: ``tools`` and ``tool_choice`` -> the prompt and the output's grammar.

Contract: ``tool_plan(req)`` reads a chat request's ``tools``, ``tool_choice`` (``none``,
``auto``, ``required`` or a named function; omitted: ``auto`` with tools, ``none`` without) and
``parallel_tool_calls``; None when the request offers no tools. ``output_constraint(req)`` is the
request's one output constraint: ``structured_params(req)`` (``response_format``, ``guided_*``,
``structured_outputs``) or, under ``auto``, ``required`` or a named function, a Lark grammar
over the calls of ``tool_output.py``'s format: ``required`` and a named function start the output
with a call (a named one: that function only); ``auto`` allows any text, but once the text writes
``<tool_call>`` the call must follow. Each call is ``{"name": <an offered function>, "arguments":
<JSON under that function's parameters schema>}`` (``strict``: objects closed as
``response_format``'s strict schemas are); several calls one after another unless
``parallel_tool_calls`` is false or the choice names a function (then one call). ``none``
constrains nothing. Every problem is a ``ConstraintError`` naming the field: ``tool_choice``
with another constraint, ``tool_choice`` without tools or naming a function that ``tools`` does
not define, a duplicate function name (``tools.N.function.name``), a parameters schema that
the grammar library refuses (``tools.N.function.parameters``). ``output_field(req)`` is the
field a refusal of the compiled constraint is reported against.

``prompt_messages(req, tokenizer)`` is the request's messages as the chat template takes them,
with the keyword arguments for ``apply_chat_template``. Where the template renders tools in this
format (it reads ``tools`` and writes ``<tool_call>``), the tools go to it as ``tools=`` and the
messages keep their ``tool_calls`` (arguments as objects) and ``tool`` results. Elsewhere a
system message describes the tools and the call format (merged into the first message when that
is a system or developer message), an assistant's calls are written into its content in the call
format, and consecutive ``tool`` results become one user message of ``<tool_response>`` blocks.
Under ``none`` the tools are not described.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from eeserve.engine.grammar import JSON_LAYOUT
from eeserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, Tool
from eeserve.server.structured import (
    ConstraintError,
    closed_objects,
    constraint_field,
    structured_params,
)
from eeserve.server.tool_output import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from eeserve.structured_outputs import StructuredOutputsParams

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_TOOLS_VARIABLE = re.compile(r"\btools\b")


class ToolChoiceMode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "function"


@dataclass(frozen=True, kw_only=True)
class ToolPlan:
    mode: ToolChoiceMode
    tools: tuple[Tool, ...]
    callable: tuple[int, ...]  # indexes into tools of the functions the output may call
    parallel: bool


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    if not req.tools:
        if req.tool_choice not in (None, ToolChoiceMode.NONE.value):
            raise ConstraintError("tool_choice needs tools to choose from", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            param = f"tools.{i}.function.name"
            raise ConstraintError(f"{param}: {name!r} is defined twice", param)
    choice = req.tool_choice or ToolChoiceMode.AUTO.value
    if isinstance(choice, str):
        mode, callable_ = ToolChoiceMode(choice), tuple(range(len(names)))
    elif choice.function.name in names:
        mode, callable_ = ToolChoiceMode.NAMED, (names.index(choice.function.name),)
    else:
        raise ConstraintError(
            f"tool_choice names the function {choice.function.name!r}, which tools does not "
            f"define (it defines {', '.join(names)})",
            "tool_choice",
        )
    for i, tool in enumerate(req.tools):
        _check_parameters(i, tool)
    parallel = req.parallel_tool_calls and mode is not ToolChoiceMode.NAMED
    return ToolPlan(mode=mode, tools=tuple(req.tools), callable=callable_, parallel=parallel)


def output_constraint(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    given = structured_params(req)
    plan = tool_plan(req) if isinstance(req, ChatCompletionRequest) else None
    if plan is None or plan.mode is ToolChoiceMode.NONE:
        return given
    if given is not None:
        raise ConstraintError(
            f"tool_choice {plan.mode.value} and {constraint_field(req)} both set the output's "
            "shape; give one of them (or tool_choice none)",
            "tool_choice",
        )
    return StructuredOutputsParams(grammar=tool_grammar(plan))


def output_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field that sets its output's constraint (None: free text)."""
    return constraint_field(req) or ("tools" if offers_tools(req) else None)


def offers_tools(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Does the request offer the model tools (and so its output may hold calls)?"""
    return (
        isinstance(req, ChatCompletionRequest)
        and bool(req.tools)
        and req.tool_choice != ToolChoiceMode.NONE.value
    )


# -- the grammar --------------------------------------------------------------------------------


def tool_grammar(plan: ToolPlan) -> str:
    """The Lark grammar (llguidance's dialect) of the output ``plan`` allows."""
    open_, close = json.dumps(TOOL_CALL_OPEN), json.dumps("\n" + TOOL_CALL_CLOSE)
    again = json.dumps("\n" + TOOL_CALL_OPEN)
    lines = ["%llguidance {}"]
    if plan.mode is ToolChoiceMode.AUTO:
        # Any text; a lazy lexeme ends the text at the first <tool_call>, and a call follows.
        lines += ["start: TEXT | head calls", f"head[lazy]: TEXT {open_}", "TEXT: /(?s:.*)/"]
    else:
        lines.append(f"start: {open_} calls")
    more = f" ({again} call)*" if plan.parallel else ""
    lines.append(f"calls: call{more}")
    options = " | ".join(f"f{i}" for i in plan.callable)
    lines.append(f'call: "\\n" ({options}) {close}')
    for i in plan.callable:
        fn = plan.tools[i].function
        head = '{"name": ' + json.dumps(fn.name) + ', "arguments": '
        schema = {**_parameters(plan.tools[i]), "x-guidance": JSON_LAYOUT}
        lines.append(f'f{i}: {json.dumps(head)} a{i} "}}"')
        lines.append(f"a{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    schema: dict[str, Any] = dict(params) if params is not None else dict(NO_ARGUMENTS)
    return closed_objects(schema) if tool.function.strict else schema


def _check_parameters(index: int, tool: Tool) -> None:
    error = _schema_error(json.dumps(_parameters(tool), sort_keys=True))
    if error:
        param = f"tools.{index}.function.parameters"
        raise ConstraintError(f"{param}: {error}", param)


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> str:
    """The grammar library's objection to a JSON schema ('' when it takes it)."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(text).strip()


# -- the prompt ---------------------------------------------------------------------------------


def prompt_messages(
    req: ChatCompletionRequest, tokenizer: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the messages for the chat template, its extra keyword arguments)."""
    offered = offers_tools(req)
    if template_takes_tools(tokenizer):
        messages = [_native_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        return messages, {"tools": tools} if offered else {}
    messages = _folded_messages(req.messages)
    if offered:
        _describe_tools(messages, req)
    return messages, {}


def template_takes_tools(tokenizer: Any) -> bool:
    """Does the tokenizer's chat template render ``tools`` and calls in this format?"""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool-use one where there is one
        template = template.get("tool_use") or template.get("default")
    return (
        isinstance(template, str)
        and bool(_TOOLS_VARIABLE.search(template))
        and TOOL_CALL_OPEN in template
    )


def _native_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": json.loads(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    return out


def _folded_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: calls written out, results as user turns."""
    out: list[dict[str, Any]] = []
    after_result = False
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
            continue
        after_result = False
        content = m.text()
        for c in m.tool_calls or []:
            call = f'{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
            content += ("\n" if content else "") + f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
        out.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
    return out


def _describe_tools(messages: list[dict[str, Any]], req: ChatCompletionRequest) -> None:
    """Puts the tools' description into the system message (one is added where there is none)."""
    lines = [
        "You can call functions to answer. Their signatures, one JSON object a line:",
        "<tools>",
        *(json.dumps(t.model_dump(exclude_none=True)) for t in req.tools or []),
        "</tools>",
        "To call a function, write its name and arguments as a JSON object between "
        f"{TOOL_CALL_OPEN} and {TOOL_CALL_CLOSE}:",
        TOOL_CALL_OPEN,
        '{"name": "<function name>", "arguments": {<arguments>}}',
        TOOL_CALL_CLOSE,
    ]
    choice = req.tool_choice
    if choice == ToolChoiceMode.REQUIRED.value:
        lines.append("Answer with at least one function call.")
    elif choice is not None and not isinstance(choice, str):
        lines.append(f"Answer by calling the function {choice.function.name}.")
    text = "\n".join(lines)
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}".lstrip()
    else:
        messages.insert(0, {"role": "system", "content": text})
