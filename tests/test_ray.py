"""Scale-out on Ray: engine replicas behind one endpoint (Ray Serve) and batch files over a pool
of engine actors (Ray Data). One local Ray session (2 CPUs) is shared by the module's tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eeserve.sampling_params import SamplingParams
from eeserve.server.admission import ServingLimits
from eeserve.server.ingress import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from eeserve.server.replicas import APP_NAME, ReplicaOptions, launch_replicas, stop_replicas
from tests.batch_files import read_output, request_line, run_cli, stable, write_batch
from tests.tiny_model import make_llm

# Ray and Ray Serve start processes and a cluster: the slow tests (make test runs them).
pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
API_KEY = "ray-key"
KV_BYTES = 8_000_000
PROMPTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "One two three"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", autouse=True)
def _ray_installed() -> None:
    """Ray is imported when these tests run, not when the file is collected: importing Ray Serve
    takes seconds that a run deselecting them (``make test-fast``) would spend for nothing."""
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray
    from ray import serve

    # The Serve proxy runs the ingress gate, as in a cluster `eeserve serve --replicas` starts.
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    try:
        ray.init(num_cpus=2, include_dashboard=False, namespace="eeserve", log_to_driver=False)
    finally:
        del os.environ[PROXY_CALLBACK_ENV]
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(ray_session: None, tiny_model_dir: Path) -> Iterator[str]:
    opts = ReplicaOptions(
        engine={"model": str(tiny_model_dir), "kv_cache_memory": KV_BYTES},
        model_names=["tiny"],
        api_key=API_KEY,
        replicas=2,
        threads=1,
        shutdown_timeout=5,
        # Room for the killed-replica test's 4 x 501-token requests, however Ray routes them.
        limits=ServingLimits(max_queued_tokens=10**6),
    )
    port = _free_port()
    deployed = launch_replicas(opts, HOST, port)
    yield f"http://{HOST}:{port}"
    stop_replicas(deployed)


# -- batch files over Ray Data (first: the replicas below hold both CPUs once started) --------


def test_batch_on_ray_writes_the_single_process_output(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    bad_body = json.dumps({**request_line(20, "x"), "body": {"model": "x", "prompt": 5}})
    write_batch(src, str(tiny_model_dir), 50, {7: '{"custom_id": "req-6", "body": ', 21: bad_body})
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert run_cli(src, local, tiny_model_dir) == 1
    assert run_cli(src, on_ray, tiny_model_dir, "--ray", "--replicas", "2") == 1
    got, want = read_output(on_ray), read_output(local)
    assert len(got) == 50 and sum(o["error"] is not None for o in got) == 2

    def key(o: dict[str, Any]) -> tuple[str, int]:
        return (o["custom_id"] or "", (o["error"] or {}).get("line", 0))

    assert [stable(o) for o in sorted(got, key=key)] == [stable(o) for o in sorted(want, key=key)]


# -- replicas behind one endpoint (Ray Serve) -----------------------------------------------------


def _client(base: str, **kw: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=120, **kw)


def _completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def _metrics(base: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]  # fmt: skip


def _replica_pids(base: str) -> dict[str, int]:
    return {
        labels["replica"]: int(labels["pid"])
        for name, labels, _ in _metrics(base)
        if name == "eeserve_replica_info"
    }


def test_two_replicas_answer_like_one_engine(replicas: str, tiny_model_dir: Path) -> None:
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]

    async def run() -> list[httpx.Response]:
        async with _client(replicas) as c:
            return list(
                await asyncio.gather(
                    *(c.post("/v1/completions", json=_completion(p, 12)) for p in prompts)
                )
            )

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    llm = make_llm(tiny_model_dir, kv_cache_memory=KV_BYTES)
    single = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == [o.outputs[0].text for o in single]
    assert all(r.json()["early_exit"]["num_layers"] == 4 for r in responses)

    # The same app: auth, validation and streaming behave as in the single-process server.
    assert httpx.post(f"{replicas}/v1/completions", json=_completion("x", 2)).status_code == 401
    bad = httpx.post(
        f"{replicas}/v1/completions",
        json=_completion("x", 0),
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    with httpx.stream(
        "POST",
        f"{replicas}/v1/completions",
        json=_completion(prompts[0], 12, stream=True),
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == texts[0]

    # /metrics names both replicas, and both served some of the 16 (pages are pushed each second).
    deadline = time.monotonic() + 15
    while True:
        served: dict[str, float] = {}
        for name, labels, value in _metrics(replicas):
            if name == "eeserve_requests_total" and labels["status"] == "success":
                served[labels["replica"]] = served.get(labels["replica"], 0) + value
        if sum(served.values()) == 17 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(_replica_pids(replicas)) == 2
    assert len(served) == 2 and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 17


def _victim_running(base: str, victim: str) -> bool:
    return any(
        v > 0
        for n, labels, v in _metrics(base)
        if n == "eeserve_num_requests_running" and labels["replica"] == victim
    )


def test_killed_replica_fails_its_requests_then_recovers(replicas: str) -> None:
    pids = _replica_pids(replicas)
    victim, victim_pid = sorted(pids.items())[0]
    # 16 x 4 x 500 tokens: seconds of work a replica, so the metrics page (at most 1 s old)
    # shows the victim busy while it is. A round that ends before the page shows it kills
    # nothing and is sent again.
    body = _completion("x", 500, ignore_eos=True, n=4)

    async def round_() -> tuple[bool, list[int | str]]:
        async with _client(replicas) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(16)]
            killed = False
            while not killed and not all(t.done() for t in tasks):
                if await asyncio.to_thread(_victim_running, replicas, victim):
                    os.kill(victim_pid, signal.SIGKILL)
                    killed = True
                await asyncio.sleep(0.1)
            done = await asyncio.gather(*tasks, return_exceptions=True)
        return killed, [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in done]

    for _ in range(5):
        killed, statuses = asyncio.run(round_())
        if killed:
            break
    assert killed, "the victim replica was never seen running a request"
    failed = [s for s in statuses if s != 200]
    assert failed and all(isinstance(s, int) and s >= 500 for s in failed), statuses

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray Serve replaces the dead replica
        now = _replica_pids(replicas)
        if len(now) == 2 and victim_pid not in now.values():
            break
        time.sleep(1)
    else:
        raise AssertionError(f"no replacement replica: {_replica_pids(replicas)}")

    async def later() -> list[int]:
        async with _client(replicas) as c:
            rs = await asyncio.gather(
                *(c.post("/v1/completions", json=_completion(p, 4)) for p in PROMPTS * 2)
            )
        return [r.status_code for r in rs]

    assert asyncio.run(later()) == [200] * 8


def _rejected(base: str) -> tuple[float, float]:
    """429s so far: the replicas' admission control's, and the ingress gate's."""
    samples = _metrics(base)
    replicas = sum(v for n, _, v in samples if n == "eeserve_admission_rejected_total")
    return replicas, sum(v for n, _, v in samples if n == "eeserve_ingress_rejected_total")


def test_admission_limits_apply_through_replicas(replicas: str, tiny_model_dir: Path) -> None:
    """Replicas of one running slot and one waiting request each: a burst beyond that is
    answered 429 with Retry-After and the OpenAI body, by the ingress gate in Ray's proxy from
    the replicas' published room or by the replicas themselves (Ray's own queue limit lies above
    theirs), counted in /metrics; /health is answered while the replicas are busy; every
    replica applies the queue bound in seconds; a request's time limit ends it with 504."""
    from ray import serve

    serve.delete(APP_NAME)  # the module's deployment holds both CPUs
    opts = ReplicaOptions(
        engine={"model": str(tiny_model_dir), "kv_cache_memory": KV_BYTES, "max_num_seqs": 1},
        model_names=["tiny"],
        api_key=API_KEY,
        replicas=2,
        threads=1,
        shutdown_timeout=5,
        limits=ServingLimits(max_waiting_requests=1, max_queue_seconds=7.5),
    )
    deployed = launch_replicas(opts, HOST, int(replicas.rsplit(":", 1)[1]))
    try:
        body = _completion("x", 400, ignore_eos=True)
        before = _rejected(replicas)

        async def burst() -> tuple[list[httpx.Response], int]:
            async with _client(replicas) as c:
                sent = [
                    asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(12)
                ]
                while not any(t.done() for t in sent):
                    await asyncio.sleep(0.01)
                health = (await c.get("/health")).status_code  # while the replicas are busy
                return list(await asyncio.gather(*sent)), health

        responses, health = asyncio.run(burst())
        assert health == 200
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 429}, statuses
        # At most a running and a waiting request per replica while the first ones run (at
        # least one: the gate admits by the least-roomy replica's published room, which the
        # bound in seconds can make 0 for a replica whose measured rate a loaded machine slowed).
        assert 1 <= statuses.count(200) <= 4, statuses
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
        deadline = time.monotonic() + 15
        while True:  # replicas push their pages every second
            after = _rejected(replicas)
            rejected = sum(after) - sum(before)
            if rejected == statuses.count(429) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert rejected == statuses.count(429)
        assert after[1] > before[1]  # the proxy ran the gate: part of the burst reached no replica
        limits: dict[str, dict[str, float]] = {}
        for n, labels, v in _metrics(replicas):
            if n == "eeserve_admission_limit":
                limits.setdefault(labels["replica"], {})[labels["limit"]] = v
        # This deployment's replicas (the module's, just deleted, may still show for a while):
        # each applies the bound in seconds to its own queue.
        ours = [lim for lim in limits.values() if lim["waiting_requests"] == 1]
        assert [lim["queue_seconds"] for lim in ours] == [7.5, 7.5], limits

        timed = httpx.post(
            f"{replicas}/v1/completions",
            json={**body, "request_timeout": 0.001},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )
        assert timed.status_code == 504 and timed.json()["error"]["code"] == "deadline_exceeded"
    finally:
        stop_replicas(deployed)
