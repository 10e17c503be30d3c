"""Batch-file helpers shared by tests/test_batch.py and tests/test_ray.py: writing a test batch
file (completions and chats, some lines malformed), running ``eeserve batch`` on it, and reading
its output without what differs between runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eeserve.cli import main

PROMPTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "One two three"]


def request_line(i: int, model: str) -> dict[str, Any]:
    """Request ``i`` of a test batch: completions and chats, greedy, a few tokens."""
    if i % 2:
        url = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPTS[i % 4]}]}
    else:
        url, body = "/v1/completions", {"prompt": PROMPTS[i % 4] + f" {i}"}
    body |= {"model": model, "max_tokens": 3 + i % 5, "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def write_batch(path: Path, model: str, n: int, malformed: dict[int, str]) -> None:
    """``n`` lines; line ``k`` (1-based) in ``malformed`` is that raw text instead."""
    rows = [malformed.get(k + 1) or json.dumps(request_line(k, model)) for k in range(n)]
    path.write_text("\n".join(rows) + "\n")


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(out: dict[str, Any]) -> dict[str, Any]:
    """An output line without what differs between runs (ids and timestamps)."""
    body = dict((out.get("response") or {}).get("body") or {})
    for key in ("id", "created"):
        body.pop(key, None)
    return {"custom_id": out["custom_id"], "body": body, "error": out["error"]}


def run_cli(src: Path, dst: Path, model: Path, *extra: str) -> int:
    argv = ["batch", str(src), "--output", str(dst), "--model", str(model)]
    return main([*argv, "--kv-cache-memory", "8000000", "--no-progress", *extra])
