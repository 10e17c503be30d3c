"""The soak benchmark's clients: one request and its outcome, the open and closed loops.

Contract: ``Mix`` draws request bodies (short or ~1.5k-token prompts, streaming or not, a share of
clients that disconnect on purpose, a share sent to ``/v1/chat/completions`` as one user message
instead of to ``/v1/completions``), each behind a first line of its own so that no request is served
from another's prefix cache. ``send(client, req, t0, hard_timeout)`` runs one and returns its
``Outcome``: ``completed``, ``rejected`` (429, with its latency, ``Retry-After`` and who answered
it: the engine's admission control, whose body is an OpenAI error naming the limit, or Ray's proxy),
``deadline`` (504 or a stream's ``deadline_exceeded`` event), ``disconnected`` (planned), ``failed``
(any other answer) or ``hung`` (no answer within ``hard_timeout``); ``status_counts`` tallies
outcomes by status. ``open_loop`` starts requests at Poisson arrival times at a given rate for a
given time and, once that time has passed, waits for them all; ``closed_loop`` keeps ``concurrency``
requests in flight for a given time (``soak_capacity``'s measurement). Sampling the server meanwhile
is ``soak_sample``'s job. Times are ``time.perf_counter()`` seconds since the run's ``t0``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from eeserve.bench.soak_http import HTTPFailure, LeanClient, LeanResponse

# The soak sends its load with ``LeanClient``; ``httpx.AsyncClient`` drives the same code (tests).
LoadClient = httpx.AsyncClient | LeanClient
STATUSES = ("completed", "rejected", "deadline", "disconnected", "failed", "hung")


@dataclass
class Request:
    body: dict[str, Any]
    kind: str  # "short" | "long"
    path: str = "/v1/completions"
    disconnect_after: int | None = None  # streaming: tokens read before hanging up
    disconnect_at: float | None = None  # whole response: seconds before hanging up
    # The body as sent, encoded when drawn: a burst's clock starts with its requests built.
    payload: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.payload = json.dumps(self.body).encode()


@dataclass
class Outcome:
    kind: str
    stream: bool
    sent: float
    ended: float = 0.0
    status: str = "failed"
    http_status: int | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    reject_latency: float | None = None  # a 429: seconds to its response headers
    retry_after: int | None = None
    rejected_by: str | None = None  # a 429: "engine" (admission control) or "proxy" (Ray's)
    rejected_limit: str | None = None  # the engine's 429: "requests", "tokens", "queue_seconds"
    error: str | None = None


def status_counts(outs: list[Outcome]) -> dict[str, int]:
    """How many of ``outs`` ended in each status (only the statuses that occur)."""
    counts: dict[str, int] = {}
    for o in outs:
        counts[o.status] = counts.get(o.status, 0) + 1
    return counts


@dataclass
class Mix:
    model: str
    short_prompts: list[str]
    long_prompts: list[str]
    max_tokens: int
    long_share: float
    stream_share: float
    disconnect_share: float
    early_exit: dict[str, Any] | None
    rng: random.Random
    count: int = 0
    chat_share: float = 0.0

    def draw(self, disconnects: bool = True) -> Request:
        self.count += 1
        long = self.rng.random() < self.long_share
        pool = self.long_prompts if long else self.short_prompts
        stream = self.rng.random() < self.stream_share
        # Drawn only when asked for: runs without chat requests keep their earlier draws.
        chat = self.chat_share > 0 and self.rng.random() < self.chat_share
        req = self._request(self.rng.choice(pool), long, stream, chat)
        if disconnects and self.rng.random() < self.disconnect_share:
            if stream:
                req.disconnect_after = self.rng.randint(1, max(1, self.max_tokens // 2))
            else:
                req.disconnect_at = self.rng.uniform(0.05, 2.0)
        return req

    def alone(self, long: bool) -> Request:
        """A streamed completion of the first long (or short) prompt, to time one request served
        alone; it draws nothing from ``rng``."""
        self.count += 1
        return self._request((self.long_prompts if long else self.short_prompts)[0], long, True)

    def _request(self, prompt: str, long: bool, stream: bool, chat: bool = False) -> Request:
        text = f"Request {self.count}.\n{prompt}"
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if self.early_exit is not None:
            body["early_exit"] = self.early_exit
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Request(body, "long" if long else "short", path)


async def send(client: LoadClient, req: Request, t0: float, hard_timeout: float) -> Outcome:
    out = Outcome(req.kind, bool(req.body["stream"]), time.perf_counter() - t0)
    planned = req.disconnect_at is not None
    try:
        with _Deadline(req.disconnect_at if req.disconnect_at is not None else hard_timeout):
            await _run(client, req, out, t0)
    except asyncio.TimeoutError:
        if planned:
            out.status = "disconnected"
        else:
            out.status, out.error = "hung", f"no answer within {hard_timeout:g} s"
    except (httpx.HTTPError, HTTPFailure) as e:
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    out.ended = time.perf_counter() - t0
    return out


class _Deadline:
    """Cancels the task it runs in after ``seconds`` and raises ``asyncio.TimeoutError`` in its
    place: ``asyncio.wait_for`` without the task per request it starts (hundreds of requests
    sent at once each paid for one in the client's loop), and ``asyncio.timeout``, which Python
    3.10 lacks."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False

    def __enter__(self) -> _Deadline:
        task = asyncio.current_task()
        assert task is not None
        self._handle = asyncio.get_running_loop().call_later(self.seconds, self._expire, task)
        return self

    def _expire(self, task: asyncio.Task[Any]) -> None:
        self.expired = True
        task.cancel()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._handle.cancel()
        if self.expired and kind is asyncio.CancelledError:
            raise asyncio.TimeoutError


async def _run(client: LoadClient, req: Request, out: Outcome, t0: float) -> None:
    start = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with client.stream("POST", req.path, content=req.payload, headers=headers) as r:
        headers_at = time.perf_counter()
        out.http_status = r.status_code
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            _refusal(out, r, text, headers_at - start)
            return
        if not out.stream:
            await r.aread()
            out.status = "completed"
            return
        last = start
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                code = obj["error"].get("code")
                out.status = "deadline" if code == "deadline_exceeded" else "failed"
                out.error = str(obj["error"].get("message"))
                return
            if any(_has_tokens(c) for c in obj.get("choices", [])):
                now = time.perf_counter()
                if out.ttft is None:
                    out.ttft = now - start
                else:
                    out.itls.append(now - last)
                last = now
                if req.disconnect_after is not None and 1 + len(out.itls) >= req.disconnect_after:
                    out.status = "disconnected"
                    return  # leaving the block closes the connection
        out.status = "completed"


def _has_tokens(choice: dict[str, Any]) -> bool:
    """A stream chunk's choice carries generated tokens (completion text, chat content, or the
    per-token ``exit_tokens`` sent ahead of text held back for stop strings)."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or choice.get("exit_tokens"))


def _error_type(text: str) -> str | None:
    """An OpenAI error body's ``error.type`` (admission control: the limit that refused)."""
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    kind = err.get("type") if isinstance(err, dict) else None
    return kind if isinstance(kind, str) else None


def _refusal(out: Outcome, r: httpx.Response | LeanResponse, text: str, latency: float) -> None:
    out.error = f"HTTP {r.status_code}: {text[:200]}"
    if r.status_code == 429:
        out.status = "rejected"
        out.reject_latency = latency
        retry = r.headers.get("retry-after")
        out.retry_after = int(retry) if retry and retry.isdigit() else None
        out.rejected_by = "engine" if text.lstrip().startswith("{") else "proxy"
        out.rejected_limit = _error_type(text) if out.rejected_by == "engine" else None
    elif r.status_code == 504 and "deadline_exceeded" in text:
        out.status = "deadline"
    else:
        out.status = "failed"


async def open_loop(
    client: LoadClient,
    mix: Mix,
    rate: float,
    duration: float,
    t0: float,
    hard_timeout: float,
) -> list[Outcome]:
    """Requests at Poisson arrival times (``rate`` a second) for ``duration`` seconds, whatever
    the server answers (open loop); returns every outcome once the last has ended. A rate of 0
    sends nothing and returns once ``duration`` has passed."""
    if rate <= 0:
        await asyncio.sleep(duration)
        return []
    begin = time.perf_counter()
    tasks: list[asyncio.Task[Outcome]] = []
    at = mix.rng.expovariate(rate)
    while at < duration:
        await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
        tasks.append(asyncio.create_task(send(client, mix.draw(), t0, hard_timeout)))
        at += mix.rng.expovariate(rate)
    await asyncio.sleep(max(0.0, begin + duration - time.perf_counter()))
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    client: LoadClient,
    mix: Mix,
    concurrency: int,
    duration: float,
    t0: float,
    hard_timeout: float,
) -> list[Outcome]:
    """``concurrency`` clients that each send the next request when their last one ends, for
    ``duration`` seconds (no planned disconnects)."""
    stop_at = time.perf_counter() + duration
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            out = await send(client, mix.draw(disconnects=False), t0, hard_timeout)
            outcomes.append(out)
            if out.status == "rejected":
                await asyncio.sleep(0.1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes
