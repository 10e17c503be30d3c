"""Refusals before the expensive work, and the queue bounded in seconds: the throughput meter and
the start-delay estimate on synthetic steps, the cheap bound of a request's tokens against the
tokenizer's count, and bursts on the tiny model's app, whose tokenizing the test holds."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.server import prepare_thread
from eeserve.server.admission import (
    Admission,
    AdmissionLimits,
    Cost,
    Estimate,
    Limit,
    Overloaded,
    ServingLimits,
)
from eeserve.server.app import create_app
from eeserve.server.cost_bound import PromptBounds, chat_prompt_bound, estimate
from eeserve.server.prepare import ModelInfo, parse_body, prepare
from eeserve.server.protocol import ChatCompletionRequest
from eeserve.server.throughput import Capacity, Queue, Rates, ThroughputMeter, start_delay
from tests.waiting import until

KV_BYTES = 4_000_000


# -- the meter and the estimate ------------------------------------------------------------------


def test_meter_measures_prefill_and_decode_over_its_window() -> None:
    meter = ThroughputMeter(window=10.0)
    assert meter.rates() is None
    meter.record(1.0, 100, 0)
    assert meter.rates() is None  # no decode measured yet
    meter.record(1.0, 0, 10)
    assert meter.rates() == Rates(prefill_per_s=100.0, decode_per_s=10.0)
    meter.record(2.0, 200, 20)  # a mixed step counts in both
    assert meter.rates() == Rates(prefill_per_s=100.0, decode_per_s=10.0)
    meter.record(0.0, 5, 5)  # nothing measured in no time
    meter.record(1.0, 0, 0)  # nor in a step that did nothing
    for _ in range(10):  # the window moves on: only these steps count
        meter.record(1.0, 1000, 40)
    assert meter.rates() == Rates(prefill_per_s=1000.0, decode_per_s=40.0)
    for _ in range(12):  # decode alone for a window: the prefill rate keeps its last value
        meter.record(1.0, 0, 50)
    assert meter.rates() == Rates(prefill_per_s=1000.0, decode_per_s=50.0)


def test_start_delay_is_the_prefill_ahead_or_the_wait_for_room() -> None:
    rates = Rates(prefill_per_s=100.0, decode_per_s=10.0)
    roomy = Capacity(slots=8, pool_tokens=10_000)
    # Room for all: the prompts ahead and its own, at the prefill rate.
    queue = Queue(running=2, waiting=3, joining=1, prompt=100, tokens=1200, output=60)
    assert start_delay(queue, rates, roomy) == 1.0
    # Two slots: 4 of the 6 must finish first, each its mean output (10) at 10 tokens/s.
    assert start_delay(queue, rates, Capacity(slots=2, pool_tokens=10_000)) == 4.0
    # A KV pool of 600 tokens holds 3 requests of 200: 3 must finish.
    assert start_delay(queue, rates, Capacity(slots=8, pool_tokens=600)) == 3.0
    slow = Rates(prefill_per_s=100.0, decode_per_s=1.0)
    assert start_delay(queue, slow, Capacity(slots=8, pool_tokens=600)) == 30.0
    # Requests that ask for the context's room (1,000 tokens each) but end at their end-of-text
    # token: the mean of what finished requests generated stands for what they ask.
    asks = Queue(running=2, waiting=3, joining=1, prompt=100, tokens=6060, output=6000)
    assert start_delay(asks, slow, Capacity(slots=8, pool_tokens=600)) == 5000.0
    ended = dataclasses.replace(asks, generated=10.0)
    assert start_delay(ended, slow, Capacity(slots=8, pool_tokens=600)) == 1.0


def test_seconds_bound_refuses_when_the_measured_rate_says_so() -> None:
    meter = ThroughputMeter()
    limits = AdmissionLimits(max_waiting_requests=100, max_queued_tokens=10**6, max_queue_seconds=5)
    adm = Admission(limits, Capacity(slots=2, pool_tokens=10**6), meter.rates)

    def admit(cost: Cost) -> None:
        adm.settle(adm.reserve(Estimate.exact([cost])), [cost])

    admit(Cost(200, 10))
    admit(Cost(200, 10))  # no rate measured: only the hard caps apply
    assert math.isnan(adm.queue_seconds())
    meter.record(1.0, 100, 0)  # 100 prompt tokens a second, 10 generated
    meter.record(1.0, 0, 10)
    assert adm.queue_seconds() == 4.0
    with pytest.raises(Overloaded) as e:  # (400 + 200) / 100 = 6 s > 5 s
        admit(Cost(200, 10))
    err = e.value
    assert err.limit == Limit.QUEUE_SECONDS and err.retry_after == 1  # 6 - 5 s
    assert "about 6 s" in str(err) and "limit 5 s" in str(err)
    with pytest.raises(Overloaded) as e:
        admit(Cost(800, 10))
    assert e.value.retry_after == 7  # (400 + 800) / 100 - 5
    admit(Cost(50, 10))  # 4.5 s: admitted
    assert adm.refusal_for_any() is None  # 4.5 s + one token: some request still fits
    for _ in range(40):  # the engine turns out 10x faster: the queue is 0.45 s
        meter.record(1.0, 1000, 100)
    admit(Cost(200, 10))
    assert adm.waiting_requests == 4


def test_seconds_bound_counts_untokenized_prompts_at_the_tokens_per_byte_seen() -> None:
    """A request's text, before it is tokenized, counts in seconds at the tokens per byte of
    the requests settled before it: a burst's requests in preparation are not free."""
    meter = ThroughputMeter()
    meter.record(1.0, 100, 0)  # 100 prompt tokens a second
    meter.record(1.0, 0, 10)
    limits = AdmissionLimits(max_waiting_requests=100, max_queued_tokens=10**6, max_queue_seconds=5)
    adm = Admission(limits, Capacity(slots=64, pool_tokens=10**6), meter.rates)
    text = Estimate(choices=1, low=Cost(1, 10), prompt_bytes=400)
    first = adm.reserve(text)  # nothing settled yet: its least
    adm.settle(first, [Cost(100, 10)])  # 100 tokens from 400 bytes: a token per 4 bytes
    assert adm.queue_seconds() == 1.0
    held = [adm.reserve(text) for _ in range(3)]  # likely 100 tokens each: 4 s of prompt
    assert adm.queued_tokens == 110 + 3 * 11 and adm.queue_seconds() == 4.0
    with pytest.raises(Overloaded) as e:  # its own 800 bytes: likely 200 tokens, 6 s > 5 s
        adm.reserve(Estimate(choices=1, low=Cost(1, 10), prompt_bytes=800))
    assert e.value.limit == Limit.QUEUE_SECONDS
    for ticket in held:
        ticket.release()
    assert adm.queue_seconds() == 1.0 and adm.queued_tokens == 110


# -- the cheap bound -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def info(tiny_model_dir: Path) -> ModelInfo:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return ModelInfo(tokenizer=tok, model_names=["tiny"], max_model_len=512, num_layers=4)


TEXTS = [
    "x",
    "Hello there, how are you?",
    "naïve café — ü",
    "日本語のテキスト",
    "🙂🙃" * 5,
    " " * 9,
]


@pytest.mark.parametrize("text", TEXTS)
def test_cheap_bounds_hold_the_tokenizers_count(info: ModelInfo, text: str) -> None:
    """The least a request costs never exceeds its exact cost, and a chat prompt's most never
    falls short of it."""
    bounds = PromptBounds.of(info.tokenizer)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("completion", {"prompt": text, "max_tokens": 3}),
        ("completion", {"prompt": [text, text + text], "n": 2}),
        ("completion", {"prompt": [5, 6, 7], "max_tokens": 2}),
        ("chat", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        ("chat", {"messages": [{"role": "user", "content": text}]}),  # output: the room left
        (
            "chat",
            {
                "messages": [
                    {"role": "system", "content": text},
                    {"role": "user", "content": [{"type": "text", "text": text}], "name": "ü"},
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": text},
                ],
                "n": 3,
            },
        ),
    ]
    for kind, body in bodies:
        req = parse_body(kind, {"model": "tiny", **body})
        est = estimate(bounds, info, req)
        prep = prepare(info, req, kind)  # type: ignore[arg-type]
        lens = [len(s.prompt_token_ids) for s in prep.specs]
        assert est.choices == len(prep.specs), body
        assert est.low.prompt <= sum(lens), (body, est)
        assert est.low.output <= sum(s.params.max_tokens for s in prep.specs), (body, est)
        if isinstance(req, ChatCompletionRequest):
            assert max(lens) <= chat_prompt_bound(bounds, info, req), body


# -- bursts on the tiny model's app --------------------------------------------------------------


class _Gate:
    """Holds every request's templating and tokenizing until opened; counts them."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = 0

    def __call__(self, *args: Any) -> Any:
        self.entered += 1
        self.open.wait(60)
        return prepare(*args)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    monkeypatch.setattr(prepare_thread, "prepare", g)
    yield g
    g.open.set()


def test_burst_refusals_and_health_do_not_wait_for_tokenizing(
    tiny_model_dir: Path, gate: _Gate
) -> None:
    """Two requests may wait: the burst's other 10 are answered 429 while the first two are
    still being tokenized (held by the gate), without being tokenized themselves, and /health
    answers meanwhile; once tokenizing goes on, the two are served."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    app = create_app(engine, model_names=["tiny"], limits=ServingLimits(max_waiting_requests=2))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def run() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                sent = [
                    asyncio.create_task(c.post("/v1/chat/completions", json=chat))
                    for _ in range(12)
                ]
                await until(lambda: sum(t.done() for t in sent) == 10, "10 answers")
                done = [t for t in sent if t.done()]
                seen = {
                    "early": [t.result() for t in done],
                    "health": (await c.get("/health")).status_code,
                    "entered": gate.entered,
                }
                gate.open.set()
                seen["late"] = [await t for t in sent if t not in done]
                return seen

    seen = asyncio.run(run())
    assert seen["health"] == 200 and seen["entered"] == 1  # one tokenizing, one queued behind
    for r in seen["early"]:
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "requests"
    assert [r.status_code for r in seen["late"]] == [200, 200] and gate.entered == 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_queue_seconds_429_and_which_refusal_comes_first(tiny_model_dir: Path, gate: _Gate) -> None:
    """Through the app: at the (synthetic) measured rate the queue ahead takes longer than
    ``max_queue_seconds``: 429 ``queue_seconds`` with the estimate's Retry-After. While even the
    cheapest request cannot be admitted, a request is refused before its body is read (a
    malformed one too), but never before authentication; otherwise the model and the choices are
    checked first (404, 400), and a group too large for what is left is refused untokenized."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=KV_BYTES))
    limits = ServingLimits(max_waiting_requests=3, max_queue_seconds=1.0)
    app = create_app(engine, model_names=["tiny"], api_key="k", limits=limits)
    meter = app.state.engine_loop.meter
    meter.record(100.0, 10, 0)  # a tenth of a prompt token a second
    meter.record(1.0, 0, 10)
    key = {"Authorization": "Bearer k"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}

    async def run() -> dict[str, httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                post = lambda **kw: c.post("/v1/completions", **kw)  # noqa: E731
                held = asyncio.create_task(post(json=body, headers=key))
                await until(lambda: gate.entered == 1, "the first request tokenizing")
                out = {"slow": await post(json=body, headers=key)}  # 2+ tokens: 20 s > 1 s
                meter.record(1.0, 10_000, 10)  # fast again: the queue is a moment's work
                out["model"] = await post(json={**body, "model": "other"}, headers=key)
                out["n"] = await post(json={**body, "n": 999}, headers=key)
                out["too_many"] = await post(json={**body, "n": 3}, headers=key)
                second = asyncio.create_task(post(json={**body, "n": 2}, headers=key))
                await until(lambda: app.state.engine_loop.admission.waiting_requests == 3, "3")
                out["full"] = await post(content=b"{not json", headers=key)
                out["nokey"] = await post(json=body)
                gate.open.set()
                out["held"], out["second"] = await held, await second
                return out

    out = asyncio.run(run())
    slow = out["slow"]
    assert slow.status_code == 429 and slow.json()["error"]["type"] == "queue_seconds"
    assert int(slow.headers["Retry-After"]) == 19  # 20 s ahead, 1 s allowed
    assert out["model"].status_code == 404 and out["n"].status_code == 400
    too_many = out["too_many"]  # 1 waits, 3 more would pass the limit of 3: refused at the route
    assert too_many.status_code == 429 and "1 requests wait" in too_many.json()["error"]["message"]
    full = out["full"]
    assert full.status_code == 429 and full.json()["error"]["type"] == "requests"
    assert out["nokey"].status_code == 401
    assert out["held"].status_code == out["second"].status_code == 200
    assert gate.entered == 2  # only the two admitted requests were ever tokenized
