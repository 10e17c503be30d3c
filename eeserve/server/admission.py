"""Admission control: a queue bounded in requests, tokens and seconds, 429 at once beyond it.

Contract: ``ServingLimits`` holds what the server's flags ask (``None``: derive from the engine);
``resolve_limits(limits, engine)`` turns it into ``AdmissionLimits`` with concrete numbers:
``max_waiting_requests`` defaults to the engine's ``max_num_seqs`` (one more full batch may wait
while one runs), ``max_queued_tokens`` to the KV pool's token capacity (the requests that wait hold
at most one pool of work: prompt plus requested output tokens each), and ``max_queue_seconds`` is
``DEFAULT_MAX_QUEUE_SECONDS`` unless asked (``inf``: no bound in seconds).
``engine_capacity(engine)`` is what the engine holds at once (``throughput.Capacity``).

``Admission`` counts engine requests (one per choice), on the event loop's thread only (no lock), in
three states: reserved (passed the cheap check, being templated and tokenized), waiting (admitted,
no first token yet) and running (generating). Reserved and waiting requests are the queue. A
``Cost`` is one engine request's prompt and requested output tokens.

- ``reserve(estimate)`` runs before any templating or tokenizing: with the request's choices and the
  least its tokens can be (``Estimate.low``) it raises ``Overloaded`` when the queue would pass a
  limit: more than ``max_waiting_requests`` requests, more than ``max_queued_tokens`` tokens, or, at
  the throughput measured over the recent past (``rates()``, a ``throughput.ThroughputMeter``'s), a
  first token later than ``max_queue_seconds`` from now (``throughput.start_delay``). Otherwise it
  returns a ``Ticket`` that holds that least in the queue while the request is prepared. The
  estimate in seconds counts the prompts of requests not tokenized yet (its own and those in
  preparation) at the tokens per byte of text that the last ``_FINISHED_WINDOW`` requests settled
  had, not at their least: a burst's requests in preparation are otherwise nearly free to it, and
  are refused only once tokenized.
- ``settle(ticket, costs)``, once tokenized, checks the exact costs against the same limits (the
  queue as it is then, without the ticket; not for a request that found the queue empty) and puts
  them in the queue in the ticket's place (``Overloaded`` when they pass a limit: only a request
  near one, whose least fitted, gets this far and is refused).
- ``Ticket.release()`` gives back a reservation that was not settled (a 400, a shutdown); it does
  nothing after ``settle`` or a release.
- ``started(cost)`` when a waiting request produces its first output, ``released(cost)`` when it
  ends before that, ``finished(cost, generated)`` when a running one ends (``generated``: the tokens
  it generated when it ran to its end, None when it was cut short; the estimate takes the mean of
  the last ``_FINISHED_WINDOW``).

``refusal_for_any()`` is the ``Overloaded`` of a request that asks for the least there is (one
prompt token, one output token), or None: while it is not None, no request can be admitted, whatever
its body says; ``room()`` is how many more requests of the recent mean cost it would admit (0
while no request can be). A request that finds the queue empty is always admitted, so that one
larger than the token limit is still served, alone. ``Overloaded`` names the limit and a
``retry_after`` in whole seconds from the same estimate: how long until the queue ahead has started
enough of its requests to take this one (1 to ``MAX_RETRY_AFTER_S``; 1 while no rate is measured
yet). ``queue_seconds()`` is the estimate for a request of no tokens (NaN without rates).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from eeserve.engine.llm_engine import LLMEngine
from eeserve.server.engine_core import EngineHost
from eeserve.server.throughput import Capacity, Queue, Rates, start_delay

MAX_RETRY_AFTER_S = 60
DEFAULT_MAX_QUEUE_SECONDS = 20.0  # docs/server.md, "Why these defaults"
_FINISHED_WINDOW = 64  # requests that ran to their end: their mean output is the estimate's


class Limit(StrEnum):
    WAITING_REQUESTS = "waiting_requests"
    QUEUED_TOKENS = "queued_tokens"
    QUEUE_SECONDS = "queue_seconds"


@dataclass(frozen=True)
class ServingLimits:
    """Overload settings of one server (or of each replica); ``None``: the engine's default."""

    max_waiting_requests: int | None = None
    max_queued_tokens: int | None = None
    request_timeout: float | None = None  # seconds; None: no server-wide time limit
    # The engine thread runs this much nicer than the HTTP threads (0: as nice), so that under
    # load the event loop, and with replicas Ray's plumbing, still get a core for quick answers.
    engine_nice: int = 0
    max_queue_seconds: float = DEFAULT_MAX_QUEUE_SECONDS  # inf: no bound in seconds
    # Where the engine steps: a process of its own keeps its Python off the HTTP side's GIL
    # (``eeserve serve``'s default); a thread of the serving process is the library default.
    engine_host: EngineHost = EngineHost.THREAD

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
        if not self.max_queue_seconds > 0:  # NaN fails too; inf is no bound
            raise ValueError(
                f"max_queue_seconds must be a number of seconds > 0 (inf: no bound), "
                f"got {self.max_queue_seconds}"
            )


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int
    max_queued_tokens: int
    max_queue_seconds: float = math.inf


def resolve_limits(limits: ServingLimits, engine: LLMEngine) -> AdmissionLimits:
    return AdmissionLimits(
        max_waiting_requests=limits.max_waiting_requests or engine.config.max_num_seqs,
        max_queued_tokens=limits.max_queued_tokens or engine_capacity(engine).pool_tokens,
        max_queue_seconds=limits.max_queue_seconds,
    )


def engine_capacity(engine: LLMEngine) -> Capacity:
    bm = engine.block_manager
    return Capacity(slots=engine.config.max_num_seqs, pool_tokens=bm.num_blocks * bm.block_size)


@dataclass(frozen=True)
class Cost:
    """One engine request's tokens (or a group's, summed): its prompt and requested output."""

    prompt: int
    output: int

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


def total(costs: list[Cost]) -> Cost:
    return Cost(sum(c.prompt for c in costs), sum(c.output for c in costs))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What a request may cost, known before it is tokenized: its choices, the least its tokens
    can be and the UTF-8 bytes its text prompts come from (0: none), summed over the choices."""

    choices: int
    low: Cost
    prompt_bytes: int = 0

    @classmethod
    def exact(cls, costs: list[Cost]) -> Estimate:
        return cls(choices=len(costs), low=total(costs))


class Overloaded(RuntimeError):
    """A request beyond the admission limits: answered with 429 and ``Retry-After``."""

    def __init__(self, message: str, limit: Limit, retry_after: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after


class Ticket:
    """A reservation in the queue: ``choices`` requests holding ``held`` tokens, and likely
    ``likely`` more prompt tokens than that (what the queue's estimate in seconds counts)."""

    def __init__(self, admission: Admission, estimate: Estimate, likely: int, first: bool) -> None:
        self.admission = admission
        self.choices = estimate.choices
        self.held = estimate.low
        self.prompt_bytes = estimate.prompt_bytes
        self.likely = likely
        self.first = first  # it found the queue empty: admitted whatever it costs
        self.open = True

    def release(self) -> None:
        if self.open:
            self.open = False
            self.admission.take(self.choices, self.held, self.likely)


@dataclass(frozen=True)
class _Refusal:
    limit: Limit
    what: str
    retry_after: int


class Admission:
    def __init__(
        self,
        limits: AdmissionLimits,
        capacity: Capacity,
        rates: Callable[[], Rates | None] = lambda: None,
    ) -> None:
        self.limits = limits
        self.capacity = capacity
        self.rates = rates
        self.waiting_requests = 0  # the queue: reserved and waiting
        self.queued = Cost(0, 0)
        self.running_requests = 0
        self.running = Cost(0, 0)
        self._likely = 0  # prompt tokens the open tickets likely hold beyond their least
        self._generated: deque[int] = deque(maxlen=_FINISHED_WINDOW)
        self._per_byte: deque[tuple[int, int]] = deque(maxlen=_FINISHED_WINDOW)
        self._settled: deque[Cost] = deque(maxlen=_FINISHED_WINDOW)  # per engine request

    @property
    def queued_tokens(self) -> int:
        return self.queued.tokens

    def reserve(self, estimate: Estimate) -> Ticket:
        likely = self._likely_prompt(estimate) - estimate.low.prompt
        refusal = self._refusal(estimate.choices, estimate.low, likely)
        if refusal is not None:
            raise _overloaded(refusal)
        # Held at its least, not its most: a bound from bytes is several times the tokens of
        # most text, and a burst's reservations held at it refused requests the queue had room
        # for (docs/server.md, "Refusals before the expensive work").
        first = self.waiting_requests == 0
        self.put(estimate.choices, estimate.low, likely)
        return Ticket(self, estimate, likely, first)

    def settle(self, ticket: Ticket, costs: list[Cost]) -> None:
        if not ticket.open:
            raise ValueError("the ticket was settled or released already")
        ticket.release()
        exact = total(costs)
        if ticket.prompt_bytes:
            self._per_byte.append((exact.prompt, ticket.prompt_bytes))
        n = max(1, len(costs))
        self._settled.append(Cost(exact.prompt // n, exact.output // n))
        refusal = None if ticket.first else self._refusal(len(costs), exact)
        if refusal is not None:
            raise _overloaded(refusal)
        self.put(len(costs), exact)

    def _likely_prompt(self, estimate: Estimate) -> int:
        """Its prompt tokens as the requests settled lately had them per byte of text (the
        least, until one has)."""
        tokens = sum(t for t, _ in self._per_byte)
        per_byte = tokens / max(1, sum(b for _, b in self._per_byte))
        return max(estimate.low.prompt, round(estimate.prompt_bytes * per_byte))

    def started(self, cost: Cost) -> None:
        self.take(1, cost)
        self.running_requests += 1
        self.running = Cost(self.running.prompt + cost.prompt, self.running.output + cost.output)

    def released(self, cost: Cost) -> None:
        self.take(1, cost)

    def finished(self, cost: Cost, generated: int | None = None) -> None:
        if generated is not None:
            self._generated.append(generated)
        self.running_requests -= 1
        self.running = Cost(self.running.prompt - cost.prompt, self.running.output - cost.output)

    def put(self, requests: int, cost: Cost, likely: int = 0) -> None:
        """Add to the queue (``reserve`` and ``settle`` do; public for ``Ticket``)."""
        self.waiting_requests += requests
        self.queued = Cost(self.queued.prompt + cost.prompt, self.queued.output + cost.output)
        self._likely += likely

    def take(self, requests: int, cost: Cost, likely: int = 0) -> None:
        """Take out of the queue: the counterpart of ``put``."""
        self.waiting_requests -= requests
        self.queued = Cost(self.queued.prompt - cost.prompt, self.queued.output - cost.output)
        self._likely -= likely

    def refusal_for_any(self) -> Overloaded | None:
        """The refusal of any request, whatever it asks: even one engine request of one prompt
        token and one output token would pass a limit (None: some request could be admitted)."""
        refusal = self._refusal(1, Cost(1, 1))
        return None if refusal is None else _overloaded(refusal)

    def room(self) -> int:
        """How many more engine requests, each costing what the last ones settled did on
        average (one prompt and one output token until one has), the queue would admit now: 0
        while ``refusal_for_any()`` is not None. An ingress in front of several servers refuses
        from it without asking them (``server.ingress``)."""
        if self._refusal(1, Cost(1, 1)) is not None:
            return 0
        settled = list(self._settled)  # one step: an ingress reads this off the loop's thread
        n = max(1, len(settled))
        typical = Cost(
            max(1, sum(c.prompt for c in settled) // n), max(1, sum(c.output for c in settled) // n)
        )
        lo, hi = 1, max(1, self.limits.max_waiting_requests - self.waiting_requests)
        while lo < hi:  # the most k whose group of k fits; a group of 1 counts as fitting
            k = (lo + hi + 1) // 2
            fits = self._refusal(k, Cost(typical.prompt * k, typical.output * k)) is None
            lo, hi = (k, hi) if fits else (lo, k - 1)
        return lo

    def queue_seconds(self) -> float:
        delay = self._delay(0, Cost(0, 0))
        return math.nan if delay is None else delay

    def _delay(self, choices: int, cost: Cost, likely: int = 0) -> float | None:
        """Seconds until a group of ``choices`` costing ``cost`` (and likely ``likely`` more
        prompt tokens) would start (None: no rates)."""
        rates = self.rates()
        if rates is None:
            return None
        queue = Queue(
            running=self.running_requests,
            waiting=self.waiting_requests,
            joining=choices,
            prompt=self.queued.prompt + self._likely + cost.prompt + likely,
            tokens=self.running.tokens + self.queued.tokens + cost.tokens,
            output=self.running.output + self.queued.output + cost.output,
            generated=sum(self._generated) / len(self._generated) if self._generated else None,
        )
        return start_delay(queue, rates, self.capacity)

    def _refusal(self, choices: int, cost: Cost, likely: int = 0) -> _Refusal | None:
        """The limit a group of ``choices`` costing ``cost`` (and likely ``likely`` more prompt
        tokens: the estimate in seconds counts them, the hard caps do not) would pass, or None."""
        waiting, lim = self.waiting_requests, self.limits
        if waiting == 0:
            return None
        delay = self._delay(choices, cost, likely)
        if waiting + choices > lim.max_waiting_requests:
            share = (waiting + choices - lim.max_waiting_requests) / waiting
            what = f"{waiting} requests wait (limit {lim.max_waiting_requests})"
            return _Refusal(Limit.WAITING_REQUESTS, what, _retry(delay, share))
        queued = self.queued_tokens
        if queued + cost.tokens > lim.max_queued_tokens:
            share = (queued + cost.tokens - lim.max_queued_tokens) / max(1, queued)
            what = (
                f"waiting requests hold {queued} prompt + output tokens "
                f"(limit {lim.max_queued_tokens}); this one asks for {cost.tokens}"
            )
            return _Refusal(Limit.QUEUED_TOKENS, what, _retry(delay, share))
        if delay is not None and delay > lim.max_queue_seconds:
            what = (
                f"the work queued ahead would start this request in about {delay:.0f} s "
                f"(limit {lim.max_queue_seconds:g} s)"
            )
            return _Refusal(Limit.QUEUE_SECONDS, what, _retry(delay - lim.max_queue_seconds, 1))
        return None


def _retry(seconds: float | None, share: float) -> int:
    """Whole seconds until ``share`` of a queue that starts in ``seconds`` has started."""
    if seconds is None:
        return 1
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds * min(1.0, share))))


def _overloaded(refusal: _Refusal) -> Overloaded:
    after = refusal.retry_after
    message = f"the server is overloaded: {refusal.what}; retry after {after} s"
    return Overloaded(message, refusal.limit, after)
