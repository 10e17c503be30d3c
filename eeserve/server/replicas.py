"""``eeserve serve MODEL --replicas N``: N engine replicas behind one OpenAI endpoint, on Ray Serve.

Contract: ``run_replicas(args)`` connects to the Ray cluster at ``--ray-address`` (or starts one
on this machine), deploys ``EngineReplica`` as a Ray Serve deployment of ``--replicas`` replicas,
each its own process with ``--threads-per-replica`` CPUs (torch threads), its own engine and the
single-process server's app (``create_app``: the same routes, validation, auth, streaming and
early-exit fields; its startup heap frozen out of the garbage collector, as the single process
does), serves it on ``--host:--port`` through Ray Serve's proxy, which routes each
request to a replica, and blocks until SIGINT/SIGTERM. Ray Serve health-checks replicas (an
engine thread that stopped fails the check) and restarts any that die; requests in flight on a
dead replica end with a 5xx. Replicas log at ``--log-level``, a line per request only at
``debug`` (``replica_logging``). ``/metrics`` shows every live replica's metrics, labelled
``replica``, plus ``eeserve_replica_info{replica, pid}``. On a signal the app is deleted, which
lets in-flight requests finish for up to ``--shutdown-timeout`` seconds, and a cluster started
here is shut down. ``launch_replicas`` deploys on an already connected Ray (tests, scripts).
Overload: every replica applies ``ReplicaOptions.limits`` to its own engine (admission control
answers 429 with ``Retry-After`` and an OpenAI error body, as the single process does; the queue
bound in seconds is the replica's own queue at the replica's own measured throughput), and Ray
Serve's per-replica limits are set from the same numbers (``ray_limits``): a replica is sent at
most its running batch, its waiting requests and ``ONGOING_HEADROOM`` more at once (room for the
quick 429s), so that the replica's own check, not Ray, decides; when every replica is at that
limit, Ray's proxy queues up to ``max_queued_requests`` more and answers the rest itself with 429
and ``Retry-After: 1`` (a plain-text body). In front of that, each replica publishes its
admission state (``replica_state``) to the hub every ``ingress.PUBLISH_S`` seconds, and the
ingress gate in Ray's proxy (``server.ingress``, installed by the variable ``init_ray`` sets)
refuses from it and answers ``/health`` without routing to a replica.
Ray is imported only here, lazily: without ``--replicas`` nothing imports it; without the
``ray`` extra a Ray option is a ``ValueError`` naming the extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp

from eeserve.config import EngineConfig
from eeserve.engine_args import engine_config
from eeserve.server.admission import ServingLimits
from eeserve.server.app import create_app
from eeserve.server.engine_loop import EngineLoop
from eeserve.server.ingress import (
    HUB_NAME,
    NAMESPACE,
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    PUBLISH_S,
    ReplicaState,
    key_digest,
)
from eeserve.server.metrics import ServerMetrics
from eeserve.server.refusal import limit_type
from eeserve.server.replica_metrics import MetricsHub, merge_pages
from eeserve.server.startup import build_engine, freeze_startup_heap

log = logging.getLogger(__name__)

APP_NAME = "eeserve"
# Ray runs its workers at niceness 15 by default: replicas and batch actors would then get no CPU
# while anything else runs. A cluster started here runs them at normal priority, like the
# single-process server (for an existing cluster: `RAY_worker_niceness=0 ray start ...`).
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}
_PUSH_INTERVAL_S = 1.0
ONGOING_HEADROOM = 16


def import_ray(*subpackages: str) -> Any:
    """``ray`` with ``ray.<subpackage>`` loaded, or a ``ValueError`` that says how to install it."""
    try:
        ray = importlib.import_module("ray")
        for name in subpackages:
            importlib.import_module(f"ray.{name}")
    except ImportError as e:
        raise ValueError(
            f"Ray options need the `ray` extra ({e}): pip install 'eeserve[ray]'"
        ) from None
    return ray


def init_ray(ray: Any, address: str | None) -> None:
    """Connect to the cluster at ``address``, or start a local one whose workers run at normal
    priority (``LOCAL_SYSTEM_CONFIG``) and whose Serve proxy runs the ingress gate
    (``server.ingress``; the proxy inherits the variable from this process)."""
    if address is None:
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray.init(
        address=address,
        namespace=NAMESPACE,
        include_dashboard=False,
        _system_config=LOCAL_SYSTEM_CONFIG if address is None else None,
    )


@dataclass
class ReplicaOptions:
    engine: dict[str, Any]  # EngineConfig fields (plain data: it travels to every replica)
    model_names: list[str]
    api_key: str | None = None
    replicas: int = 2
    threads: int = 1
    shutdown_timeout: float = 30.0
    limits: ServingLimits = dataclasses.field(default_factory=ServingLimits)
    log_level: str = "info"  # the replicas' logging; a line per request only at "debug"


class EngineReplica:
    """One replica: its own process, torch threads, engine, and the single-process app."""

    def __init__(self, opts: ReplicaOptions) -> None:
        ray = import_ray("serve")
        torch.set_num_threads(opts.threads)
        engine = build_engine(EngineConfig(**opts.engine))
        self._replica = ray.serve.get_replica_context().replica_id.unique_id
        self._hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
        self._asgi = create_app(
            engine,
            model_names=opts.model_names,
            api_key=opts.api_key,
            metrics_view=self._metrics_view,
            limits=opts.limits,
        )
        self._metrics: ServerMetrics = self._asgi.state.ctx.metrics
        self._key_digest = key_digest(opts.api_key)
        # Daemon: it ends with the replica's process.
        threading.Thread(target=self._push_loop, name="eeserve-metrics", daemon=True).start()
        freeze_startup_heap()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self._asgi

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine thread stopped is replaced."""
        if self._asgi.state.engine_loop.stopped:
            raise RuntimeError("the engine thread has stopped")

    def _push(self) -> Any:
        text = self._metrics.render()[0].decode()
        return self._hub.put.remote(self._replica, os.getpid(), text)

    def _push_loop(self) -> None:
        """The replica's state for the ingress gate every ``PUBLISH_S``, its metrics page every
        ``_PUSH_INTERVAL_S`` (fire and forget: a hub that lags delays neither)."""
        next_page = 0.0
        while True:
            try:
                state = replica_state(self._replica, self._asgi.state.engine_loop)
                self._hub.put_state.remote(dataclasses.replace(state, key_digest=self._key_digest))
                if time.monotonic() >= next_page:
                    next_page = time.monotonic() + _PUSH_INTERVAL_S
                    self._push()
            except Exception:  # the hub may be gone while the app shuts down
                log.debug("metrics push failed", exc_info=True)
            time.sleep(PUBLISH_S)

    async def _metrics_view(self, metrics: ServerMetrics) -> tuple[bytes, str]:
        await self._push()  # this replica's page is current; the others are at most 1 s old
        pages = await self._hub.pages.remote()
        refused = await self._hub.ingress_refused.remote()
        return merge_pages(pages, refused), CONTENT_TYPE_LATEST


def replica_state(replica: str, loop: EngineLoop) -> ReplicaState:
    """What the ingress gate decides from (``ingress.ReplicaState``; no key digest). Read off the
    event loop's thread, as the metrics page is: a moment's inconsistency between the counts
    only moves an estimate that the next state, ``PUBLISH_S`` later, corrects."""
    adm = loop.admission
    refusal = adm.refusal_for_any()
    return ReplicaState(
        replica=replica,
        serving=loop.alive and not loop.draining,
        held=adm.waiting_requests + adm.running_requests,
        room=0 if refusal is not None else adm.room(),
        limit=limit_type(refusal.limit) if refusal is not None else "requests",
        retry_after=refusal.retry_after if refusal is not None else 1,
    )


@dataclass
class Deployed:
    """Handles of a running deployment (the hub lives as long as this handle)."""

    app: Any
    hub: Any


def launch_replicas(opts: ReplicaOptions, host: str, port: int) -> Deployed:
    """Deploy on the connected Ray cluster and wait until every replica is healthy."""
    ray = import_ray("serve")
    serve = ray.serve
    need = opts.replicas * opts.threads
    have = ray.cluster_resources().get("CPU", 0)
    if have < need:
        raise ValueError(
            f"{opts.replicas} replicas x {opts.threads} threads need {need} CPUs; "
            f"the Ray cluster has {have:g}"
        )
    hub = (
        ray.remote(num_cpus=0)(MetricsHub)
        .options(name=HUB_NAME, namespace=NAMESPACE, get_if_exists=True)
        .remote()
    )
    ray.get(hub.pages.remote())  # registered under its name before any replica looks it up
    serve.start(http_options={"host": host, "port": port})
    limits = ray_limits(opts)
    if "backpressure_config" not in inspect.signature(serve.deployment).parameters:
        del limits["backpressure_config"]  # an older Ray Serve: its own overflow answers 503
    deployment = serve.deployment(serve.ingress()(EngineReplica)).options(
        name="EngineReplica",
        num_replicas=opts.replicas,
        ray_actor_options={"num_cpus": opts.threads},
        **limits,
        logging_config=replica_logging(opts.log_level),
        health_check_period_s=2,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=opts.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
    )
    app = serve.run(deployment.bind(opts), name=APP_NAME, route_prefix="/", blocking=False)
    return Deployed(app, hub)


def replica_logging(level: str) -> dict[str, Any]:
    """Ray Serve's logging of each replica, as the single process logs: at ``level``, with a line
    per request (Ray's access log, which every replica also forwards to the driver) only at
    ``debug``, as uvicorn's access log."""
    return {"log_level": level.upper(), "enable_access_log": level == "debug"}


def ray_limits(opts: ReplicaOptions) -> dict[str, Any]:
    """Ray Serve's per-replica options from the replica's own admission limits."""
    seqs = int(opts.engine.get("max_num_seqs") or EngineConfig.max_num_seqs)
    waiting = opts.limits.max_waiting_requests or seqs  # admission.resolve_limits' default
    ongoing = seqs + waiting + ONGOING_HEADROOM
    return {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": ongoing,
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
    }


def stop_replicas(deployed: Deployed) -> None:
    """Delete the app (in-flight requests get the graceful timeout), then the metrics hub."""
    ray = import_ray("serve")
    ray.serve.delete(APP_NAME)
    ray.kill(deployed.hub)


def run_replicas(args: argparse.Namespace, limits: ServingLimits) -> int:
    ray = import_ray("serve")
    opts = ReplicaOptions(
        engine=dataclasses.asdict(engine_config(args)),
        model_names=args.served_model_name or [args.model],
        api_key=args.api_key,
        replicas=args.replicas,
        threads=args.threads_per_replica,
        shutdown_timeout=args.shutdown_timeout,
        limits=limits,
        log_level=args.log_level,
    )
    init_ray(ray, args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deployed = launch_replicas(opts, args.host, args.port)
        log.info(
            "serving %s on http://%s:%d with %d replicas x %d threads",
            opts.model_names[0],
            args.host,
            args.port,
            opts.replicas,
            opts.threads,
        )
        stop.wait()
        log.info("shutting down: in-flight requests get %.0f s", opts.shutdown_timeout)
        stop_replicas(deployed)
        if args.ray_address is None:  # our own local cluster: take Serve down with it
            ray.serve.shutdown()
    finally:
        ray.shutdown()
    return 0
