"""What one ``eeserve bench report`` run measures: its settings, from the command line.

Contract: ``config_from_args(args)`` turns the ``report`` subcommand's flags into a
``ReportConfig`` (``--quick`` picks smaller defaults); ``canonical_command(cfg)`` is the command
line that reproduces it (recorded in the report).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eeserve.config import BATCH_POLICIES
from eeserve.exit_params import DRAFT_SOURCES


@dataclass(frozen=True)
class _Defaults:
    batch_sizes: str
    max_tokens: int
    repeats: int
    frontier_batch: int
    thresholds: str  # softmax and classifier measures
    cosine_thresholds: str  # hidden_cosine
    paper_texts: int  # teacher-forced held-out texts of the paper section


_FULL = _Defaults("1,8,32", 128, 3, 8, "0.5,0.9,0.99", "0.95,0.98,0.99", 16)
_QUICK = _Defaults("1,8", 32, 1, 8, "0.5,0.9", "0.95,0.99", 4)
SECTIONS = ("exit", "speculative", "paper")
PAPER_TEXT_SOURCES = ("generated", "passages")
# The paper section's thresholds when ``--paper-thresholds`` names none for a measure: from
# "nothing exits" (1.01: no confidence reaches it) down to where about half the layers go.
PAPER_THRESHOLDS = {
    "hidden_cosine": [1.01, 0.999, 0.995, 0.99, 0.98, 0.95],
    "": [1.01, 0.99, 0.9, 0.7, 0.5, 0.3],  # every other measure
}


@dataclass
class ReportConfig:
    model: str = "smollm2"
    out: str = "bench/results/report"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    dtype: str = "auto"
    policies: list[str] = field(default_factory=lambda: ["per_sequence", "batch_all"])
    kv_fills: list[str] = field(default_factory=lambda: ["fill", "recompute"])
    measure: str | None = None  # operating point; default: the exit config's
    threshold: float | None = None
    measures: list[str] | None = None  # frontier; default: all the model supports
    thresholds: list[float] = field(default_factory=lambda: [0.5, 0.9, 0.99])
    cosine_thresholds: list[float] = field(default_factory=lambda: [0.95, 0.98, 0.99])
    frontier_batch: int = 8
    time_budget_min: float = 30.0  # no further repeat starts that would end later; 0: none
    hf: bool = True
    peer: bool = True  # llama.cpp F32 beside full depth, when llama-cpp-python is installed
    chat: bool = True
    threads: int | None = None
    quick: bool = False
    note: str = ""
    command: str = ""
    # "exit": sections 1-4 (early exit as the paper's); "speculative": speculative mode vs full.
    sections: list[str] = field(default_factory=lambda: ["exit", "speculative"])
    num_draft_tokens: list[int] = field(default_factory=lambda: [4])
    # Speculative section: what drafts ("exits": the exit heads; "int8": an int8 copy).
    speculative_drafts: list[str] = field(default_factory=lambda: ["exits", "int8"])
    # Paper section (``bench.report_paper``): policies (KV debt ``fill``), measures (None: the
    # exit config's default), thresholds per measure ("": every measure not named).
    paper_policies: list[str] = field(default_factory=lambda: ["batch_all", "per_sequence", "auto"])
    paper_measures: list[str] | None = None
    paper_thresholds: dict[str, list[float]] = field(default_factory=dict)
    paper_texts: int = 16  # held-out texts of the teacher-forced perplexity
    paper_text_source: str = "generated"  # their full-depth continuations, or the passages

    def thresholds_for(self, measure: str) -> list[float]:
        """The paper section's thresholds of ``measure``."""
        spec = self.paper_thresholds
        if measure in spec or "" in spec:
            return spec.get(measure, spec.get("", []))
        return PAPER_THRESHOLDS.get(measure, PAPER_THRESHOLDS[""])


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse_paper_thresholds(s: str | None) -> dict[str, list[float]]:
    """``0.9,0.5`` (every measure) or ``classifier=1.01,0.9;hidden_cosine=1.01,0.99``."""
    out: dict[str, list[float]] = {}
    for part in (s or "").split(";"):
        if part.strip():
            name, _, values = part.rpartition("=")
            out[name.strip()] = _floats(values)
    return out


def config_from_args(args: argparse.Namespace) -> ReportConfig:
    """Options left unset take the ``--quick`` or the full defaults."""
    base = _QUICK if args.quick else _FULL
    batch_sizes = args.batch_sizes or base.batch_sizes
    if args.batch_sizes is None and not args.quick and torch.cuda.is_available():
        batch_sizes += ",64"
    return ReportConfig(
        model=args.model,
        out=args.out or ("bench/results/quick" if args.quick else "bench/results/report"),
        batch_sizes=[int(b) for b in str(batch_sizes).split(",")],
        max_tokens=args.max_tokens or base.max_tokens,
        repeats=args.repeats or base.repeats,
        seed=args.seed,
        dtype=args.dtype,
        policies=args.policies.split(","),
        kv_fills=args.kv_fills.split(","),
        measure=args.measure,
        threshold=args.threshold,
        measures=args.measures.split(",") if args.measures else None,
        thresholds=_floats(args.thresholds or base.thresholds),
        cosine_thresholds=_floats(args.cosine_thresholds or base.cosine_thresholds),
        frontier_batch=args.frontier_batch or base.frontier_batch,
        time_budget_min=args.time_budget,
        hf=not args.no_hf,
        peer=not args.no_peer,
        chat=args.prompt_format == "chat",
        threads=args.threads,
        quick=args.quick,
        note=args.note,
        command=_command_line(),
        sections=_names(args.sections, SECTIONS, "--sections"),
        num_draft_tokens=[int(n) for n in args.num_draft_tokens.split(",")],
        speculative_drafts=_names(args.speculative_drafts, DRAFT_SOURCES, "--speculative-drafts"),
        paper_policies=_names(args.paper_policies, BATCH_POLICIES, "--paper-policies"),
        paper_measures=args.paper_measures.split(",") if args.paper_measures else None,
        paper_thresholds=parse_paper_thresholds(args.paper_thresholds),
        paper_texts=args.paper_texts if args.paper_texts is not None else base.paper_texts,
        paper_text_source=args.paper_text_source,
    )


def _names(s: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated list of some of ``allowed`` (at least one)."""
    names = [x for x in s.split(",") if x]
    if not names or any(x not in allowed for x in names):
        raise ValueError(f"{flag} must list {' and/or '.join(allowed)}, got {s!r}")
    return names


def _command_line() -> str:
    """The command line as invoked (``sys.argv``)."""
    if Path(sys.argv[0]).name == "eeserve" or sys.argv[0].endswith("eeserve/cli.py"):
        return shlex.join(["eeserve", *sys.argv[1:]])
    return shlex.join(sys.argv)


def canonical_command(cfg: ReportConfig) -> str:
    """An ``eeserve bench report`` command with every option explicit: reruns the same plan."""
    args = [
        "eeserve",
        "bench",
        "report",
        "--model",
        cfg.model,
        "--out",
        cfg.out,
        "--batch-sizes",
        ",".join(map(str, cfg.batch_sizes)),
        "--max-tokens",
        str(cfg.max_tokens),
        "--repeats",
        str(cfg.repeats),
        "--seed",
        str(cfg.seed),
        "--dtype",
        cfg.dtype,
        "--policies",
        ",".join(cfg.policies),
        "--kv-fills",
        ",".join(cfg.kv_fills),
        "--thresholds",
        ",".join(f"{t:g}" for t in cfg.thresholds),
        "--cosine-thresholds",
        ",".join(f"{t:g}" for t in cfg.cosine_thresholds),
        "--frontier-batch",
        str(cfg.frontier_batch),
        "--time-budget",
        f"{cfg.time_budget_min:g}",
        "--prompt-format",
        "chat" if cfg.chat else "raw",
        "--sections",
        ",".join(cfg.sections),
        "--num-draft-tokens",
        ",".join(map(str, cfg.num_draft_tokens)),
        "--speculative-drafts",
        ",".join(cfg.speculative_drafts),
    ]
    for flag, value in (
        ("--measure", cfg.measure),
        ("--threshold", cfg.threshold),
        ("--measures", ",".join(cfg.measures) if cfg.measures else None),
        ("--threads", cfg.threads),
    ):
        if value is not None:
            args += [flag, str(value)]
    args += _paper_args(cfg)
    args += [] if cfg.hf else ["--no-hf"]
    return shlex.join(args + ([] if cfg.peer else ["--no-peer"]))


def _paper_args(cfg: ReportConfig) -> list[str]:
    """The paper section's options, when it runs."""
    if "paper" not in cfg.sections:
        return []
    args = ["--paper-policies", ",".join(cfg.paper_policies), "--paper-texts",
            str(cfg.paper_texts), "--paper-text-source", cfg.paper_text_source]  # fmt: skip
    if cfg.paper_measures:
        args += ["--paper-measures", ",".join(cfg.paper_measures)]
    if cfg.paper_thresholds:
        spec = ";".join(
            f"{m}={','.join(f'{t:g}' for t in ts)}" if m else ",".join(f"{t:g}" for t in ts)
            for m, ts in cfg.paper_thresholds.items()
        )
        args += ["--paper-thresholds", spec]
    return args
