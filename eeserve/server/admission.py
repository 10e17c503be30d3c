"""Admission control: bounded waiting work, answered at once with 429 beyond it.

Contract: ``ServingLimits`` holds what the server's flags ask (``None``: derive from the engine);
``resolve_limits(limits, engine)`` turns it into ``AdmissionLimits`` with concrete numbers:
``max_waiting_requests`` defaults to the engine's ``max_num_seqs`` (one more full batch may wait
while one runs) and ``max_queued_tokens`` to the KV pool's token capacity (the requests that
wait hold at most one pool of work: prompt plus requested output tokens each).

``Admission`` counts the engine requests that are admitted but have not produced their first
token yet ("waiting": queued on the engine thread or in the scheduler) and their tokens. It is
used from the event loop's thread only (no lock). ``admit(costs)`` takes a group of requests
(one cost per choice) or raises ``Overloaded`` naming the limit and a ``retry_after`` in whole
seconds; a group that finds nothing waiting is always admitted, so that one request larger
than the token limit is still served, alone. ``started(cost)`` is called when a waiting request
produces its first output, ``released(cost)`` when it ends before that (abort, error, deadline).
``retry_after`` estimates how long the current queue takes to start, from the rate at which
waiting requests started recently (1 s when there is no recent rate; at most 60 s).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from eeserve.engine.llm_engine import LLMEngine

Limit = Literal["waiting_requests", "queued_tokens"]
LIMITS: tuple[Limit, ...] = ("waiting_requests", "queued_tokens")
MAX_RETRY_AFTER_S = 60
_RATE_WINDOW = 32  # recent starts the rate is measured over
_RATE_MAX_AGE_S = 30.0  # starts older than this say nothing about the queue now


@dataclass(frozen=True)
class ServingLimits:
    """Overload settings of one server (or of each replica); ``None``: the engine's default."""

    max_waiting_requests: int | None = None
    max_queued_tokens: int | None = None
    request_timeout: float | None = None  # seconds; None: no server-wide time limit
    # The engine thread runs this much nicer than the HTTP threads (0: as nice), so that under
    # load the event loop, and with replicas Ray's plumbing, still get a core for quick answers.
    engine_nice: int = 0

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        t = self.request_timeout
        if t is not None and not (t > 0 and math.isfinite(t)):
            raise ValueError(f"request_timeout must be a positive number of seconds, got {t}")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in [0, 19], got {self.engine_nice}")


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_queued_tokens: int


def resolve_limits(limits: ServingLimits, engine: LLMEngine) -> AdmissionLimits:
    bm = engine.block_manager
    pool_tokens = bm.num_blocks * bm.block_size
    return AdmissionLimits(
        max_waiting_requests=limits.max_waiting_requests or engine.config.max_num_seqs,
        max_queued_tokens=limits.max_queued_tokens or pool_tokens,
    )


class Overloaded(RuntimeError):
    """A request beyond the admission limits: answered with 429 and ``Retry-After``."""

    def __init__(self, message: str, limit: Limit, retry_after: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after


class Admission:
    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.waiting_requests = 0
        self.queued_tokens = 0
        self._starts: deque[float] = deque(maxlen=_RATE_WINDOW)

    def admit(self, costs: list[int]) -> None:
        lim = self.limits
        if self.waiting_requests > 0:
            limit: Limit | None = None
            if self.waiting_requests + len(costs) > lim.max_waiting_requests:
                limit = "waiting_requests"
                what = f"{self.waiting_requests} requests wait (limit {lim.max_waiting_requests})"
            elif self.queued_tokens + sum(costs) > lim.max_queued_tokens:
                limit = "queued_tokens"
                what = (
                    f"waiting requests hold {self.queued_tokens} prompt + output tokens "
                    f"(limit {lim.max_queued_tokens}); this one asks for {sum(costs)}"
                )
            if limit is not None:
                after = self.retry_after()
                raise Overloaded(
                    f"the server is overloaded: {what}; retry after {after} s", limit, after
                )
        self.waiting_requests += len(costs)
        self.queued_tokens += sum(costs)

    def started(self, cost: int) -> None:
        self._starts.append(time.monotonic())
        self.released(cost)

    def released(self, cost: int) -> None:
        self.waiting_requests -= 1
        self.queued_tokens -= cost

    def retry_after(self) -> int:
        now = time.monotonic()
        while self._starts and now - self._starts[0] > _RATE_MAX_AGE_S:
            self._starts.popleft()
        if len(self._starts) < 2:
            return 1
        span = max(now - self._starts[0], 1e-3)
        rate = (len(self._starts) - 1) / span  # waiting requests that start per second
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.waiting_requests / rate)))
