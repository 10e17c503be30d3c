"""OpenAI batch files: reading request lines, writing result lines, resuming a partial output.

Contract: an input line is ``{"custom_id": str, "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}``. ``read_envelopes(path, done)`` yields, per non-blank
line (numbered from 1), either an ``Envelope`` (what a request processor needs; the body is not
validated here) or a finished error line for a line that is not one (bad UTF-8, bad JSON, a
missing or duplicate ``custom_id``, another method or URL, a body that is not an object). Lines
whose ``custom_id`` is in ``done`` are skipped. Output lines are ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"} | null, "error": null | {"code", "message",
"param", "line"}}``: ``error`` is null exactly when the request succeeded; a request the server
would have answered with an error status keeps that status and error body in ``response``.
``resume_output(path)`` keeps an existing output's successful lines (rewriting the file without
its failed or torn lines, which are then retried) and returns their ``custom_id``s.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from eeserve.server.formatting import Kind
from eeserve.server.prepare import ApiError

URL_KINDS: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


@dataclass
class Envelope:
    """One well-formed request line (plain data: it travels to Ray workers as is)."""

    line: int
    custom_id: str
    kind: Kind
    body: dict[str, Any]


def read_envelopes(path: Path, done: set[str]) -> Iterator[Envelope | dict[str, Any]]:
    first_line: dict[str, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            item = parse_line(number, raw, first_line)
            if isinstance(item, Envelope) and item.custom_id in done:
                continue
            yield item


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def parse_line(number: int, raw: bytes, first_line: dict[str, int]) -> Envelope | dict[str, Any]:
    """One input line -> an ``Envelope``, or its error line (``first_line`` spots duplicates)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return failure_line(number, None, "invalid_utf8", f"not UTF-8 text: {e.reason}", None)
    except (json.JSONDecodeError, RecursionError) as e:
        return failure_line(number, None, "json_invalid", f"malformed JSON: {e}", None)
    if not isinstance(obj, dict):
        return failure_line(number, None, "invalid_line", "a line must be a JSON object", None)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        why = "custom_id must be a non-empty string"
        return failure_line(number, None, "invalid_line", why, "custom_id")
    if not _encodable(custom_id):
        why = "custom_id is not valid Unicode text (a lone surrogate)"
        return failure_line(number, None, "invalid_unicode", why, "custom_id")
    if custom_id in first_line:
        why = f"custom_id {custom_id!r} already used on line {first_line[custom_id]}"
        return failure_line(number, custom_id, "duplicate_custom_id", why, "custom_id")
    first_line[custom_id] = number
    if obj.get("method", "POST") != "POST":
        return failure_line(number, custom_id, "invalid_line", "method must be POST", "method")
    url = obj.get("url")
    if not isinstance(url, str) or url not in URL_KINDS:
        why = f"url must be one of {sorted(URL_KINDS)}"
        return failure_line(number, custom_id, "invalid_line", why, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return failure_line(number, custom_id, "invalid_line", "body must be an object", "body")
    return Envelope(number, custom_id, URL_KINDS[url], body)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- output lines -------------------------------------------------------------------------------


def success_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def api_error_line(env: Envelope, request_id: str, e: ApiError) -> dict[str, Any]:
    """What the server would have answered (``response``), plus the line's ``error``."""
    out = failure_line(env.line, env.custom_id, e.code or e.type, e.message, e.param)
    out["response"] = {"status_code": e.status, "request_id": request_id, "body": e.body()}
    return out


def failure_line(
    line: int, custom_id: str | None, code: str, message: str, param: str | None
) -> dict[str, Any]:
    error = {"code": code, "message": f"line {line}: {message}", "param": param, "line": line}
    return {"id": _line_id(), "custom_id": custom_id, "response": None, "error": error}


def _line_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def dump_line(out: dict[str, Any]) -> str:
    # ASCII escapes: a result line is valid JSON and valid UTF-8 whatever text it carries.
    return json.dumps(out, ensure_ascii=True, separators=(",", ":")) + "\n"


class OutputWriter:
    """Appends result lines, each flushed at once (a crash loses no finished line)."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self.failed = 0
        self.written = 0

    def write(self, out: dict[str, Any]) -> None:
        self.file.write(dump_line(out))
        self.file.flush()
        self.written += 1
        self.failed += out.get("error") is not None

    def close(self) -> None:
        self.file.close()


def resume_output(path: Path) -> set[str]:
    """Keep the successful lines of an existing output (rewritten in place); their custom_ids."""
    if not path.exists():
        return set()
    kept: list[str] = []
    done: set[str] = set()
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                continue  # a line torn by a crash: its request runs again
            cid = obj.get("custom_id") if isinstance(obj, dict) else None
            if isinstance(cid, str) and obj.get("error") is None and cid not in done:
                done.add(cid)
                kept.append(raw.decode("utf-8").rstrip("\n") + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return done
