"""llama.cpp's constrained decoding, the peer of ``bench structured``: ``llama-server`` on a GGUF.

Contract: ``LlamaServer(server, gguf, threads=, slots=, ctx=)`` starts llama.cpp's own server
(``bench.llamacpp_build``; one process, ``slots`` sequences decoded together, ``ctx`` tokens of
KV cache shared among them) on a free local port, its log in a temporary file (the end of it in
the error when it does not start), and waits until it answers ``/health``.
``generate(prompts, constraint, max_tokens)`` sends the prompts (token ids: the same chat
template and tokenizer as the engine's) at once, one a slot, greedy, and returns per prompt the
text and token ids; ``close()`` stops the server. A constraint goes the way llama.cpp takes it: a
JSON schema as ``json_schema`` (llama.cpp turns it into a GBNF grammar itself: its whitespace
between tokens is free, so its output may hold more tokens than the engine's for the same
fields), a choice as a GBNF alternation of its strings, a GBNF grammar as itself. Regexes and
Lark grammars have no llama.cpp form here: ``ValueError``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eeserve.bench.serve import wait_healthy
from eeserve.structured_outputs import StructuredOutputsParams

START_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class LlamaOut:
    text: str
    token_ids: list[int]
    stopped: bool  # ended by its end-of-sequence token (else by the token limit)


def constraint_fields(c: StructuredOutputsParams) -> dict[str, Any]:
    """The fields of a llama-server ``/completion`` request that carry the constraint."""
    if c.json is not None:
        schema = json.loads(c.json) if isinstance(c.json, str) else c.json
        return {"json_schema": schema}
    if c.json_object:
        return {"json_schema": {"type": "object"}}
    if c.choice is not None:
        options = " | ".join(json.dumps(o, ensure_ascii=False) for o in c.choice)
        return {"grammar": f"root ::= {options}"}
    if c.grammar is not None and "::=" in c.grammar:
        return {"grammar": c.grammar}
    raise ValueError(f"llama-server takes no {c.kind.value} constraint of this form")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(self, server: Path, gguf: Path, *, threads: int, slots: int, ctx: int) -> None:
        self.port = _free_port()
        self.slots = slots
        cmd = [str(server), "-m", str(gguf), "-t", str(threads), "-np", str(slots)]
        cmd += ["-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port)]
        # Its log goes to a file: a pipe nobody reads fills up and stops the server mid-run.
        with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False) as f:
            self.log = Path(f.name)
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, START_TIMEOUT_S)
        except RuntimeError as e:
            tail = self.log.read_text(errors="replace")[-2000:]
            self.close()
            raise RuntimeError(f"llama-server: {e}; the end of its log:\n{tail}") from None

    def _one(self, prompt: list[int], fields: dict[str, Any], max_tokens: int) -> LlamaOut:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0}
        body |= {"cache_prompt": False, "return_tokens": True, **fields}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            got = json.loads(r.read())
        return LlamaOut(
            text=got["content"],
            token_ids=list(got.get("tokens") or []),
            stopped=got.get("stop_type") == "eos",
        )

    def generate(
        self, prompts: list[list[int]], constraint: StructuredOutputsParams, max_tokens: int
    ) -> list[LlamaOut]:
        """Every prompt at once (at most ``slots``), each under ``constraint``."""
        assert len(prompts) <= self.slots, f"{len(prompts)} prompts for {self.slots} slots"
        fields = constraint_fields(constraint)
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self._one(p, fields, max_tokens), prompts))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)
