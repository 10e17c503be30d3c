"""The server a soak runs against: started for the run on loopback, or one already running.

Contract: ``soak_server(args)`` yields (base URL, server pid). With ``--base-url`` it yields that
URL as it is and ``--server-pid`` (or None), and starts nothing. Otherwise it starts ``python -m
eeserve.server MODEL`` (``server_command``) on a free loopback port with its output in a
temporary log file, waits until it answers ``/health``, and on leaving sends it SIGTERM (SIGKILL
after 120 s). The single process runs ``--server-nice`` below this client's priority under
``nice``; with ``--replicas N`` the command is not niced (Ray's proxy and controller stay at the
client's priority) and ``nice_replicas`` renices each replica's threads once it has published its
pid in ``/metrics``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from eeserve.bench.serve import wait_healthy
from eeserve.bench.soak_sample import process_tree, read_gauges, renice

HOST = "127.0.0.1"


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The command that starts the server to soak on ``port``: ``eeserve.server`` with the
    run's options, behind ``nice -n --server-nice`` unless that is 0 or the server runs replicas."""
    cmd = [sys.executable, "-m", "eeserve.server", args.model, "--host", HOST, "--port", str(port)]
    if args.server_nice and not args.replicas:  # replicas: niced once they run (nice_replicas)
        cmd = ["nice", "-n", str(args.server_nice), *cmd]
    cmd += ["--log-level", "warning", "--request-timeout", str(args.request_timeout)]
    if args.replicas:
        cmd += ["--replicas", str(args.replicas)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd + shlex.split(args.server_args)


@contextmanager
def soak_server(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """(base URL, server pid): ``--base-url`` as it is, or a server started for the run."""
    if args.base_url:
        yield args.base_url.rstrip("/"), args.server_pid
        return
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    cmd = server_command(args, port)
    with tempfile.NamedTemporaryFile(
        "w+b", prefix="eeserve-soak-", suffix=".log", delete=False
    ) as log:
        print(f"server: {shlex.join(cmd)} (log: {log.name})", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        wait_healthy(base, proc, timeout=900)
        if args.replicas and args.server_nice:
            nice_replicas(base, args.replicas, args.server_nice)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def nice_replicas(base: str, replicas: int, increment: int, timeout: float = 120.0) -> list[int]:
    """Run each of the ``replicas`` processes behind ``base`` (their pids from
    ``eeserve_replica_info``, which a replica publishes within seconds of starting) and the
    processes they started ``increment`` nicer than this client; the replicas' pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = read_gauges(httpx.get(f"{base}/metrics", timeout=30).text)[1]
        if len(pids) >= replicas:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pids)} of {replicas} replicas published their pid")
        time.sleep(1.0)
    # With their engine processes (``--engine-host process``), forked before this runs.
    threads = sum(renice(p, increment) for pid in pids for p in process_tree(pid))
    print(f"replicas {pids}: {threads} threads at niceness +{increment}", flush=True)
    return pids
