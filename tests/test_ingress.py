"""The ingress gate of replicas (server.ingress) in front of a stand-in for Ray's routing: it
refuses from the replicas' published state, counting the requests on their way, answers /health
without them, and passes everything through while it has no view; admission control's room."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx

from eeserve.server.admission import Admission, AdmissionLimits, Cost, Estimate
from eeserve.server.ingress import GateView, IngressGate, ReplicaState, key_digest
from eeserve.server.throughput import Capacity, ThroughputMeter
from tests.waiting import until


class _Routing:
    """Ray's routing and the replicas, as far as the gate sees them: every request waits until
    released, then gets 200 (401 without the key, when one is set)."""

    def __init__(self, key: str | None = None) -> None:
        self.release = asyncio.Event()
        self.seen: list[str] = []
        self.key = key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        await self.release.wait()
        auth = dict(scope["headers"]).get(b"authorization", b"")
        ok = self.key is None or scope["path"] == "/health" or auth == f"Bearer {self.key}".encode()
        await send({"type": "http.response.start", "status": 200 if ok else 401, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


class _Source:
    def __init__(self, states: list[ReplicaState]) -> None:
        self.states = states
        self.refused: dict[str, int] = {}

    async def __call__(self, refused: dict[str, int]) -> list[ReplicaState]:
        self.refused = refused
        return self.states


def _state(name: str, **kw: Any) -> ReplicaState:
    return ReplicaState(**{"replica": name, "serving": True, "held": 0, "room": 0, **kw})


BODY = {"model": "m", "prompt": "x", "max_tokens": 2}


def test_gate_refuses_beyond_the_replicas_room_and_answers_health_itself() -> None:
    """Two replicas, one holding a request with room for two more, the other three and room for
    one: of eight requests at once, six go on (as many as the replicas hold plus their least
    room times two: Ray, not the gate, picks the replica; the gate counts the requests it let
    through as held), the other two get 429 at once with the fuller replica's Retry-After and
    type; /health is answered while the replicas hold everything; answered requests free their
    places."""
    routing = _Routing()
    fuller = _state("b", held=3, room=1, retry_after=7)
    source = _Source([_state("a", held=1, room=2, limit="queue_seconds", retry_after=9), fuller])
    gate = IngressGate(routing, source, poll_s=0.01)

    async def run() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            routing.release.set()
            await c.get("/v1/models")  # starts the gate's poll; passes through
            await until(lambda: gate.view is not None, "a view")
            routing.release.clear()
            sent = [asyncio.create_task(c.post("/v1/completions", json=BODY)) for _ in range(8)]
            await until(lambda: sum(t.done() for t in sent) == 2, "two refusals")
            early = [t for t in sent if t.done()]
            out: dict[str, Any] = {"early": [t.result() for t in early]}
            out["health"] = await c.get("/health")
            out["seen"] = list(routing.seen)
            routing.release.set()
            out["late"] = [await t for t in sent if t not in early]
            await until(lambda: source.refused, "the refusals published")
            out["next"] = await c.post("/v1/chat/completions", json=BODY)
            return out

    out = asyncio.run(run())
    assert [r.status_code for r in out["early"]] == [429, 429]
    for r in out["early"]:
        assert r.headers["Retry-After"] == "7"
        assert r.json()["error"]["type"] == "requests"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert out["health"].status_code == 200 and out["health"].json() == {"status": "ok"}
    assert out["seen"].count("/v1/completions") == 6 and "/health" not in out["seen"]
    assert [r.status_code for r in out["late"]] == [200] * 6
    assert source.refused == {"requests": 2}
    assert out["next"].status_code == 200  # answered ones free their places


def test_gate_passes_through_without_a_view_and_without_the_key() -> None:
    """No serving replica in its view: /health and every request go on to the replicas. With a
    key, a request without it goes on to get the replicas' 401, not the gate's 429."""
    routing = _Routing(key="k")
    source = _Source([_state("a", serving=False)])
    gate = IngressGate(routing, source, poll_s=0.01)
    routing.release.set()

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            statuses = [(await c.get("/health")).status_code]
            await asyncio.sleep(0.05)  # polls: a view of no serving replica is none
            statuses.append((await c.post("/v1/completions", json=BODY)).status_code)
            source.states = [_state("a", room=0, key_digest=key_digest("k"))]
            await until(lambda: gate.view is not None, "a view")
            statuses.append((await c.post("/v1/completions", json=BODY)).status_code)
            auth = {"Authorization": "Bearer k"}
            statuses.append((await c.post("/v1/completions", json=BODY, headers=auth)).status_code)
            return statuses

    assert asyncio.run(run()) == [200, 401, 401, 429]
    assert routing.seen == ["/health", "/v1/completions", "/v1/completions"]


def test_gate_view_sums_serving_replicas() -> None:
    assert GateView.of([]) is None
    view = GateView.of([_state("a", held=2, room=3), _state("b", held=9, serving=False)])
    assert view is not None and view.capacity == 5 and view.limit == "requests"
    assert view.retry_after == 1


def test_room_counts_requests_of_the_recent_mean_cost() -> None:
    """Room for requests like the ones settled lately, by every limit: the request cap, the
    token cap, and the bound in seconds at the measured (synthetic) rates."""
    meter = ThroughputMeter()
    limits = AdmissionLimits(max_waiting_requests=10, max_queued_tokens=1000, max_queue_seconds=5)
    adm = Admission(limits, Capacity(slots=64, pool_tokens=10**6), meter.rates)
    assert adm.room() == 10  # an empty queue: the request cap alone
    for _ in range(2):
        adm.settle(adm.reserve(Estimate.exact([Cost(40, 10)])), [Cost(40, 10)])
    assert adm.room() == 8  # 2 of 10 wait; 10 x 50 tokens fit in 1000
    adm.settle(adm.reserve(Estimate.exact([Cost(40, 10)] * 5)), [Cost(40, 10)] * 5)
    assert adm.room() == 3 and adm.queued_tokens == 350
    limits = AdmissionLimits(max_waiting_requests=10, max_queued_tokens=200, max_queue_seconds=5)
    adm.limits = limits  # 350 tokens wait, over the cap: no request fits
    assert adm.room() == 0
    adm.limits = AdmissionLimits(
        max_waiting_requests=100, max_queued_tokens=10**6, max_queue_seconds=5
    )
    meter.record(1.0, 100, 0)  # 100 prompt tokens a second: 280 ahead take 2.8 s
    meter.record(1.0, 0, 10)
    assert math.isclose(adm.queue_seconds(), 2.8)
    assert adm.room() == 5  # 5 more of 40 tokens: 4.8 s; a sixth: 5.2 s > 5 s


def test_metrics_page_counts_the_gates_refusals_beside_the_replicas() -> None:
    """The replicas' merged /metrics page carries the gate's refusals by type, and the soak
    reads both counts off it."""
    from eeserve.bench.soak_sample import read_refusals
    from eeserve.server.replica_metrics import ReplicaPage, merge_pages

    page = (
        "# TYPE eeserve_admission_rejected counter\n"
        'eeserve_admission_rejected_total{limit="waiting_requests"} 3.0\n'
    )
    pages = [ReplicaPage("r1", 11, page), ReplicaPage("r2", 12, page)]
    text = merge_pages(pages, {"requests": 5, "queue_seconds": 2}).decode()
    assert 'eeserve_ingress_rejected_total{type="queue_seconds"} 2.0' in text
    assert read_refusals(text) == {"replicas": 6.0, "ingress": 7.0}
