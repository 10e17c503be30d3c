"""Generated text -> OpenAI ``tool_calls``: whole messages and stream deltas.

Contract: a tool call is written as ``<tool_call>`` + a newline + ``{"name": NAME, "arguments":
ARGS}`` + a newline + ``</tool_call>`` (Hermes's and Qwen's format; ``tools.py`` prompts for it
and constrains the output to it). ``split_output(text, final=)`` reads a (possibly unfinished)
output: the text before the first call (``content``), then every call whose name is complete,
its ``arguments`` text as far as generated and whether the arguments' JSON has ended. While the
output runs (``final=False``), a tail of the content that may be the start of ``<tool_call>`` is
held back; at the end (``final=True``), a call whose name never completed is content again.
``tool_message(text)`` is the whole response's ``message`` (``content`` null when there is no text
besides the calls; each call ``{"id": "call_...", "type": "function", "function": {"name",
"arguments"}}``). A ``ToolStream`` per streamed choice turns successive outputs into delta
parts: new content, and for each call one entry with its ``index``, ``id``, ``type`` and
``name`` (and the arguments so far) when its name is complete, then entries with ``index`` and
the new ``arguments`` text; the arguments streamed concatenate to the final ``arguments``.
``tool_finish_reason(reason, called)`` is ``"tool_calls"`` for an output that stopped after a call.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# The start of a call's JSON up to its arguments: {"name": "NAME", "arguments":
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(kw_only=True)
class CallText:
    name: str
    arguments: str  # the arguments' JSON text, as far as generated
    complete: bool  # the arguments' JSON has ended


@dataclass(kw_only=True)
class SplitOutput:
    content: str
    calls: list[CallText]


def split_output(text: str, *, final: bool) -> SplitOutput:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        keep = len(text) if final else len(text) - _open_tag_prefix(text)
        return SplitOutput(content=text[:keep], calls=[])
    content, calls = text[:start], []
    pos = start
    while pos >= 0:
        head = _HEAD.match(text, pos + len(TOOL_CALL_OPEN))
        if head is None:  # the name is not complete (yet)
            if final:
                content += text[pos:]
            break
        args = head.end()
        end = _json_end(text, args)
        calls.append(
            CallText(
                name=head.group(1),
                arguments=(text[args:] if end < 0 else text[args:end]).rstrip(),
                complete=end >= 0,
            )
        )
        if end < 0:
            break
        pos = text.find(TOOL_CALL_OPEN, end)
    return SplitOutput(content=content, calls=calls)


def tool_message(text: str) -> dict[str, Any]:
    """The whole response's assistant message for a finished output."""
    out = split_output(text, final=True)
    if not out.calls:
        return {"role": "assistant", "content": text}
    calls = [_call_entry(k, c, _call_id()) for k, c in enumerate(out.calls)]
    for call in calls:
        del call["index"]
    return {"role": "assistant", "content": out.content.strip() or None, "tool_calls": calls}


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class ToolStream:
    """One streamed choice's progress: what of its content and calls has been sent."""

    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)  # per call: characters of arguments sent

    @property
    def called(self) -> bool:
        return bool(self.args_sent)

    def delta(self, text: str, *, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, tool call delta entries) for the output's text so far."""
        out = split_output(text, final=final)
        content = out.content[self.content_sent :]
        self.content_sent = len(out.content)
        entries: list[dict[str, Any]] = []
        for k, call in enumerate(out.calls):
            if k == len(self.args_sent):
                entries.append(_call_entry(k, call, _call_id()))
                self.args_sent.append(len(call.arguments))
            elif len(call.arguments) > self.args_sent[k]:
                new = call.arguments[self.args_sent[k] :]
                entries.append({"index": k, "function": {"arguments": new}})
                self.args_sent[k] = len(call.arguments)
        return content, entries


def _call_entry(index: int, call: CallText, call_id: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _open_tag_prefix(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _json_end(text: str, i: int) -> int:
    """The index just after the JSON value that starts at ``text[i]`` (-1: it has not ended).
    A scalar ends before the ``,`` or ``}`` that follows it."""
    depth, in_string, escaped = 0, False, False
    for k in range(i, len(text)):
        ch = text[k]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return k + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif depth == 0 and ch in ",}]":
            return k
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return -1
