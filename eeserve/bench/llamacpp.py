"""llama.cpp as a benchmark peer, through the ``llama-cpp-python`` package (extra ``[peer]``).

Contract: ``available()`` says whether the package imports (it is optional: pip builds llama.cpp
from source, about 10 minutes on 2 cores; ``INSTALL_HINT`` says how). ``peer_ggufs(folder)``
returns the model folder as an F32 GGUF (``bench.gguf_export``) and a Q8_0 GGUF made from it by
llama.cpp's own quantiser, both cached under ``$EESERVE_HOME/gguf`` and rebuilt when the weights
change. ``LlamaCpp(path, threads, max_batch, max_len)`` holds one model and context;
``run(prompts, max_tokens)`` decodes every prompt greedily in one batch to exactly
``max_tokens`` (no stop token) and returns a ``bench.measure.Run`` timed like the engine's: all
prompts prefilled together, decode tok/s from the moment every sequence has its first token.
llama.cpp runs in a worker process (``llamacpp_worker.py``): its OpenMP threads and PyTorch's
fight when they share one process.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.measure import Run
from eeserve.config import eeserve_home

_WORKER = Path(__file__).with_name("llamacpp_worker.py")
INSTALL_HINT = (
    "pip install 'eeserve[peer]' (llama-cpp-python; pip builds llama.cpp from source once, "
    "about 10 minutes on 2 cores)"
)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _lib() -> Any:
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(False)
    return llama_cpp


def peer_ggufs(folder: Path) -> dict[str, Path]:
    """{"f32": F32 GGUF, "q8_0": Q8_0 GGUF} of the model folder, made once and cached."""
    weights = folder / "model.safetensors"
    stat = weights.stat()
    key = hashlib.sha256(f"{weights.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = eeserve_home() / "gguf" / f"{folder.name}-{key.hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    f32, q8 = out / "f32.gguf", out / "q8_0.gguf"
    if not f32.exists():
        write_gguf_f32(folder, f32.with_suffix(".tmp"))
        f32.with_suffix(".tmp").rename(f32)
    if not q8.exists():
        lib = _lib()
        params = lib.llama_model_quantize_default_params()
        params.ftype = lib.LLAMA_FTYPE_MOSTLY_Q8_0
        tmp = q8.with_suffix(".tmp")
        if lib.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)):
            raise RuntimeError(f"llama.cpp could not quantise {f32} to Q8_0")
        tmp.rename(q8)
    return {"f32": f32, "q8_0": q8}


class LlamaCpp:
    """A llama.cpp worker process (``llamacpp_worker.py``) holding one model and context."""

    def __init__(self, path: Path, threads: int, max_batch: int, max_len: int) -> None:
        args = [str(path), str(threads), str(max_batch), str(max_len)]
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # Its OpenMP threads spin briefly between tokens (sleeping there, OMP_WAIT_POLICY=
            # PASSIVE, measured 2.5x slower at batch 1) and then sleep, so that an idle worker
            # does not spin on the cores this engine is being timed on (it measured 0 CPU ticks
            # 1 s after a request with this count).
            env={
                **{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"},
                "GOMP_SPINCOUNT": "1000000",
            },
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        if self._out.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"llama.cpp worker failed to load {path} (see its stderr)")

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run:
        self._in.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self._in.flush()
        line = self._out.readline()
        if not line:
            raise RuntimeError("llama.cpp worker exited (see its stderr)")
        res = json.loads(line)
        n, total = len(prompts), res["prefill_s"] + res["decode_s"]
        return Run(
            tokens_per_s=n * max_tokens / total,
            mean_itl_ms=1000 * res["decode_s"] / max(1, max_tokens - 1),
            outputs=res["outputs"],
            decode_tokens_per_s=n * (max_tokens - 1) / max(res["decode_s"], 1e-9),
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self._in.close()
            self.proc.wait(timeout=30)
