"""``eeserve serve MODEL``: argument parsing and the uvicorn process with graceful shutdown.

Contract: ``add_serve_parser(subparsers)`` adds the ``serve`` sub-command (its ``func`` default
is ``run_serve``); ``run_serve(args)`` loads the engine, serves until SIGINT or SIGTERM and
returns 0. On the first signal the listener closes, new requests on open connections get 503,
in-flight requests run to completion for up to ``--shutdown-timeout`` seconds and are then
aborted with an error (a JSON error body, or an ``error`` event before ``[DONE]`` in a
stream); a second SIGINT forces the exit. ``--max-queue-seconds``, ``--max-waiting-requests``,
``--max-queued-tokens`` and ``--request-timeout`` set admission control and the time limit of a
request (``serving_limits(args)``; see ``server.admission``). With ``--replicas N`` the same app
runs as N Ray Serve replicas instead (``replicas.run_replicas``), each with those limits.
``main(argv)`` is ``python -m eeserve.server``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn

from eeserve.engine_args import add_engine_args, engine_config
from eeserve.server.admission import DEFAULT_MAX_QUEUE_SECONDS, ServingLimits
from eeserve.server.app import create_app
from eeserve.server.engine_core import EngineHost
from eeserve.server.replicas import run_replicas
from eeserve.server.startup import build_engine, freeze_startup_heap

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Serve MODEL over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions "
    "(streaming with SSE), /v1/models, /health, /metrics (Prometheus), docs at /docs, "
    "a playground page at / (see docs/playground.md). "
    "Requests may carry an `early_exit` object {enabled, threshold | tolerance, measure, "
    "min_layer}; responses report the mean exit layer and the fraction of layers saved."
)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description=DESCRIPTION
    )
    add_serve_args(p)
    p.set_defaults(func=run_serve)
    return p


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="smollm2, an HF folder or a .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("EESERVE_API_KEY"),
        help="require `Authorization: Bearer KEY` (default: $EESERVE_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="name(s) clients use in `model` (default: the MODEL argument); repeatable",
    )
    p.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the playground page at / (the API is unchanged)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    _add_overload_args(p.add_argument_group("overload (per replica with --replicas)"))
    _add_replica_args(p.add_argument_group("replicas (Ray Serve; needs the `ray` extra)"))
    add_engine_args(p.add_argument_group("engine options"))


def _add_overload_args(o: argparse._ArgumentGroup) -> None:
    o.add_argument(
        "--max-queue-seconds",
        type=float,
        default=DEFAULT_MAX_QUEUE_SECONDS,
        help="refuse (429) a request that the work queued ahead of it, at the throughput "
        "measured over the recent past, would start later than this many seconds from now "
        f"(default {DEFAULT_MAX_QUEUE_SECONDS:g}; inf: no bound in seconds)",
    )
    o.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="engine requests that may wait for their first token; more get 429, whatever "
        "--max-queue-seconds says (default: --max-num-seqs)",
    )
    o.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="prompt + max output tokens the waiting requests may hold; more get 429, whatever "
        "--max-queue-seconds says (default: the KV pool's tokens)",
    )
    o.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take before it is aborted with 504 (default: no limit; "
        "a request's `request_timeout` field may ask for less)",
    )
    o.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="run the engine thread N nicer than the HTTP threads (0-19; default 0), so that "
        "429s, /health and streams are answered promptly while the engine keeps every core busy",
    )
    o.add_argument(
        "--engine-host",
        type=EngineHost,
        choices=list(EngineHost),
        default=EngineHost.PROCESS,
        metavar="{process,thread}",
        help="where the engine steps: a process of its own (default), which keeps it off the "
        "interpreter lock of the process that answers HTTP, or a thread of that process",
    )


def _add_replica_args(r: argparse._ArgumentGroup) -> None:
    r.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas, each its own process, behind this one endpoint",
    )
    r.add_argument(
        "--ray-address", default=None, help="Ray cluster to run on (default: start one here)"
    )
    r.add_argument(
        "--threads-per-replica", type=int, default=1, help="CPUs (torch threads) per replica"
    )


def serving_limits(args: argparse.Namespace) -> ServingLimits:
    """The overload flags (a ``ValueError`` names a bad one)."""
    return ServingLimits(
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout=args.request_timeout,
        engine_nice=args.engine_nice,
        max_queue_seconds=args.max_queue_seconds,
        engine_host=args.engine_host,
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", force=True
    )
    serving_limits(args)  # bad limits fail before anything loads
    if args.replicas is not None:
        if args.replicas < 1 or args.threads_per_replica < 1:
            raise ValueError("--replicas and --threads-per-replica must be >= 1")
        return run_replicas(args, serving_limits(args))
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas")
    engine = build_engine(engine_config(args))
    app = create_app(
        engine,
        model_names=args.served_model_name or [args.model],
        api_key=args.api_key,
        ui=not args.no_ui,
        limits=serving_limits(args),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
        access_log=args.log_level == "debug",
    )
    server = _GracefulServer(config, app.state.engine_loop, args.shutdown_timeout)
    freeze_startup_heap()
    server.run()
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains the engine on a signal and does not re-raise it afterwards."""

    def __init__(self, config: uvicorn.Config, engine_loop: Any, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        self.engine_loop.begin_drain(self.drain_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eeserve.server", description=DESCRIPTION)
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
