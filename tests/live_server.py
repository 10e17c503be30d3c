"""A real ``python -m eeserve.server`` process on 127.0.0.1 for end-to-end tests.

``Server(model_dir, *extra_args)`` starts it on a free port and waits for ``/health``;
``stop(sig)`` ends it and returns the exit code; ``output()`` is the tail of its log.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.model = str(model_dir)
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, "-m", "eeserve.server", self.model, "--host", HOST]
        cmd += ["--port", str(self.port), "--kv-cache-memory", "8000000", *extra]
        self.log = open(model_dir.parent / f"server-{self.port}.log", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise AssertionError(f"server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"server did not exit:\n{self.output()}") from None


def api_client(server: Server, api_key: str, timeout: float = 60) -> httpx.Client:
    """An httpx client of ``server``'s API with the bearer key (close it, or use ``with``)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    return httpx.Client(base_url=server.base, headers=headers, timeout=timeout)
