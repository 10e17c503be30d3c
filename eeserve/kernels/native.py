"""The engine's own CPU kernels (``csrc/*.cpp``): built once per machine, loaded on demand.

Contract: ``load()`` returns ``NativeOps`` when the kernels are usable, else None (and logs why
once): no C++ compiler, a failed build, ``EESERVE_NATIVE=0``, or a platform other than Linux.
Every caller keeps a PyTorch path for None, so the engine runs everywhere and the kernels are
only a speed-up. Each op equals its PyTorch reference up to float summation order
(tests/test_native.py). The build lands in ``$EESERVE_HOME/kernels/<key>``, where the key covers
the source, torch's version and the CPU (the code is compiled for this CPU's instruction set).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eeserve.config import eeserve_home

log = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
# Every source and header of the folder: the build key covers them all, so no edit can reuse a
# library built from other code.
SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
_LIBRARY = "eeserve_cpu_ops"
_lock = threading.Lock()


@dataclass(frozen=True)
class NativeOps:
    """Typed handles on the registered ops (``torch.ops.eeserve``)."""

    ops: Any

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [R, H, D] (one query per row, heads contiguous); k/v_cache [slots, Hkv, D]; slots
        [R, T] int64, the context of row r being slots[r, :lens[r]] (lens >= 1) -> [R, H, D]."""
        out: torch.Tensor = self.ops.decode_attention(q, k_cache, v_cache, slots, lens, scale)
        return out

    def span_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [n, H, D] (one sequence's queries, heads contiguous); k/v_cache [slots, Hkv, D];
        slots [T] int64, its positions' slots; positions [n] int64, query i attending to
        positions 0..positions[i] -> [n, H, D]."""
        out: torch.Tensor = self.ops.span_attention(q, k_cache, v_cache, slots, positions, scale)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)  # type: ignore[no-any-return]

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [N, heads, D] (heads contiguous, rows may be strided) in place."""
        self.ops.rotary_(x, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate, then up) -> silu(gate) * up [N, I]."""
        return self.ops.silu_mul(gate_up)  # type: ignore[no-any-return]

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate, then up) -> gelu_tanh(gate) * up [N, I] (Gemma's GeGLU)."""
        return self.ops.gelu_mul(gate_up)  # type: ignore[no-any-return]

    def int8_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        """x [M, K] float32/bfloat16; qweight int8 and scale [.., groups, 16] float32 in
        ``quant.pack_int8``'s layout; bias [N] float32 or None -> [M, N] in x's dtype."""
        out: torch.Tensor = self.ops.int8_linear(x, qweight, scale, bias, out_features)
        return out

    def int8_screen(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        out_features: int,
        coeff: torch.Tensor,
        row_scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32, an int8 weight in ``int8_linear``'s layout, coeff [M], row_scale [N]
        -> (hi [M, ceil(N / 32)], floor [M]): per 32-id tile the largest logit plus its bound
        coeff[m] * row_scale[i], and per row the largest logit minus it
        (``csrc/screen_ops.cpp``)."""
        hi, floor = self.ops.int8_screen(x, qweight, scale, out_features, coeff, row_scale)
        return hi, floor

    def f32_tiles_at(
        self, x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """x [M, K] float32, a float32 weight in ``f32_linear``'s layout, ids [n] int64 tile
        indices -> [M, 32 n]: the 32 outputs of each tile ids[j] of ``f32_linear(x, weight)``."""
        return self.ops.f32_tiles_at(x, weight, ids)  # type: ignore[no-any-return]

    def decoder_layer(self, *args: object) -> torch.Tensor:
        """One whole decoder layer for a pass's rows; the arguments of ``csrc/layer_ops.cpp``."""
        return self.ops.decoder_layer(*args)  # type: ignore[no-any-return]

    def gguf_dequantize(self, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """blocks uint8 [N, row_bytes] (each row k weights in GGUF blocks of ``ggml_type``) ->
        [N, k] float32, equal to ``gguf.quants.dequantize`` bit for bit (``csrc/gguf_ops.cpp``)."""
        return self.ops.gguf_dequantize(blocks, ggml_type, k)  # type: ignore[no-any-return]

    def gguf_linear(
        self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out: torch.Tensor
    ) -> None:
        """x [M, K] float32, blocks as in ``gguf_dequantize`` [N, row_bytes] -> writes out [M, N]
        (unit column stride) = x @ gguf_dequantize(blocks)^T, float32 arithmetic."""
        self.ops.gguf_linear(x, blocks, ggml_type, out)

    def gguf_stacked_linear(
        self, x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``gguf_linear`` on parts stacked along the output, in one call: blocks flat uint8
        (the parts' rows one after another), parts int64 [P, 2] (ggml type, rows) per part
        (``csrc/gguf_linear.h``)."""
        self.ops.gguf_stacked_linear(x, blocks, parts, out)

    def f32_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x [M, K] float32; weight [2 * ceil(N / 32), K, 16] float32 in ``packing.pack_blocks``'s
        layout; bias [N] float32 or None -> [M, N]."""
        return self.ops.f32_linear(x, weight, bias, out_features)  # type: ignore[no-any-return]


def _cpu_key() -> str:
    """What the compiled code depends on: the source, torch, and this CPU's instruction set."""
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(
            sorted(set(line for line in info if line.startswith(("flags", "model name"))))
        )
    except OSError:
        pass
    h = hashlib.sha256()
    code = (s.read_bytes() for s in (*SOURCES, *HEADERS))
    for part in (*code, torch.__version__.encode(), cpu.encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _load_built(library: Path) -> bool:
    """Loads a library built under the same key: the key covers every source, so nothing needs
    rebuilding (ninja would rebuild by file times alone, e.g. after a fresh checkout)."""
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:  # an incomplete file: build it again
        log.warning("eeserve CPU kernels: %s did not load (%s); building again", library, exc)
        return False
    return True


def _ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the pip package may only be in the
    virtual environment's bin folder, which is not on PATH when the venv is not activated."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja  # type: ignore[import-untyped]

        dirs.append(ninja.BIN_DIR)
    except ImportError:
        pass
    path = os.environ.get("PATH", "")
    missing = [d for d in dirs if d not in path.split(os.pathsep)]
    if missing:
        os.environ["PATH"] = os.pathsep.join([*missing, path])


@functools.cache
def load() -> NativeOps | None:
    if os.environ.get("EESERVE_NATIVE", "1") == "0":
        return None
    if platform.system() != "Linux":
        log.info("eeserve CPU kernels: only built on Linux; using PyTorch ops")
        return None
    with _lock:
        try:
            from torch.utils.cpp_extension import load as build

            out = eeserve_home() / "kernels" / _cpu_key()
            built = out / f"{_LIBRARY}.so"
            if built.exists() and _load_built(built):
                return NativeOps(torch.ops.eeserve)
            _ninja_on_path()
            out.mkdir(parents=True, exist_ok=True)
            log.info("eeserve CPU kernels: building once into %s", out)
            build(
                name=_LIBRARY,
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(out),
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a build error: PyTorch ops instead
            log.warning("eeserve CPU kernels unavailable (%s); using PyTorch ops", exc)
            return None
    return NativeOps(torch.ops.eeserve)
