"""The engine core in a process of its own (``EngineHost.PROCESS``, ``eeserve serve``'s
default), on the tiny model: the engine loop's contract as with the thread host (outputs,
errors, aborts, deadlines, drains), what the engine process holds freed, and a dead engine
process answered as a stopped server. The live-server tests (``test_server.py``) run the same
default through ``python -m eeserve.server``."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.sampling_params import SamplingParams
from eeserve.server.admission import ServingLimits
from eeserve.server.app import create_app
from eeserve.server.engine_core import EngineHost
from eeserve.server.engine_loop import EngineLoop, ShuttingDown
from eeserve.server.engine_requests import ChoiceSpec, RequestRejected
from eeserve.server.generation import DeadlineExceeded, GenerationError
from eeserve.server.metrics import ServerMetrics

KV_BYTES = 4_000_000
LONG = 400  # tokens: hundreds of engine steps


def _engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=KV_BYTES))


def _run(
    engine: LLMEngine, host: EngineHost, body: Callable[[EngineLoop], Awaitable[None]]
) -> None:
    loop = EngineLoop(engine, ServerMetrics(engine.model_config.num_layers), host=host)

    async def run() -> None:
        loop.start(asyncio.get_running_loop())
        try:
            await body(loop)
        finally:
            loop.stop()

    asyncio.run(run())
    assert loop.stopped


def _kv_used(loop: EngineLoop) -> float:
    return loop.metrics.kv_blocks_used._value.get()


def test_outputs_equal_the_thread_hosts(tiny_model_dir: Path) -> None:
    """Greedy outputs, prompt ids and the metrics' counts are the same in either host."""
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seen: dict[EngineHost, list[tuple[list[int], list[list[int]], float]]] = {}

    for host in EngineHost:

        async def body(loop: EngineLoop, host: EngineHost = host) -> None:
            got = []
            for prompt in ([1, 2, 3], [5, 6, 7, 8, 9]):
                gen = await loop.add([ChoiceSpec(None, prompt, params)] * 2, None)
                outs = [out async for _, out in gen.stream()]
                assert outs[-1].prompt_token_ids == prompt
                tokens = loop.metrics.generation_tokens._value.get()
                got.append((outs[-1].outputs[0].token_ids, gen.prompt_token_ids, tokens))
            seen[host] = got
            assert _kv_used(loop) == 0

        _run(engine, host, body)
    assert seen[EngineHost.PROCESS] == seen[EngineHost.THREAD]


def test_engine_refusals_cross_the_process(tiny_model_dir: Path) -> None:
    """The engine's refusals reach the caller as they are raised, and hold nothing."""
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_tokens=4, temperature=0)
    too_long = list(range(1, engine.max_model_len + 4))

    async def body(loop: EngineLoop) -> None:
        with pytest.raises(ValueError):
            await loop.add([ChoiceSpec(None, too_long, params)], None)
        gen = await loop.add([ChoiceSpec(None, [1, 2], params)], None)
        assert [out async for _, out in gen.stream()][-1].finished
        assert loop.admission.waiting_requests == loop.admission.running_requests == 0
        assert _kv_used(loop) == 0

    _run(engine, EngineHost.PROCESS, body)


def test_a_refusal_naming_its_field_pickles_as_it_is() -> None:
    """What an engine process sends back of ``RequestRejected``: its message and its field."""
    e = pickle.loads(pickle.dumps(RequestRejected("no such exit layer", "early_exit")))
    assert isinstance(e, RequestRejected) and e.param == "early_exit"
    assert str(e) == "no such exit layer"


def test_abort_deadline_and_drain_free_the_engine_process(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)

    async def body(loop: EngineLoop) -> None:
        gen = await loop.add([ChoiceSpec(None, [1, 2, 3], params)] * 2, None)
        async for _ in gen.stream():
            assert _kv_used(loop) > 0
            gen.cancel()  # the client went away
        late = await loop.add([ChoiceSpec(None, [4, 5], params)], None, timeout=0.01)
        with pytest.raises(DeadlineExceeded):
            _ = [out async for _, out in late.stream()]
        running = await loop.add([ChoiceSpec(None, [6, 7], params)], None)
        with pytest.raises(GenerationError) as e:
            async for _ in running.stream():
                loop.begin_drain(0)
        assert e.value.status == 503
        with pytest.raises(ShuttingDown):
            await loop.add([ChoiceSpec(None, [1], params)], None)
        await _until(lambda: _kv_used(loop) == 0)
        assert loop.admission.waiting_requests == loop.admission.running_requests == 0

    _run(engine, EngineHost.PROCESS, body)


def test_a_dead_engine_process_ends_what_it_held(tiny_model_dir: Path) -> None:
    """Killed under a running request: its stream ends with a 503, new work is refused, and the
    server says so on /health."""
    engine = _engine(tiny_model_dir)
    app = create_app(engine, limits=ServingLimits(engine_host=EngineHost.PROCESS))
    model = str(tiny_model_dir)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": LONG, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            pid = app.state.engine_loop.engine_process_id
            assert pid is not None and pid != os.getpid()
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert any('"code":"503"' in line or "engine process" in line for line in rest)
        assert "data: [DONE]" in rest[-2:]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503


async def _until(ok: Callable[[], bool], timeout: float = 30.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not ok():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.01)
