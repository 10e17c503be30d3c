"""llama.cpp's GGUF files of the benchmark's model, and llama.cpp through ``llama-cpp-python``.

Contract: ``gguf_dir(folder)`` is the cache folder of a model folder's GGUFs under
``$EESERVE_HOME/gguf``, keyed by the weights file (rebuilt when it changes).
``own_gguf(folder)`` is the GGUF a named model is converted from (``models.loader``): the
default model's Q4_1, ``gemma3-270m``'s Q4_K_M (the copies ``models.loader`` keeps), or None;
``model_file(spec, folder)`` the same for a model given by name, folder or ``.gguf`` file (that
file itself), its format named by the file (``file_format``: its ``general.file_type``).
``f32_gguf(folder, quantize)`` is the folder as an F32 GGUF: written from the folder for the
Llama family (``bench.gguf_export``; for the default model, the exact dequantisation of its
Q4_1), de-quantized from the model's own GGUF by llama.cpp's ``llama-quantize`` (the native one
of ``bench.llamacpp_build``) for the others; ``q8_0_gguf(folder, quantize)`` quantises that F32
to Q8_0 with the same tool. Each is made once, written beside its name and renamed into place.

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
from pathlib import Path

import gguf

from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.measure import Run
from eeserve.config import eeserve_home
from eeserve.models.fetch import GEMMA3_MODEL
from eeserve.models.loader import DEFAULT_MODEL, model_gguf

_WORKER = Path(__file__).with_name("llamacpp_worker.py")
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


def f32_gguf(folder: Path, quantize: Path | None = None) -> Path:
    """The folder's weights as an F32 GGUF: written from the folder for the Llama family, else
    de-quantized from the model's own GGUF by ``llama-quantize`` at ``quantize`` (the folder was
    converted from that file, so both hold the same weights)."""
    f32 = gguf_dir(folder) / "f32.gguf"
    if not f32.exists():
        tmp = f32.with_suffix(".tmp")
        own = None if _model_type(folder) == "llama" else own_gguf(folder)
        if own is None or quantize is None:
            write_gguf_f32(folder, tmp)  # ValueError for another architecture
        else:
            _quantize(quantize, own[1], tmp, "F32", requantize=True)
        tmp.rename(f32)
    return f32


def q8_0_gguf(folder: Path, quantize: Path) -> Path:
    """The F32 GGUF quantised to Q8_0 by llama.cpp's ``llama-quantize`` at ``quantize``."""
    q8 = gguf_dir(folder) / "q8_0.gguf"
    if not q8.exists():
        _quantize(quantize, f32_gguf(folder, quantize), q8.with_suffix(".tmp"), "Q8_0")
        q8.with_suffix(".tmp").rename(q8)
    return q8


def own_gguf(folder: Path) -> tuple[str, Path] | None:
    """(format, path) of the GGUF a named model is converted from (``models.loader.model_gguf``:
    the default model's Q4_1, ``gemma3-270m``'s Q4_K_M); None for any other folder."""
    models = (eeserve_home() / "models").resolve()
    for name, fmt in ((DEFAULT_MODEL, "Q4_1"), (GEMMA3_MODEL, "Q4_K_M")):
        if folder.resolve() == models / name:
            return fmt, model_gguf(name)
    return None


def model_file(spec: str, folder: Path) -> tuple[str, Path] | None:
    """(format, path) of the GGUF that model ``spec`` (resolved to ``folder``) is converted
    from: a named model's own file, or the ``.gguf`` file given; None for a model folder."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return file_format(path), path.resolve()
    return own_gguf(folder)


def file_format(path: Path) -> str:
    """llama.cpp's name of a GGUF's format (``general.file_type``: MOSTLY_Q4_1 -> Q4_1)."""
    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "GGUF"  # the writer did not say: the file type is not one name
    value = int(field.parts[-1][0])
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:  # newer than the gguf package: named by its number
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _model_type(folder: Path) -> str | None:
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    return str(model_type) if model_type is not None else None


def _quantize(quantize: Path, src: Path, dst: Path, fmt: str, requantize: bool = False) -> None:
    """``llama-quantize`` ``src`` into ``dst`` as ``fmt``; ``requantize`` for a quantized
    ``src`` (which llama-quantize refuses without its flag)."""
    flags = ["--allow-requantize"] if requantize else []
    done = subprocess.run(
        [str(quantize), *flags, str(src), str(dst), fmt],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        dst.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize could not make {fmt} of {src}:\n{done.stderr}")


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
