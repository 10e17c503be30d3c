"""Where a result comes from: the command, the commit, the date and the machine.

Contract: ``provenance()`` is the record every result file carries (``bench`` results,
``calibrate --json``); ``git_revision`` is the checkout's commit (``+dirty`` with local changes)
and ``machine_description`` the platform, processor, CPU model, its instruction sets
(``ISA_FLAGS``), torch threads and build, and ``kernel_path``: which of the engine's CPU kernel
paths runs here (``KernelPath``; loading the kernels builds them once per machine, as the engine
does, when they are not built yet).
"""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from eeserve.kernels.native import load as load_native


def machine_description() -> dict[str, Any]:
    cpu, isa = cpu_model_and_isa()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu,
        "isa": isa,
        "kernel_path": kernel_path(isa, load_native() is not None).value,
        "cpu_count": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


# The instruction sets the engine's kernels choose between, as /proc/cpuinfo names them (the
# AVX2 path needs FMA and F16C beside AVX2).
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
)


class KernelPath(StrEnum):
    """The code the engine's CPU kernels run (``kernels/csrc``): each file is compiled with
    ``-march=native`` (``kernels.native``), and its ``#if`` on the compiler's ISA macros picks
    the AVX-512 loop, the AVX2 (+FMA, F16C) loop or the portable one."""

    AVX512 = "avx512"
    AVX2 = "avx2"
    PORTABLE = "portable"
    PYTORCH = "pytorch"  # no kernels (no compiler, EESERVE_NATIVE=0, not Linux): PyTorch ops


def kernel_path(isa: list[str], built: bool) -> KernelPath:
    """The path the kernels take on a CPU with ``isa`` (``cpu_model_and_isa``), ``built`` or
    not; the selection of ``csrc/gguf_blocks.h`` and ``csrc/f32_ops.cpp``."""
    if not built:
        return KernelPath.PYTORCH
    if "avx512f" in isa:
        return KernelPath.AVX512
    if {"avx2", "fma", "f16c"} <= set(isa):
        return KernelPath.AVX2
    return KernelPath.PORTABLE


def cpu_model_and_isa() -> tuple[str | None, list[str]]:
    """The CPU's model name and which of ``ISA_FLAGS`` it has (Linux; (None, []) elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None, []
    info = dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines) if v)
    flags = set(info.get("flags", "").split())
    return info.get("model name"), [f for f in ISA_FLAGS if f in flags]


def git_revision() -> str | None:
    """The checkout's commit (``+dirty`` with local changes), when run from a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty=+dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() or None


def provenance() -> dict[str, Any]:
    """Where a result comes from: the exact command, the commit, the date and the machine."""
    return {
        "command": shlex.join(["eeserve", *sys.argv[1:]]),
        "commit": git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_description(),
    }
