"""The OpenAI-compatible server, end to end: a real ``python -m eeserve.server`` process on
127.0.0.1 with the tiny model, driven by the official ``openai`` client and raw ``httpx``.

Also: the engine loop in-process (drain on shutdown), the bad-input matrix, client disconnects,
64 concurrent streams, graceful shutdown and schema-driven fuzzing (schemathesis).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.live_server import Server, api_client

openai = pytest.importorskip("openai")

API_KEY = "test-key"
MAX_MODEL_LEN = 256
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital",
    "def add(a, b):",
    "Early exit lets",
    "One two three",
    "Berlin is",
    "The lazy dog",
    "four five six",
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = Server(tiny_model_dir, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN))
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()  # SIGTERM is tested below


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with api_client(server, API_KEY) as c:
        yield c


def _metrics(http: httpx.Client) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait_idle(http: httpx.Client, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        idle = m["eeserve_num_requests_running"] == 0 and m["eeserve_num_requests_waiting"] == 0
        if (idle and m["eeserve_kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return m


# -- happy paths ---------------------------------------------------------------------------------


def test_models_health_and_docs(server: Server, client: Any, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == [server.model]
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)


def test_completion_stream_equals_whole(server: Server, client: Any) -> None:
    args: dict[str, Any] = dict(model=server.model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    whole = client.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    ee = whole.model_extra["early_exit"]
    assert 1 <= ee["mean_exit_layer"] <= ee["num_layers"] == 4
    assert ee["layers_saved_fraction"] == pytest.approx(1 - ee["mean_exit_layer"] / 4)

    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].model_extra["early_exit"] == ee


def test_chat_stream_equals_whole(server: Server, client: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    args: dict[str, Any] = dict(model=server.model, messages=messages, temperature=0)
    whole = client.chat.completions.create(**args, max_completion_tokens=20)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(**args, max_tokens=20, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_prompt_forms_and_n(server: Server, client: Any, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = [list(AutoTokenizer.from_pretrained(tiny_model_dir)(p).input_ids) for p in PROMPTS[:2]]
    common: dict[str, Any] = dict(model=server.model, max_tokens=8, temperature=0)
    by_text = client.completions.create(prompt=PROMPTS[:2], **common)
    by_ids = client.completions.create(prompt=ids, **common)
    one_ids = client.completions.create(prompt=ids[1], **common)
    texts = [c.text for c in by_text.choices]
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == texts
    assert one_ids.choices[0].text == texts[1]
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])

    # n choices with a seed: choice i is what a single request with seed + i gives.
    sampled: dict[str, Any] = dict(model=server.model, prompt=PROMPTS[2], max_tokens=12)
    many = client.completions.create(n=3, seed=7, temperature=1.0, **sampled)
    assert len(many.choices) == 3
    for i in range(3):
        single = client.completions.create(seed=7 + i, temperature=1.0, **sampled)
        assert many.choices[i].text == single.choices[0].text


def test_logprobs_carry_exit_layers(server: Server, client: Any) -> None:
    c = client.completions.create(
        model=server.model, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    n = c.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.model_extra["exit_layers"]) == n
    assert all(1 <= x <= 4 for x in lp.model_extra["exit_layers"])
    assert all(v <= 0 for v in lp.token_logprobs)

    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [e for ch in chat if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]  # fmt: skip
    assert entries and all(len(e.top_logprobs) <= 3 for e in entries)
    assert all(1 <= e.model_extra["exit_layer"] <= 4 for e in entries)


def test_early_exit_field(server: Server, http: httpx.Client) -> None:
    body: dict[str, Any] = {
        "model": server.model,
        "prompt": "One",
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
    }
    means = {}
    for name, ee in (
        ("off", {"enabled": False}),
        ("first", {"threshold": 0.0, "measure": "softmax_margin", "min_layer": 1}),
        ("list", {"threshold": [0.5, 0.6, 0.7], "measure": "max_prob"}),
    ):
        r = http.post("/v1/completions", json={**body, "early_exit": ee})
        assert r.status_code == 200, r.text
        stats = r.json()["early_exit"]
        assert stats["layers_saved_fraction"] == pytest.approx(1 - stats["mean_exit_layer"] / 4)
        layers = r.json()["choices"][0]["logprobs"]["exit_layers"]
        assert sum(layers) / len(layers) == pytest.approx(stats["mean_exit_layer"])
        means[name] = stats["mean_exit_layer"]
    # Threshold 0 exits every decode token at the first exit layer (the prefill token is full).
    assert means["off"] == 4 and means["first"] < 4
    r = http.post("/v1/completions", json={**body, "early_exit": {"tolerance": 0.05}})
    if r.status_code != 200:  # the tiny model has no calibration to map a tolerance with
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("early_exit")


def test_speculative_early_exit_equals_full_depth(server: Server, http: httpx.Client) -> None:
    body: dict[str, Any] = {
        "model": server.model,
        "prompt": "The quick brown fox",
        "max_tokens": 10,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
    }
    before = _metrics(http)
    full = http.post("/v1/completions", json={**body, "early_exit": {"enabled": False}})
    ee = {"mode": "speculative", "num_draft_tokens": 3, "threshold": 0.0}
    spec = http.post("/v1/completions", json={**body, "early_exit": ee})
    assert full.status_code == spec.status_code == 200, spec.text
    assert spec.json()["choices"][0]["text"] == full.json()["choices"][0]["text"]
    stats = spec.json()["early_exit"]
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["mean_draft_length"] > 0
    after = _wait_idle(http)
    drafted = after["eeserve_spec_draft_tokens_total"] - before["eeserve_spec_draft_tokens_total"]
    accepted = (
        after["eeserve_spec_accepted_tokens_total"] - before["eeserve_spec_accepted_tokens_total"]
    )
    assert drafted > 0 and 0 <= accepted <= drafted


def test_bench_serve_runs_do_not_share_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (mode, rate) run sends the same prompts behind a first line of its own, so no run is
    served from another run's prefix cache."""
    from eeserve.bench import serve as bs

    sent: list[list[str]] = []

    async def fake_run(client: Any, bodies: list[dict[str, Any]], rate: float, seed: int) -> Any:
        sent.append([b["prompt"] for b in bodies])
        return {}

    async def fake_one(*args: Any) -> None:
        return None

    monkeypatch.setattr(bs, "_run_rate", fake_run)
    monkeypatch.setattr(bs, "one_request", fake_one)
    bs.bench_serve("http://127.0.0.1:9", "m", PROMPTS[:3], [1.0, math.inf])
    assert len(sent) == 4
    firsts = [{p.split("\n", 1)[0] for p in run} for run in sent]
    assert all(len(f) == 1 for f in firsts) and len(set.union(*firsts)) == 4
    assert all([p.split("\n", 1)[1] for p in run] == PROMPTS[:3] for run in sent)


def test_arrival_scenario_streams_run_at_full_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The long-prompt scenario measures scheduling: every request it sends asks for full depth
    (the model's default mode may be speculative, whose streams arrive in bursts)."""
    from eeserve.bench import arrivals as ar
    from eeserve.bench.serve import RequestResult

    sent: list[dict[str, Any]] = []

    async def fake_one(client: Any, body: dict[str, Any], start: float) -> RequestResult:
        sent.append(body)
        return RequestResult(True, ttft=0.01, itls=[0.01])

    monkeypatch.setattr(ar, "one_request", fake_one)
    row = ar.arrivals_async(
        "http://127.0.0.1:9", "m", PROMPTS[:2], ["long"],
        stream_tokens=4, long_tokens=2, period=0.0, first_after=0.0,
    )  # fmt: skip
    asyncio.run(row)
    assert len(sent) == 4 and all(b["early_exit"] == {"enabled": False} for b in sent)


@pytest.mark.slow
def test_bench_serve_smoke(server: Server) -> None:
    from eeserve.bench.serve import bench_serve, exit_modes, format_table

    rows = bench_serve(
        server.base,
        server.model,
        PROMPTS[:4],
        [50.0, math.inf],
        max_tokens=4,
        modes=exit_modes(0.0, "softmax_margin"),
        api_key=API_KEY,
    )
    assert [(r["mode"], r["rate"]) for r in rows] == [
        ("full_depth", 50.0),
        ("full_depth", math.inf),
        ("early_exit", 50.0),
        ("early_exit", math.inf),
    ]
    for r in rows:
        assert r["errors"] == 0 and r["completion_tokens"] == 16, r
        assert r["ttft_ms"]["p50"] > 0 and r["output_tokens_per_s"] > 0
    assert rows[0]["mean_exit_layer"] == 4 and rows[2]["mean_exit_layer"] < 4
    assert "early_exit" in format_table(rows)


@pytest.mark.slow
def test_long_prompt_arrival_scenario_smoke(server: Server) -> None:
    from eeserve.bench.arrivals import arrivals_async, format_arrivals, long_prompt_texts

    longs = long_prompt_texts(2, 300, seed=0)
    assert len(longs) == 2 and longs[0] != longs[1] and all(len(t) == 300 for t in longs)
    row = asyncio.run(
        arrivals_async(
            server.base,
            server.model,
            PROMPTS[:2],
            longs,
            stream_tokens=12,
            long_tokens=2,
            period=0.05,
            first_after=0.05,
            api_key=API_KEY,
        )
    )
    assert row["errors"] == 0, row
    gaps = row["stream_itl_ms"]
    assert 0 < gaps["p50"] <= gaps["p99"] <= gaps["max"]
    assert all(n > 50 for n in row["long_prompt_tokens"])
    assert "stream gap" in format_arrivals([{"mode": "chunked", **row}])


# -- hard edges ----------------------------------------------------------------------------------

_BASE = {"model": None, "prompt": "Hello", "max_tokens": 4}
_CHAT = {"model": None, "messages": [{"role": "user", "content": "Hi"}]}
BAD = [
    # (endpoint, body changes, param named in the error)
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"model": None}, "model"),
    ("chat/completions", {"messages": None}, "messages"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"max_tokens": 1.5}, "max_tokens"),
    ("completions", {"max_tokens": "4"}, "max_tokens"),
    ("completions", {"n": True}, "n"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"stop": 3}, "stop"),
    ("chat/completions", {"messages": "Hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": []}, "messages"),
    ("completions", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"temperature": -0.1}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("completions", {"early_exit": {"measure": "vibes"}}, "early_exit.measure"),
    ("completions", {"early_exit": {"min_layer": 0}}, "early_exit.min_layer"),
    ("completions", {"early_exit": {"min_layer": 9}}, "early_exit.min_layer"),
    ("completions", {"early_exit": {"threshold": 0.5, "tolerance": 0.1}}, "early_exit"),
    ("completions", {"early_exit": {"threshold": 5}}, "early_exit.threshold"),
    ("completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"seed": 2**70}, "seed"),
    ("completions", {"model": 5}, "model"),
    ("completions", {"early_exit": {"mode": "draft"}}, "early_exit.mode"),
    ("completions", {"early_exit": {"num_draft_tokens": 0}}, "early_exit.num_draft_tokens"),
    # Text a tokenizer cannot encode (a lone UTF-16 surrogate): was a 500 / the tokenizer's error.
    ("completions", {"prompt": "ab\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        "messages.0.content",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "messages.0.content",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        "messages.0.name",
    ),
    ("completions", {"stop": ["\ud800"]}, "stop"),
    ("completions", {"model": "\ud800"}, "model"),
    ("completions", {"user": "\udc00"}, "user"),
]


@pytest.mark.parametrize(("endpoint", "change", "param"), BAD)
def test_bad_input_is_400_naming_the_field(
    server: Server, http: httpx.Client, endpoint: str, change: dict[str, Any], param: str
) -> None:
    body = {**(_CHAT if endpoint.startswith("chat") else _BASE), "model": server.model}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    # json.dumps escapes a lone surrogate as JSON allows ("\\ud800"); httpx's json= cannot send it.
    headers = {"Content-Type": "application/json"}
    r = http.post(f"/v1/{endpoint}", content=json.dumps(body), headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split(".")[-1] in err["message"] or param == "prompt"


def test_malformed_json_and_unknown_fields(server: Server, http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    r = http.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    r = http.post("/v1/completions", content=b"[1, 2]", headers=headers)
    assert r.status_code == 400 and "error" in r.json()
    body = {**_BASE, "model": server.model, "frequency_penalty": 0.5, "whatever": {"a": 1}}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_prompt_longer_than_context(server: Server, http: httpx.Client) -> None:
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 60
    r = http.post("/v1/completions", json={**_BASE, "model": server.model, "prompt": long_prompt})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in err["message"] and re.search(r"\(\d+ tokens\)", err["message"])
    body = {**_CHAT, "model": server.model, "max_tokens": MAX_MODEL_LEN}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_model_is_404(server: Server, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_api_key(server: Server) -> None:
    for path in ("/v1/models", "/metrics", "/docs", "/openapi.json"):
        assert httpx.get(server.base + path).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        r = httpx.get(server.base + path, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.base}/v1/completions", json={**_BASE, "model": server.model})
    assert r.status_code == 401
    assert httpx.get(f"{server.base}/health").status_code == 200
    bad_client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.chat.completions.create(model=server.model, messages=[])


def test_disconnect_aborts_and_frees_blocks(server: Server, http: httpx.Client) -> None:
    before = _wait_idle(http)
    aborted = 'eeserve_requests_total{endpoint="/v1/completions",status="aborted"}'
    n, max_tokens = 4, MAX_MODEL_LEN - 8
    body = {"model": server.model, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "n": n, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert _metrics(http)["eeserve_kv_blocks_used"] > 0
    # A whole-response request whose client gives up waiting is aborted as well (50 ms: the
    # 4 x 248 tokens take ~250 steps, each well over 0.2 ms).
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "n": n}, timeout=0.05)
    after = _wait_idle(http)
    assert after["eeserve_kv_blocks_used"] == 0
    assert after["eeserve_num_requests_running"] == 0
    assert after[aborted] == before[aborted] + 2
    generated = after["eeserve_generation_tokens_total"] - before["eeserve_generation_tokens_total"]
    assert generated < 2 * n * max_tokens


@pytest.mark.slow
def test_64_concurrent_streams(server: Server, http: httpx.Client) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> tuple[list[str], list[str]]:
        alone = [await one(p) for p in PROMPTS]
        together = await asyncio.wait_for(
            asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(64))), 90
        )
        await aclient.close()
        return alone, list(together)

    start = time.monotonic()
    alone, together = asyncio.run(run())
    assert time.monotonic() - start < 90
    assert together == [alone[i % len(PROMPTS)] for i in range(64)]
    m = _wait_idle(http)
    assert m["eeserve_kv_blocks_used"] == 0
    assert m['eeserve_requests_total{endpoint="/v1/completions",status="error"}'] == 0


@pytest.mark.slow
def test_graceful_shutdown(tiny_model_dir: Path) -> None:
    """SIGTERM: a short in-flight stream finishes, one longer than the grace period gets an
    error event, new connections are refused, and the process exits 0."""
    srv = Server(tiny_model_dir, "--shutdown-timeout", "1")
    body = {"model": srv.model, "prompt": "x", "ignore_eos": True, "stream": True}
    try:
        with ExitStack() as stack:
            streams = []
            for max_tokens in (480, 24):
                c = stack.enter_context(httpx.Client(base_url=srv.base, timeout=30))
                r = stack.enter_context(
                    c.stream("POST", "/v1/completions", json={**body, "max_tokens": max_tokens})
                )
                events = r.iter_lines()
                assert next(e for e in events if e.startswith("data: ")).startswith("data: {")
                streams.append(events)
            srv.proc.send_signal(signal.SIGTERM)
            long, short = ([e[6:] for e in ev if e.startswith("data: ")] for ev in streams)
        assert short[-1] == long[-1] == "[DONE]"
        assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        last = json.loads(long[-2])
        assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
        assert srv.proc.wait(30) == 0, srv.output()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.base}/health")
    finally:
        srv.stop()


# -- in-process: the engine loop ----------------------------------------------------------------


def test_build_engine_loads_off_the_calling_thread_and_raises_its_errors(
    tiny_model_dir: Path,
) -> None:
    import threading

    from eeserve.config import EngineConfig
    from eeserve.engine import llm_engine
    from eeserve.sampling_params import SamplingParams
    from eeserve.server.startup import build_engine

    threads: list[str] = []
    real = llm_engine.LLMEngine.__init__

    def spy(self: Any, config: EngineConfig) -> None:
        threads.append(threading.current_thread().name)
        real(self, config)

    llm_engine.LLMEngine.__init__ = spy  # type: ignore[method-assign]
    try:
        engine = build_engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4_000_000))
        with pytest.raises(ValueError, match="not found"):
            build_engine(EngineConfig(model=str(tiny_model_dir / "missing")))
    finally:
        llm_engine.LLMEngine.__init__ = real  # type: ignore[method-assign]
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    assert engine.step()[0].outputs[0].token_ids
    assert len(threads) == 2 and threading.current_thread().name not in threads
    assert not any(t.name.startswith("eeserve-load") for t in threading.enumerate())


def test_engine_loop_drain_fails_running_requests(tiny_model_dir: Path) -> None:
    from eeserve.config import EngineConfig
    from eeserve.engine.llm_engine import LLMEngine
    from eeserve.sampling_params import SamplingParams
    from eeserve.server.engine_loop import EngineLoop, ShuttingDown
    from eeserve.server.engine_requests import ChoiceSpec
    from eeserve.server.generation import GenerationError
    from eeserve.server.metrics import ServerMetrics

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4_000_000))
    loop = EngineLoop(engine, ServerMetrics(engine.model_config.num_layers))
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def run() -> None:
        loop.start(asyncio.get_running_loop())
        gen = await loop.add([ChoiceSpec(None, [1, 2, 3], params)], None)
        seen = 0
        with pytest.raises(GenerationError) as e:
            async for _ in gen.stream():
                seen += 1
                if seen == 2:
                    loop.begin_drain(0)
        assert e.value.status == 503 and seen < 400
        with pytest.raises(ShuttingDown):
            await loop.add([ChoiceSpec(None, [1, 2, 3], params)], None)
        loop.stop()

    asyncio.run(run())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


# -- fuzzing from the OpenAPI schema -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_no_server_errors(server: Server, mode: str) -> None:
    """Requests generated from /openapi.json (valid ones, then invalid ones): never a 5xx."""
    from hypothesis import given
    from hypothesis import strategies as st

    schemathesis = pytest.importorskip("schemathesis")

    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json", headers=auth)
    ops = [r.ok() for r in schema.get_all_operations()]
    if mode == "negative":  # only operations with a body have something to break
        ops = [op for op in ops if op.get_request_payload_content_types()]
    strategy = st.one_of(
        [op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)) for op in ops]
    )

    @given(case=strategy)
    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    def check(case: Any) -> None:
        if isinstance(case.body, dict):
            _bound_generation(case.body)
            if mode == "positive":  # mostly a served model, so that requests reach the engine
                case.body["model"] = server.model
        response = case.call(headers=auth, timeout=60)
        assert response.status_code < 500, (case.body, response.text)

    check()


def _bound_generation(body: dict[str, Any]) -> None:
    """Keep valid requests short (bounded runtime); invalid values are left as generated."""
    for key, limit in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 2)):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > limit:
            body[key] = limit
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 8
    for key in ("prompt", "messages"):
        if isinstance(body.get(key), list) and len(body[key]) > 4:
            body[key] = body[key][:4]
    t = body.get("request_timeout")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 60:
        body["request_timeout"] = 60.0  # a valid time limit that a short request meets (no 504)
