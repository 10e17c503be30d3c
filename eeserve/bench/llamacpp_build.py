"""llama.cpp's own benchmark tools, built once from the source vendored in llama-cpp-python.

Contract: ``native_tools()`` returns the paths of ``llama-batched-bench``, ``llama-quantize`` and
``llama-server`` (the peer of ``bench structured``: its ``json_schema`` and GBNF grammars) under
``$EESERVE_HOME/llamacpp/<LLAMACPP_VERSION>/bin``, building them first when they are not there:
``pip download --no-deps --no-binary :all: llama-cpp-python==<version>`` (the sdist, which vendors
llama.cpp's source at the commit that package release pins), CMake configured for the CPU backend
only (``GGML_NATIVE=ON``, static libraries, no CUDA/Metal/Vulkan/OpenSSL), and only those three
targets built, under ``nice -n 19``; AMX code is compiled out (its q8_0 matmul crashes).
The build runs in a temporary folder and the finished ``bin`` folder is renamed into place, so
an interrupted or failed build leaves nothing behind; its CMake flags go into ``build.json``
beside ``bin``, and a cached build whose flags differ from ``CMAKE_FLAGS`` is built again
(``is_built``). Missing ``cmake`` or C/C++ compiler raises
``BuildToolMissing`` naming what is missing before anything is downloaded; a failed download or
build raises ``RuntimeError`` with the tail of its log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eeserve.config import eeserve_home

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is built
TARGETS = ("llama-batched-bench", "llama-quantize", "llama-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the bin folder can be renamed
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    # llama.cpp's AMX matmul segfaults on q8_0 (ggml-org/llama.cpp#20824, reproduced here on a
    # Xeon with AMX); GCC's explicit -mno-* wins over -march=native, so AVX-512/VNNI stay on.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)
# (program, what to install when it is missing); CMake's own C/C++ detection follows CC/CXX.
REQUIRED = (
    ("cmake", "cmake (apt-get install cmake, or pip install cmake)"),
    ("cc", "a C compiler (apt-get install build-essential)"),
    ("c++", "a C++ compiler (apt-get install build-essential)"),
)


class BuildToolMissing(RuntimeError):
    """cmake or a compiler is not on PATH, so llama.cpp cannot be built here."""


@dataclass(frozen=True, kw_only=True)
class NativeTools:
    batched_bench: Path
    quantize: Path
    server: Path
    version: str


def tools_dir(version: str = LLAMACPP_VERSION) -> Path:
    return eeserve_home() / "llamacpp" / version


def missing_tools() -> list[str]:
    """What of ``REQUIRED`` is not on PATH (``CC``/``CXX`` count for the compilers)."""
    env_names = {"cc": "CC", "c++": "CXX"}
    out = []
    for program, hint in REQUIRED:
        chosen = os.environ.get(env_names.get(program, ""), program) or program
        if shutil.which(chosen) is None:
            out.append(hint)
    return out


def is_built(version: str = LLAMACPP_VERSION) -> bool:
    """Every tool is cached, built with today's ``CMAKE_FLAGS`` (an older flag set is stale)."""
    home = tools_dir(version)
    if not all((home / "bin" / t).exists() for t in TARGETS):
        return False
    try:
        flags = json.loads((home / "build.json").read_text()).get("cmake_flags")
    except (OSError, ValueError):
        return False
    return flags == list(CMAKE_FLAGS)


def native_tools(version: str = LLAMACPP_VERSION) -> NativeTools:
    """The cached tools, built first if absent or stale (minutes: it compiles on every core)."""
    if not is_built(version):
        build(version)
    bin_dir = tools_dir(version) / "bin"
    bench, quantize, server = (bin_dir / t for t in TARGETS)
    return NativeTools(batched_bench=bench, quantize=quantize, server=server, version=version)


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}); the end of its log:\n{tail}")


def _vendored_source(tmp: Path, version: str, log: Path) -> Path:
    """Download the sdist into ``tmp`` and unpack its ``vendor/llama.cpp``."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    _run([*pip, "-d", str(tmp), f"llama-cpp-python=={version}"], log, "pip download")
    sdists = list(tmp.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise RuntimeError(f"pip download of llama-cpp-python=={version} gave no sdist in {tmp}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(tmp / "src", filter="data")
    src = next((tmp / "src").glob("*/vendor/llama.cpp"), None)
    if src is None or not (src / "CMakeLists.txt").exists():
        raise RuntimeError(f"{sdists[0].name} holds no vendor/llama.cpp with a CMakeLists.txt")
    return src


def build(version: str = LLAMACPP_VERSION) -> Path:
    """Build ``TARGETS`` from llama-cpp-python ``version``'s sdist; returns the ``bin`` folder."""
    missing = missing_tools()
    if missing:
        raise BuildToolMissing(
            "building llama.cpp's benchmark tools needs " + " and ".join(missing) + " on PATH"
        )
    home = tools_dir(version)
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent, prefix=f".build-{version}-") as name:
        tmp = Path(name)
        log = tmp / "build.log"
        print(
            f"building llama.cpp from llama-cpp-python {version} (CPU, once; log {log})",
            file=sys.stderr,
            flush=True,
        )
        src = _vendored_source(tmp, version, log)
        build_dir = tmp / "build"
        _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS], log, "cmake configure")
        jobs = str(os.cpu_count() or 1)
        cmd = ["nice", "-n", "19", "cmake", "--build", str(build_dir), "-j", jobs, "--target"]
        _run([*cmd, *TARGETS], log, "cmake build")
        staged = tmp / "out"
        (staged / "bin").mkdir(parents=True)
        for target in TARGETS:
            found = next(build_dir.rglob(target), None)
            if found is None:
                raise RuntimeError(f"the build produced no {target} (see {log})")
            shutil.copy2(found, staged / "bin" / target)
        (staged / "build.json").write_text(
            json.dumps({"llama_cpp_python": version, "cmake_flags": list(CMAKE_FLAGS)}, indent=2)
        )
        shutil.rmtree(home, ignore_errors=True)  # a partial folder from an older layout
        staged.rename(home)
    return home / "bin"
