"""The engine's throughput over the recent past, and what it makes of a queue in seconds.

Contract: the engine loop's thread calls ``ThroughputMeter.record(seconds, prefill, decode)``
once per engine step: how long the step took, the prompt tokens it computed and the tokens it
generated. ``rates()`` (any thread) returns the ``Rates`` of the steps of the last ``window``
seconds of engine time: prompt tokens per second of the steps that computed prompt tokens, and
generated tokens per second of the steps that generated any (steps that do both count in both,
each rate being what the queue's prompts or outputs advance by while the engine runs as it did);
a rate with no such step in the window keeps its last value, so that a burst after an idle
spell meets the rates of the last busy one. None until both rates have been measured.

``start_delay(queue, rates, capacity)`` estimates when a new request would produce its first
token (a request of several choices: its last): once every prompt ahead of it and its own is
computed (``Queue.prompt`` tokens at the prefill rate), and once the engine has room for it: the
engine runs at most ``Capacity.slots`` requests and as many as its KV pool holds at their mean
footprint (prompt plus output); each request beyond that waits for one to finish, and requests
finish, at the decode rate, one per mean output. The mean output is what the requests that
finished lately generated (``Queue.generated``: a request without ``max_tokens`` that stops at
its end-of-text token asks for the context's room but holds and takes far less), at most what
the queued ones ask for; what they ask for while none has finished. The larger of the two
times, in seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_S = 30.0  # seconds of engine time the rates are measured over
_MAX_STEPS = 4096  # a bound on the steps kept, however short they are


@dataclass(frozen=True, kw_only=True)
class Rates:
    prefill_per_s: float  # prompt tokens computed per second
    decode_per_s: float  # tokens generated per second


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What the engine holds at once: requests (``max_num_seqs``) and KV-pool tokens."""

    slots: int
    pool_tokens: int


@dataclass(frozen=True, kw_only=True)
class Queue:
    """The requests new ones would join, and the new ones themselves."""

    running: int  # requests that generate (they hold a slot until they finish)
    waiting: int  # requests ahead of the new ones that have not started
    joining: int  # the new requests (a request's choices)
    prompt: int  # prompt tokens still to compute: the waiting requests' and the new ones'
    tokens: int  # prompt + requested output tokens of every request above
    output: int  # requested output tokens of every request above
    generated: float | None = None  # the mean output of the requests that finished lately


def start_delay(queue: Queue, rates: Rates, capacity: Capacity) -> float:
    """Seconds until a new request would produce its first token (module docstring)."""
    prefill = queue.prompt / rates.prefill_per_s
    requests = queue.running + queue.waiting + max(1, queue.joining)
    asked = queue.output / requests
    output = asked if queue.generated is None else min(asked, queue.generated)
    footprint = max(1.0, (queue.tokens - queue.output) / requests + output)
    room = max(1, min(capacity.slots, math.floor(capacity.pool_tokens / footprint)))
    must_finish = max(0, requests - room)
    drain = must_finish * output / rates.decode_per_s
    return max(prefill, drain)


@dataclass
class _Step:
    end: float  # engine time at the step's end
    seconds: float
    prefill: int
    decode: int


class ThroughputMeter:
    def __init__(self, window: float = DEFAULT_WINDOW_S) -> None:
        self.window = window
        self._steps: deque[_Step] = deque()
        self._clock = 0.0  # engine time: the steps' durations summed
        # Over the kept steps: the tokens (exact: ints) and seconds of the steps that computed
        # prompt tokens, and of those that generated tokens.
        self._prefill_tokens = self._decode_tokens = 0
        self._prefill_s = self._decode_s = 0.0
        self._last: tuple[float | None, float | None] = (None, None)
        self._rates: Rates | None = None

    def record(self, seconds: float, prefill: int, decode: int) -> None:
        if seconds <= 0 or not (prefill or decode):
            return
        self._clock += seconds
        step = _Step(self._clock, seconds, prefill, decode)
        self._steps.append(step)
        self._add(step, 1)
        while self._steps and (
            self._clock - self._steps[0].end >= self.window or len(self._steps) > _MAX_STEPS
        ):
            self._add(self._steps.popleft(), -1)
        self._publish()

    def rates(self) -> Rates | None:
        return self._rates  # replaced whole by the engine thread: a consistent snapshot

    def _add(self, step: _Step, sign: int) -> None:
        if step.prefill:
            self._prefill_tokens += sign * step.prefill
            self._prefill_s += sign * step.seconds
        if step.decode:
            self._decode_tokens += sign * step.decode
            self._decode_s += sign * step.seconds

    def _publish(self) -> None:
        prefill, decode = self._last
        if self._prefill_tokens > 0 and self._prefill_s > 0:
            prefill = self._prefill_tokens / self._prefill_s
        if self._decode_tokens > 0 and self._decode_s > 0:
            decode = self._decode_tokens / self._decode_s
        self._last = (prefill, decode)
        if prefill is not None and decode is not None:
            self._rates = Rates(prefill_per_s=prefill, decode_per_s=decode)
