"""Under a burst the refusals go first: a request's place in the queue is taken, at the least it
can cost, before its body is read (``refusal.EarlyRefusal``), so the requests behind the ones
the queue takes are answered 429 before any body is parsed; the place is given back however the
request ends. On the tiny model, the app called in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.server import serving
from eeserve.server.admission import ServingLimits
from eeserve.server.app import create_app
from eeserve.server.arrivals import Arrivals

KV_BYTES = 4_000_000


def _app(model_dir: Path, waiting: int) -> Any:
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=KV_BYTES))
    return create_app(
        engine, model_names=["tiny"], limits=ServingLimits(max_waiting_requests=waiting)
    )


def test_refusals_are_answered_before_any_body_is_parsed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(tiny_model_dir, waiting=2)
    events: list[str] = []
    cost = serving.estimate

    def parsed(*args: Any) -> Any:  # the route's reservation, once its body is parsed
        events.append("parsed")
        return cost(*args)

    monkeypatch.setattr(serving, "estimate", parsed)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def run() -> list[int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

                async def one() -> int:
                    r = await c.post("/v1/chat/completions", json=chat)
                    events.append(str(r.status_code))
                    return r.status_code

                return list(await asyncio.gather(*(one() for _ in range(10))))

    statuses = asyncio.run(run())
    assert sorted(statuses) == [200, 200] + [429] * 8
    assert events.index("parsed") > max(i for i, e in enumerate(events) if e == "429")
    assert app.state.engine_loop.admission.waiting_requests == 0


def test_the_place_is_given_back_however_the_request_ends(tiny_model_dir: Path) -> None:
    """A 400 (bad body), a 404 (unknown model) and a served request each leave the queue empty."""
    app = _app(tiny_model_dir, waiting=1)
    good = {"model": "tiny", "prompt": "hi", "max_tokens": 2}

    async def run() -> list[int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                got = []
                for body in ({"model": "tiny"}, {**good, "model": "other"}, good, good):
                    got.append((await c.post("/v1/completions", json=body)).status_code)
                    assert app.state.engine_loop.admission.waiting_requests == 0
                return got

    assert asyncio.run(run()) == [400, 404, 200, 200]


def test_settled_waits_while_requests_arrive_and_no_longer_than_its_bound() -> None:
    async def run() -> tuple[int, int]:
        arrivals = Arrivals(max_wait=3600.0)
        flood = Arrivals(max_wait=0.01)

        async def arrive(a: Arrivals, n: int) -> None:
            for _ in range(n):
                a.arrived()
                await asyncio.sleep(0)

        burst = asyncio.create_task(arrive(arrivals, 50))
        await asyncio.sleep(0)
        await arrivals.settled()  # returns only once the 50 have come
        seen = arrivals.count
        endless = asyncio.create_task(arrive(flood, 10**9))
        await flood.settled()  # returns at its bound, the flood still going
        endless.cancel()
        await burst
        return seen, flood.count

    seen, flooded = asyncio.run(run())
    assert seen == 50 and flooded > 0
