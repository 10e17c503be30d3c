"""Prometheus metrics of one server instance, in its own ``CollectorRegistry`` (no globals).

Contract: ``ServerMetrics(num_layers)`` creates every metric in a fresh registry; ``render()``
returns the text exposition format and its content type. The engine thread records token counts,
latencies, exit layers and the gauges; the HTTP layer records requests by endpoint and status
(``success``, ``aborted`` (client went away), ``rejected`` (4xx other than 429), ``overloaded``
(429: beyond the admission limits; also counted by limit in ``eeserve_admission_rejected``),
``timeout`` (the request's time limit passed), ``error`` (5xx or a request the engine could not
finish)), and how long a 429 took to answer (``eeserve_rejection_seconds``: from the request's
arrival at the app to its response headers, recorded by ``app.RejectionTimer``: what a load
balancer waits for a refusal inside this process). ``track_admission(admission, meter)`` exposes
admission control's waiting requests, their tokens, the seconds its queue is estimated to take
and its limits as gauges, and the throughput the estimate uses (prompt and generated tokens per
second).
"""

from __future__ import annotations

import math

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from eeserve.server.admission import Admission, Limit
from eeserve.server.throughput import ThroughputMeter

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

REQUEST_STATUSES = ("success", "aborted", "rejected", "overloaded", "timeout", "error")


class ServerMetrics:
    def __init__(self, num_layers: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "eeserve_requests",
            "HTTP generation requests by endpoint and final status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "eeserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "eeserve_generation_tokens", "Generated tokens", registry=r
        )
        self.time_to_first_token = Histogram(
            "eeserve_time_to_first_token_seconds",
            "Time from admission to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "eeserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.exit_layer = Histogram(
            "eeserve_exit_layer",
            "Layer (1-based) each generated token exited at; the last bucket is full depth",
            buckets=tuple(float(i) for i in range(1, num_layers + 1)),
            registry=r,
        )
        self.layers_saved = Counter(
            "eeserve_layers_saved", "Decoder-layer computations skipped by early exit", registry=r
        )
        self.layers_total = Counter(
            "eeserve_layers", "Decoder-layer computations a full-depth decode would run", registry=r
        )
        self.spec_drafted = Counter(
            "eeserve_spec_draft_tokens",
            "Speculative mode: drafted tokens that were verified (accepted or not)",
            registry=r,
        )
        self.spec_accepted = Counter(
            "eeserve_spec_accepted_tokens",
            "Speculative mode: drafted tokens that full depth accepted",
            registry=r,
        )
        self.running = Gauge("eeserve_num_requests_running", "Running requests", registry=r)
        self.waiting = Gauge("eeserve_num_requests_waiting", "Waiting requests", registry=r)
        self.kv_blocks_used = Gauge("eeserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_free = Gauge("eeserve_kv_blocks_free", "Free KV cache blocks", registry=r)
        self._admission_metrics(r)
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            for status in REQUEST_STATUSES:
                self.requests.labels(endpoint, status)

    def _admission_metrics(self, r: CollectorRegistry) -> None:
        """Admission control's counters and gauges (docs/server.md, "Overload")."""
        self.admission_rejected = Counter(
            "eeserve_admission_rejected",
            "Requests answered 429 because a limit of admission control was reached",
            ["limit"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "eeserve_admission_waiting_requests",
            "Admitted engine requests that have not produced their first token",
            registry=r,
        )
        self.admission_queued_tokens = Gauge(
            "eeserve_admission_queued_tokens",
            "Prompt + requested output tokens of the waiting engine requests",
            registry=r,
        )
        self.admission_queue_seconds = Gauge(
            "eeserve_admission_queue_seconds",
            "Estimated seconds before a request sent now would produce its first token "
            "(NaN until the throughput is measured)",
            registry=r,
        )
        self.admission_limit = Gauge(
            "eeserve_admission_limit",
            "Admission limits: waiting_requests, queued_tokens and queue_seconds",
            ["limit"],
            registry=r,
        )
        self.prefill_rate = Gauge(
            "eeserve_prefill_tokens_per_second",
            "Prompt tokens computed per second over the recent past (steps that computed any)",
            registry=r,
        )
        self.decode_rate = Gauge(
            "eeserve_decode_tokens_per_second",
            "Tokens generated per second over the recent past (steps that generated any)",
            registry=r,
        )
        self.rejection_seconds = Histogram(
            "eeserve_rejection_seconds",
            "Time from a generation request's arrival at the app to its 429 response headers",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for limit in Limit:
            self.admission_rejected.labels(limit)

    def request_done(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint, status).inc()

    def track_admission(self, admission: Admission, meter: ThroughputMeter) -> None:
        self.admission_waiting.set_function(lambda: admission.waiting_requests)
        self.admission_queued_tokens.set_function(lambda: admission.queued_tokens)
        self.admission_queue_seconds.set_function(admission.queue_seconds)
        lim = admission.limits
        self.admission_limit.labels(Limit.WAITING_REQUESTS).set(lim.max_waiting_requests)
        self.admission_limit.labels(Limit.QUEUED_TOKENS).set(lim.max_queued_tokens)
        self.admission_limit.labels(Limit.QUEUE_SECONDS).set(lim.max_queue_seconds)
        self.prefill_rate.set_function(lambda: _rate(meter, prefill=True))
        self.decode_rate.set_function(lambda: _rate(meter, prefill=False))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _rate(meter: ThroughputMeter, *, prefill: bool) -> float:
    rates = meter.rates()
    if rates is None:
        return math.nan
    return rates.prefill_per_s if prefill else rates.decode_per_s
