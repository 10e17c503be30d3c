"""Who ``--sections peer`` times against whom: this engine's modes, llama.cpp's files, the order.

Contract: ``PeerFormat`` names the llama.cpp files the section can use (``--peer-formats``): F32
of the model folder's weights, Q8_0 quantised from it, and ``own``: the GGUF file the model ships
as. ``PeerFile`` is one such file with the name llama.cpp gives its format (F32, Q8_0, or the own
file's ``general.file_type``: Q4_1, Q4_K_M). ``EngineRunner`` is one mode of this engine: its
label, its ``EngineConfig`` overrides, the file it is held to (and any it is set beside for
reference), and what one batch-1 decode step of it reads (``Reads``). ``ENGINE_RUNNERS`` are the
modes timed: float32 against F32, int8 and the default mode (speculative, int8 drafts, float32's
tokens) against Q8_0, and native weights (``weights="native"``) at full depth and in the default
mode (speculative, exit drafts) against the very file they are read from. A mode added to
``ENGINE_RUNNERS`` is built, timed, paired and counted with no other change.
``round_order(files, runners)`` is one round at one batch size: per file, llama.cpp on it, then
each engine held to it, so that every pair runs back to back; ``pairs(files, runners)`` the
ratios taken. ``bytes_per_token(runner, engine, folder, files)`` is what the roofline divides by
(``bench.roofline``), None for a mode whose reads vary from step to step (speculative).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from eeserve.bench.peer_summary import Pair
from eeserve.bench.roofline import engine_bytes_per_token, gguf_bytes_per_token
from eeserve.config import ExitPolicy, Quantization, Weights
from eeserve.engine.llm_engine import LLMEngine
from eeserve.kernels.screened_head import ScreenedHead


class PeerFormat(StrEnum):
    F32 = "F32"  # the model folder's weights, exactly (bench.llamacpp.f32_gguf)
    Q8_0 = "Q8_0"  # llama-quantize's Q8_0 of that F32 file
    OWN = "own"  # the GGUF the model ships as: a named model's, or the .gguf given


class Reads(StrEnum):
    """What a batch-1 decode step of a runner reads, for its roofline."""

    FLOAT32 = "float32"  # float32 projections (the LM head through its int8 screen if screened)
    INT8 = "int8"  # int8 projections and LM head, a float32 scale per 32 weights
    FILE = "file"  # the blocks of the GGUF it is held to, as stored (as llama.cpp reads them)
    VARIES = "varies"  # drafts and verifications: no one count


@dataclass(frozen=True, kw_only=True)
class PeerFile:
    source: PeerFormat
    name: str  # llama.cpp's name of the file's format: F32, Q8_0, Q4_1, Q4_K_M
    path: Path

    @property
    def label(self) -> str:
        return f"llama.cpp {self.name}"


@dataclass(frozen=True, kw_only=True)
class EngineRunner:
    label: str
    overrides: Mapping[str, Any]  # EngineConfig fields beside the section's own
    held_to: PeerFormat
    reads: Reads
    references: tuple[PeerFormat, ...] = field(default=())  # also set beside, for reference


ENGINE_RUNNERS = (
    EngineRunner(
        label="eeserve float32",
        overrides=MappingProxyType({"quantization": None, "exit_policy": ExitPolicy.NONE}),
        held_to=PeerFormat.F32,
        reads=Reads.FLOAT32,
    ),
    EngineRunner(
        label="eeserve int8",
        overrides=MappingProxyType(
            {"quantization": Quantization.INT8, "exit_policy": ExitPolicy.NONE}
        ),
        held_to=PeerFormat.Q8_0,
        reads=Reads.INT8,
        # The model's own file reads fewer bytes a token than int8 does.
        references=(PeerFormat.OWN,),
    ),
    # The model's default mode: speculative, int8 drafts of the float32 weights.
    EngineRunner(
        label="eeserve default",
        overrides=MappingProxyType({}),
        held_to=PeerFormat.Q8_0,
        reads=Reads.VARIES,
    ),
    EngineRunner(
        label="eeserve native",
        overrides=MappingProxyType({"weights": Weights.NATIVE, "exit_policy": ExitPolicy.NONE}),
        held_to=PeerFormat.OWN,
        reads=Reads.FILE,
    ),
    # The default mode on native weights: speculative, drafted at the exits (native weights
    # have no int8 copy), full depth's tokens.
    EngineRunner(
        label="eeserve native default",
        overrides=MappingProxyType({"weights": Weights.NATIVE}),
        held_to=PeerFormat.OWN,
        reads=Reads.VARIES,
    ),
)


def runners_for(files: list[PeerFile], runners: tuple[EngineRunner, ...]) -> list[EngineRunner]:
    """The runners whose file is there (no own file, no native weights)."""
    have = {f.source for f in files}
    return [r for r in runners if r.held_to in have]


def round_order(files: list[PeerFile], runners: tuple[EngineRunner, ...]) -> list[str]:
    out = []
    for f in files:
        out += [f.label, *(r.label for r in runners if r.held_to is f.source)]
    return out


def pairs(files: list[PeerFile], runners: tuple[EngineRunner, ...]) -> list[Pair]:
    """(engine, llama.cpp) per runner and file it is held to, then the reference pairs."""
    label = {f.source: f.label for f in files}
    mine = [r for r in runners if r.held_to in label]
    held = [(r.label, label[r.held_to]) for r in mine]
    return held + [(r.label, label[s]) for r in mine for s in r.references if s in label]


def screens_head(engine: LLMEngine) -> bool:
    """Does the engine read its LM head through an int8 screen (``kernels.screened_head``)?"""
    return isinstance(engine.runner.lm_head, ScreenedHead)


def bytes_per_token(
    runner: EngineRunner, engine: LLMEngine, folder: Path, files: list[PeerFile]
) -> int | None:
    """Bytes a batch-1 step of ``runner`` reads (greedy float32 steps read the LM head through
    its int8 screen where there is one); None where they vary."""
    if runner.reads is Reads.FLOAT32:
        return engine_bytes_per_token(folder, "float32", screens_head(engine))
    if runner.reads is Reads.INT8:
        return engine_bytes_per_token(folder, "int8")
    if runner.reads is Reads.FILE:
        # Native weights read the file's blocks as stored, norms in float32 as the file holds
        # them, and a tied LM head from the embedding's blocks: llama.cpp's count of that file.
        held = next(f for f in files if f.source is runner.held_to)
        return gguf_bytes_per_token(held.path)
    return None
