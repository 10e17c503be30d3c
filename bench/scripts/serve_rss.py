"""Resident memory of ``eeserve serve`` with float32 weights and with native GGUF weights.

For each weight source (``--weights float32``, then ``native``), starts one server process,
reads its resident set (``VmRSS``, with its anonymous and file-backed parts) once ``/health``
answers, then again after 8 chat requests of 64 tokens each (the KV pool and the kernels'
buffers in use), and stops it. Writes both, the model's GGUF size, and the provenance of the run
(command, commit, CPU model and ISA flags).
Usage: serve_rss.py --model smollm2 --out FILE.json
"""

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from eeserve.bench.serve import wait_healthy
from eeserve.models.loader import default_gguf
from eeserve.tuning.provenance import provenance

SOURCES = ("float32", "native")
FIELDS = ("VmRSS", "RssAnon", "RssFile")


def rss_mb(pid: int) -> dict[str, float]:
    """The process's resident set and its parts, in MB, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) / 1024
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_side(model: str, source: str) -> dict[str, object]:
    port = free_port()
    cmd = [sys.executable, "-m", "eeserve.server", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--weights", source, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout=300)
        with httpx.Client(base_url=base, timeout=300) as client:
            loaded = rss_mb(proc.pid)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
                "max_tokens": 64,
                "temperature": 0,
            }
            for _ in range(8):
                client.post("/v1/chat/completions", json=body).raise_for_status()
            served = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"weights": source, "after_load_mb": loaded, "after_8_requests_mb": served}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = [serve_side(args.model, s) for s in SOURCES]
    gguf = default_gguf() if args.model == "smollm2" else None
    record = provenance()
    record["command"] = " ".join(["python", "bench/scripts/serve_rss.py", *sys.argv[1:]])
    result = {
        "provenance": record,
        "model": args.model,
        "gguf_mb": gguf.stat().st_size / 2**20 if gguf is not None else None,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(r["weights"], "load", r["after_load_mb"], "served", r["after_8_requests_mb"])


if __name__ == "__main__":
    main()
