"""``eeserve bench structured``: what constrained decoding costs and what it buys, side by side.

Contract: ``add_structured_parser(subparsers)`` registers the command; ``run_structured(args)``
runs the extraction and classification workloads (``tuning.structured_workloads``) at each batch
size under each mode, greedy, alternated over ``--rounds`` (every mode once per round, in a rotated
order), and writes one JSON file with the command, commit and machine. Modes (``Mode``):
``free`` unconstrained full depth; ``free_matched`` the same with each output exactly as long as
constrained full depth's for its prompt (the same work without the grammar: constrained
decoding's cost is measured against it); ``constrained`` full depth under the constraint, every
token its own pass; ``jump_forward`` the same with forced tokens appended without a pass of their
own; ``exits`` jump-forward plus exit mode at the model's default exit rule; ``default`` the
engine's default mode (speculative) under the constraint; ``hf`` HF transformers' ``generate``
with the same compiled grammar as a logits processor (``bench.structured_hf``); ``llamacpp``
llama.cpp's ``llama-server`` on the model's own GGUF with its own constraint path
(``bench.structured_llamacpp``; built once, skipped where cmake or a compiler is missing). Per
workload, batch and mode: output tokens per second and valid outputs per second (medians over
rounds), valid rate, forced and exited tokens, mean exit layer of the chosen tokens, token and
field agreement with ``constrained``, and accuracy against the texts' own answers. A batch of B
runs max(B, ``--min-prompts``) prompts in groups of B.
"""

from __future__ import annotations

import argparse
import enum
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eeserve.bench.llamacpp import own_gguf
from eeserve.bench.llamacpp_build import missing_tools, native_tools
from eeserve.bench.structured_hf import HFConstrained
from eeserve.bench.structured_llamacpp import LlamaServer
from eeserve.exit_params import ExitParams
from eeserve.llm import LLM
from eeserve.outputs import CompletionOutput
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.provenance import provenance
from eeserve.tuning.quality import token_agreement
from eeserve.tuning.structured_workloads import (
    Workload,
    classification,
    extraction,
    field_agreement,
)

# llama-server's KV room a slot gives each prompt, besides its --max-tokens (the workloads'
# chat-templated prompts hold 100-250 tokens).
PROMPT_ROOM = 512


class Mode(enum.StrEnum):
    FREE = "free"
    # Unconstrained, each output exactly as long as constrained full depth's for its prompt:
    # the same work without the grammar, the base of constrained decoding's cost.
    FREE_MATCHED = "free_matched"
    CONSTRAINED = "constrained"
    JUMP_FORWARD = "jump_forward"
    EXITS = "exits"
    DEFAULT = "default"
    HF = "hf"  # HF transformers generate, the same grammar as a logits processor
    LLAMACPP = "llamacpp"  # llama-server on the model's own GGUF, its json_schema -> GBNF


@dataclass(kw_only=True)
class Cell:
    """One workload x batch x mode."""

    workload: str
    batch: int
    mode: str
    tokens_per_s: list[float] = field(default_factory=list)  # one per round
    valid_per_s: list[float] = field(default_factory=list)  # outputs that satisfy the constraint
    valid_tokens_per_s: list[float] = field(default_factory=list)  # the tokens of those
    num_requests: int = 0
    output_tokens: int = 0
    valid_rate: float = 0.0
    accuracy: float = 0.0  # fields equal to the text's own answer
    forced_tokens: int = 0
    exited_tokens: int = 0  # chosen at an exit layer (forced ones apart)
    mean_exit_layer: float = 0.0
    token_agreement: float | None = None  # with ``constrained`` (None: that is this mode)
    field_agreement: float | None = None


def _exit_params(mode: Mode, threshold: float | None) -> ExitParams | None:
    if mode is Mode.DEFAULT:
        return None  # the engine's default exit rule for the model (speculative)
    if mode is Mode.EXITS:
        return ExitParams(mode="exit", threshold=threshold)
    return ExitParams(enabled=False)


def _params(
    w: Workload, mode: Mode, n: int, lengths: list[int], args: argparse.Namespace
) -> list[SamplingParams]:
    """Per prompt: greedy, under the workload's constraint but in the free modes; the matched
    mode's outputs run to ``lengths``, those of constrained full depth's."""
    if mode is Mode.FREE_MATCHED:
        return [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths[:n]]
    constraint = None if mode is Mode.FREE else w.constraint
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=constraint)
    return [sp] * n


def _generate(
    llm: LLM,
    w: Workload,
    mode: Mode,
    batch: int,
    sps: list[SamplingParams],
    args: argparse.Namespace,
) -> tuple[list[CompletionOutput], float]:
    n = len(sps)
    prompts = [llm.apply_chat_template(c) for c in w.prompts[:n]]
    outs: list[CompletionOutput] = []
    ep = _exit_params(mode, args.exit_threshold)
    start = time.perf_counter()
    for i in range(0, n, batch):
        got = llm.generate(
            prompts[i : i + batch], sps[i : i + batch], exit_params=ep, use_tqdm=False
        )
        outs += [r.outputs[0] for r in got]
    return outs, time.perf_counter() - start


def _generate_hf(
    hf: HFConstrained, llm: LLM, w: Workload, batch: int, n: int, args: argparse.Namespace
) -> tuple[list[CompletionOutput], float]:
    prompts = [llm.apply_chat_template(c) for c in w.prompts[:n]]
    grammar = llm.engine.grammars.compile(w.constraint)
    ids, dt = hf.generate(prompts, grammar, batch, args.max_tokens)
    full = llm.engine.model_config.num_layers
    outs = []
    for r in ids:
        text = llm.tokenizer.decode([t for t in r if t != hf.eos], skip_special_tokens=True)
        outs.append(_peer_output(text, r, bool(r) and r[-1] == hf.eos, full))
    return outs, dt


def _generate_llamacpp(
    server: LlamaServer, llm: LLM, w: Workload, batch: int, n: int, args: argparse.Namespace
) -> tuple[list[CompletionOutput], float]:
    """The prompts' token ids (the engine's template and tokenizer) through llama-server."""
    prompts = [llm.apply_chat_template(c) for c in w.prompts[:n]]
    got = []
    start = time.perf_counter()
    for i in range(0, n, batch):
        got += server.generate(prompts[i : i + batch], w.constraint, args.max_tokens)
    dt = time.perf_counter() - start
    full = llm.engine.model_config.num_layers
    return [_peer_output(g.text, g.token_ids, g.stopped, full) for g in got], dt


def _peer_output(text: str, token_ids: list[int], stopped: bool, full: int) -> CompletionOutput:
    """A peer's answer as the engine's output at full depth (nothing forced, nothing exited)."""
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        finish_reason="stop" if stopped else "length",
        exit_layers=[full] * len(token_ids),
        forced=[False] * len(token_ids),
    )


def _score(cell: Cell, w: Workload, outs: list[CompletionOutput], num_layers: int) -> None:
    cell.num_requests = len(outs)
    cell.output_tokens = sum(len(c.token_ids) for c in outs)
    cell.valid_rate = sum(w.valid(c.text) for c in outs) / len(outs)
    cell.accuracy = statistics.mean(
        field_agreement(w.fields(c.text), t) for c, t in zip(outs, w.truth)
    )
    chosen = [e for c in outs for e, f in zip(c.exit_layers, c.forced) if not f]
    cell.forced_tokens = sum(sum(c.forced) for c in outs)
    cell.exited_tokens = sum(e < num_layers for e in chosen)
    cell.mean_exit_layer = statistics.mean(chosen) if chosen else float(num_layers)


def _agreement(cell: Cell, w: Workload, outs: list[CompletionOutput], ref: list[Any]) -> None:
    cell.token_agreement = statistics.mean(
        token_agreement(c.token_ids, r.token_ids) for c, r in zip(outs, ref)
    )
    cell.field_agreement = statistics.mean(
        field_agreement(w.fields(c.text), w.fields(r.text)) for c, r in zip(outs, ref)
    )


@dataclass(kw_only=True)
class Contenders:
    """What runs each mode: the engine, the engine without jump-forward, HF transformers."""

    llm: LLM
    plain: LLM
    hf: HFConstrained | None
    llama: LlamaServer | None
    # Per workload, batch and number of prompts: the lengths of constrained full depth's
    # outputs (``Mode.FREE_MATCHED``).
    lengths: dict[str, list[int]] = field(default_factory=dict)

    def run(
        self, w: Workload, m: Mode, batch: int, n: int, args: argparse.Namespace
    ) -> tuple[list[CompletionOutput], float]:
        if m is Mode.HF:
            assert self.hf is not None
            return _generate_hf(self.hf, self.llm, w, batch, n, args)
        if m is Mode.LLAMACPP:
            assert self.llama is not None
            return _generate_llamacpp(self.llama, self.llm, w, batch, n, args)
        key = f"{w.name}/{batch}/{n}"
        if m is Mode.FREE_MATCHED and key not in self.lengths:  # untimed
            outs, _ = self.run(w, Mode.CONSTRAINED, batch, n, args)
            self.lengths[key] = [len(c.token_ids) for c in outs]
        sps = _params(w, m, n, self.lengths.get(key, []), args)
        return _generate(self.plain if m is Mode.CONSTRAINED else self.llm, w, m, batch, sps, args)

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()


def _contenders(
    model: str, modes: list[Mode], batches: list[int], args: argparse.Namespace
) -> Contenders:
    llm = LLM(model)
    # Full depth under the constraint, every token its own pass: jump-forward off.
    plain = (
        LLM(model, jump_forward=False)
        if {Mode.CONSTRAINED, Mode.FREE_MATCHED} & set(modes)
        else llm
    )
    hf = None
    if Mode.HF in modes:
        eos = llm.engine.grammars.eos_token_id
        pad = llm.tokenizer.pad_token_id
        hf = HFConstrained(llm.engine.model_path, eos=eos, pad=eos if pad is None else int(pad))
    llama = None
    if Mode.LLAMACPP in modes:
        own = own_gguf(llm.engine.model_path)
        if own is None:
            raise SystemExit(f"--modes llamacpp: {model} has no GGUF of its own to give llama.cpp")
        slots = max(batches)
        ctx = slots * (PROMPT_ROOM + args.max_tokens)
        threads = torch.get_num_threads()
        llama = LlamaServer(native_tools().server, own[1], threads=threads, slots=slots, ctx=ctx)
    return Contenders(llm=llm, plain=plain, hf=hf, llama=llama)


def run_structured(args: argparse.Namespace) -> int:
    modes = [Mode(m) for m in args.modes.split(",")]
    if Mode.LLAMACPP in modes and (missing := missing_tools()):
        print(f"no llamacpp mode: building llama.cpp needs {' and '.join(missing)}")
        modes.remove(Mode.LLAMACPP)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    most = max(max(batches), args.min_prompts)
    names = args.workloads.split(",")
    workloads = [w for w in (extraction(most), classification(most)) if w.name in names]
    runs = _contenders(args.model, modes, batches, args)
    try:
        cells = _rounds(runs, workloads, modes, batches, args)
    finally:
        runs.close()
    _write(args, [cells[k] for k in sorted(cells, key=lambda k: (k[0], k[1], modes.index(k[2])))])
    return 0


def _rounds(
    runs: Contenders,
    workloads: list[Workload],
    modes: list[Mode],
    batches: list[int],
    args: argparse.Namespace,
) -> dict[tuple[str, int, Mode], Cell]:
    """Every workload x batch x mode, once a round, the modes in a rotated order each round."""
    num_layers = runs.llm.engine.model_config.num_layers
    cells: dict[tuple[str, int, Mode], Cell] = {}
    outputs: dict[tuple[str, int, Mode], list[CompletionOutput]] = {}
    for w in workloads:  # warm-up: kernels, grammars, first-call costs
        for m in modes:
            runs.run(w, m, 1, 1, args)
    for r in range(args.rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for w in workloads:
            for b in batches:
                n = max(b, args.min_prompts)
                for m in order:
                    outs, dt = runs.run(w, m, b, n, args)
                    cell = cells.setdefault((w.name, b, m), Cell(workload=w.name, batch=b, mode=m))
                    valid = [c for c in outs if w.valid(c.text)]
                    cell.tokens_per_s.append(sum(len(c.token_ids) for c in outs) / dt)
                    cell.valid_per_s.append(len(valid) / dt)
                    cell.valid_tokens_per_s.append(sum(len(c.token_ids) for c in valid) / dt)
                    outputs[(w.name, b, m)] = outs
                    _score(cell, w, outs, num_layers)
    for (name, b, m), cell in cells.items():
        ref = outputs.get((name, b, Mode.CONSTRAINED))
        w = next(w for w in workloads if w.name == name)
        if ref is not None and m is not Mode.CONSTRAINED:
            _agreement(cell, w, outputs[(name, b, m)], ref)
    return cells


def _write(args: argparse.Namespace, cells: list[Cell]) -> None:
    rows = []
    for c in cells:
        row = asdict(c)
        for name in ("tokens_per_s", "valid_per_s", "valid_tokens_per_s"):
            row[f"median_{name}"] = statistics.median(row[name])
        rows.append(row)
    result = {"provenance": provenance(), "model": args.model, "rounds": args.rounds, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(rows))
    print(f"wrote {out}")


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per cell, with its speed against ``constrained`` at the same batch."""
    base = {(r["workload"], r["batch"]): r["median_tokens_per_s"] for r in rows
            if r["mode"] == Mode.CONSTRAINED}  # fmt: skip
    lines = []
    for r in rows:
        ref = base.get((r["workload"], r["batch"]))
        ratio = f"{r['median_tokens_per_s'] / ref:5.2f}x" if ref else "     "
        agree = r["token_agreement"]
        lines.append(
            f"{r['workload']:<14} b{r['batch']:<3} {r['mode']:<12} "
            f"{r['median_tokens_per_s']:7.1f} tok/s {ratio}  valid {r['valid_rate']:.2f} "
            f"({r['median_valid_per_s']:5.2f}/s)  "
            f"acc {r['accuracy']:.2f}  forced {r['forced_tokens']:4d}  "
            f"exited {r['exited_tokens']:4d}  exit {r['mean_exit_layer']:5.1f}  "
            f"agree {'-' if agree is None else f'{agree:.3f}'}"
        )
    return "\n".join(lines)


def add_structured_parser(sub: Any) -> None:
    p = sub.add_parser(
        "structured", help="structured outputs: constrained decoding's cost and exits under it"
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--workloads", default="extraction,classification")
    p.add_argument(
        "--modes",
        default=",".join(m.value for m in Mode),
        help="comma-separated: " + ", ".join(m.value for m in Mode),
    )
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--min-prompts", type=int, default=8, help="prompts per batch size at least")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds (median speed)")
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="the exits mode's threshold (default: the model's exit config)",
    )
    p.add_argument("--out", default="bench/results/structured/structured.json")
    p.set_defaults(func=run_structured)
