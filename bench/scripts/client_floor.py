"""The soak client's own floor under a burst: ``eeserve bench soak`` against a trivial ASGI app
that answers every generation request 429 at once (with ``Retry-After``), ``/health`` 200 and
``/metrics`` an idle server's gauges, served by uvicorn as ``eeserve serve`` serves (its default
event loop and HTTP parser: uvloop and httptools where installed). What the soak times against it
is the client's cost of sending a burst and reading its answers, plus the kernel's and uvicorn's:
the part of a server's figures no server can take away.
Usage: client_floor.py OUT_DIR LABEL [soak options...]   (e.g. --burst 400 --loads 0 ...)"""

import json
import socket
import subprocess
import sys
import time

import httpx

IDLE_PAGE = b"""# TYPE eeserve_kv_blocks_used gauge
eeserve_kv_blocks_used 0.0
# TYPE eeserve_num_requests_running gauge
eeserve_num_requests_running 0.0
# TYPE eeserve_num_requests_waiting gauge
eeserve_num_requests_waiting 0.0
"""
REFUSAL = json.dumps(
    {"error": {"message": "overloaded", "type": "requests", "param": None, "code": "429"}}
).encode()


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    """Every generation request 429, /health 200, /metrics an idle server's gauges."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    status, body, extra = 429, REFUSAL, [(b"retry-after", b"1")]
    if path == "/health":
        status, body, extra = 200, b'{"status":"ok"}', []
    elif path == "/metrics":
        status, body, extra = 200, IDLE_PAGE, []
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


def main() -> int:
    out_dir, label, *soak = sys.argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uvicorn = [sys.executable, "-m", "uvicorn", "--app-dir", "bench/scripts", "client_floor:app"]
    server = subprocess.Popen(
        [*uvicorn, "--port", str(port), "--log-level", "warning", "--no-access-log"]
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        cmd = ["eeserve", "bench", "soak", "--base-url", base, "--server-pid", str(server.pid)]
        cmd += [*soak, "--out-dir", out_dir, "--label", label]
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
