"""``eeserve bench --sections peer``: this engine against llama.cpp's own batched bench, A B A B.

Contract: llama.cpp's native ``llama-batched-bench`` (``bench.llamacpp_build``: built once from
the source vendored in the llama-cpp-python sdist, cached under ``$EESERVE_HOME/llamacpp``) runs
on GGUFs of the same weights (``bench.llamacpp``: F32 of the model folder's weights, Q8_0 made
from it by ``llama-quantize``, and the model's own file: the default model's Q4_1,
``gemma3-270m``'s Q4_K_M, or the ``.gguf`` given as the model). ``bench.peer_runners`` says which
of this engine's modes is held to which file: float32 to F32; int8 and the default mode
(speculative, lossless against float32) to Q8_0; native weights at full depth
(``weights="native"``) to the model's own file, the very blocks llama.cpp reads. Each round, for
each batch size, runs every file's llama.cpp and then the engines held to it, back to back, with
the same thread count, prompt length and decode steps (``bench.llamacpp_native`` says how the two
are timed alike); every timed run follows an untimed pause so that one runner's spinning threads
are not charged to the next. Before each round a streaming-read probe measures the memory
bandwidth (``bench.roofline``). ``bench.peer_summary`` turns the rounds into the median and
spread of the per-round ratios and, at batch 1, each runner's fraction of its roofline (native
weights: the bytes of the file's blocks a token reads). Beside them: greedy token agreement and
ROUGE-L of each mode against float32, and held-out perplexity of float32 and int8. The results
record the machine (``tuning.provenance``: CPU model, ISA flags, the kernel path that ran).
Without cmake or a compiler the section is skipped and says what is missing.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from eeserve.bench import llamacpp
from eeserve.bench.llamacpp_build import BuildToolMissing, NativeTools, native_tools
from eeserve.bench.llamacpp_native import run_batched_bench
from eeserve.bench.measure import Run, quality_vs, run_engine
from eeserve.bench.peer_runners import (
    ENGINE_RUNNERS,
    EngineRunner,
    PeerFile,
    PeerFormat,
    bytes_per_token,
    pairs,
    round_order,
    runners_for,
)
from eeserve.bench.peer_summary import Round, print_summary, roofline_rows, summarise
from eeserve.bench.perplexity import heldout_perplexity
from eeserve.bench.roofline import gguf_bytes_per_token, read_bandwidth
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts
from eeserve.tuning.provenance import provenance

REFERENCE = "eeserve float32"  # what every other mode's text is compared with
# Untimed pause before each run: the previous runner's OpenMP threads (PyTorch's or llama.cpp's)
# spin for a moment after their last work; on 2 cores that spin would be charged to the next one.
_SETTLE_S = 0.5

Runner = Callable[[int], float]  # batch size -> decode tok/s of one timed run


def _formats(text: str) -> list[PeerFormat]:
    names = [f for f in text.split(",") if f]
    choices = tuple(f.value for f in PeerFormat)
    if unknown := sorted(set(names) - set(choices)):
        raise ValueError(f"--peer-formats: unknown {unknown}; choose from {choices}")
    return [PeerFormat(f) for f in names]


def _files(
    spec: str, folder: Path, tools: NativeTools, formats: list[PeerFormat]
) -> list[PeerFile]:
    """llama.cpp's files, the model's own last (none for a folder that is not a named model)."""
    out = []
    if PeerFormat.F32 in formats:
        f32 = llamacpp.f32_gguf(folder, tools.quantize)
        out.append(PeerFile(source=PeerFormat.F32, name="F32", path=f32))
    if PeerFormat.Q8_0 in formats:
        q8 = llamacpp.q8_0_gguf(folder, tools.quantize)
        out.append(PeerFile(source=PeerFormat.Q8_0, name="Q8_0", path=q8))
    own = llamacpp.model_file(spec, folder) if PeerFormat.OWN in formats else None
    if own is not None:
        # A .gguf model in F32 or Q8_0 would share a label with the file made from its folder.
        name = own[0] if own[0] not in {f.name for f in out} else f"{own[0]}, own file"
        out.append(PeerFile(source=PeerFormat.OWN, name=name, path=own[1]))
    return out


def _engines(args: argparse.Namespace, runners: list[EngineRunner]) -> dict[str, LLMEngine]:
    max_batch = max(int(b) for b in args.batch_sizes.split(","))
    cfg = dict(dtype="float32", enable_prefix_caching=False, max_num_seqs=max_batch)
    return {
        r.label: LLMEngine(EngineConfig(model=args.model, **{**cfg, **r.overrides}))
        for r in runners
    }


def _peer_runner(tools: NativeTools, gguf: Path, threads: int, args: argparse.Namespace) -> Runner:
    def run(batch: int) -> float:
        rows = run_batched_bench(
            tools.batched_bench, gguf, threads, args.prompt_len, args.max_tokens - 1, [batch]
        )
        return rows[batch].decode_tok_s

    return run


def _round(runners: dict[str, Runner], batches: list[int], order: list[str]) -> Round:
    out: Round = {}
    for b in batches:
        out[b] = {}
        for label in order:
            if label in runners:
                time.sleep(_SETTLE_S)
                out[b][label] = runners[label](b)
    return out


def _engine_runner(
    engine: LLMEngine,
    label: str,
    prompts: list[list[int]],
    max_tokens: int,
    last: dict[tuple[str, int], Run],
) -> Runner:
    def run(batch: int) -> float:
        res = run_engine(engine, prompts[:batch], max_tokens)
        last[(label, batch)] = res  # the latest outputs, for the quality columns
        return res.decode_tokens_per_s

    return run


def _rounds(
    runners: dict[str, Runner], batches: list[int], order: list[str], threads: int, repeats: int
) -> tuple[list[Round], list[float]]:
    """``repeats`` rounds, each after a probe of the read bandwidth (bytes/s) it ran at."""
    rounds: list[Round] = []
    bandwidths: list[float] = []
    for i in range(repeats):
        bandwidths.append(read_bandwidth(threads))
        print(
            f"round {i + 1}/{repeats}: read bandwidth {bandwidths[-1] / 1e9:.1f} GB/s", flush=True
        )
        rounds.append(_round(runners, batches, order))
    return rounds, bandwidths


def _quality(
    last: dict[tuple[str, int], Run], batches: list[int], labels: list[str], tok: Any
) -> dict[str, Any]:
    """Greedy token agreement and ROUGE-L of each mode's latest text against float32's."""
    out: dict[str, Any] = {}
    for b in batches:
        ref = last.get((REFERENCE, b))
        for label in labels:
            if ref is not None and label != REFERENCE and (label, b) in last:
                agree, rouge = quality_vs(ref, last[(label, b)], tok)
                key = f"{label.removeprefix('eeserve ')}_vs_float32"
                out.setdefault(str(b), {})[key] = {"token_agreement": agree, "rouge_l": rouge}
                print(f"batch {b:3d} {label} vs float32: agreement {agree:.3f} ROUGE-L {rouge:.3f}")
    return out


def _timed(
    args: argparse.Namespace,
    tools: NativeTools,
    files: list[PeerFile],
    engines: dict[str, LLMEngine],
    prompts: list[list[int]],
    batches: list[int],
) -> tuple[dict[str, Runner], dict[tuple[str, int], Run]]:
    """Every runner by label, the engines warmed up; and where the engines' latest runs go."""
    threads = args.threads or torch.get_num_threads()
    last: dict[tuple[str, int], Run] = {}
    runners = {f.label: _peer_runner(tools, f.path, threads, args) for f in files}
    for label, engine in engines.items():
        for b in batches:  # warm-up: kernels built, caches touched, every batch shape seen
            run_engine(engine, prompts[:b], 4)
        runners[label] = _engine_runner(engine, label, prompts, args.max_tokens, last)
    return runners, last


def _what_ran(files: list[PeerFile], runners: list[EngineRunner]) -> dict[str, Any]:
    """The files and the engine modes, as the results record them."""
    return {
        "ggufs": {f.name: str(f.path) for f in files},
        "engine_runners": {
            r.label: {
                "config": {k: None if v is None else str(v) for k, v in r.overrides.items()},
                "held_to": next(f.label for f in files if f.source is r.held_to),
                "reads": r.reads.value,
            }
            for r in runners
        },
    }


def bench_peer(args: argparse.Namespace) -> dict[str, Any]:
    try:
        tools = native_tools()
    except BuildToolMissing as e:
        print(f"peer section skipped: {e}")
        return {"skipped": str(e)}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    threads = args.threads or torch.get_num_threads()
    folder = resolve_model(args.model)
    files = _files(args.model, folder, tools, _formats(args.peer_formats))
    runners = runners_for(files, ENGINE_RUNNERS)
    tok = AutoTokenizer.from_pretrained(folder)
    texts = prompt_texts(max(batches), seed=args.seed, split="bench")
    prompts = fixed_length_ids(tok, texts, args.prompt_len)
    engines = _engines(args, runners)
    timed, last = _timed(args, tools, files, engines, prompts, batches)
    order = round_order(files, tuple(runners))
    rounds, bandwidths = _rounds(timed, batches, order, threads, args.repeats)
    nbytes = {f.label: gguf_bytes_per_token(f.path) for f in files}
    for r in runners:
        if (n := bytes_per_token(r, engines[r.label], folder, files)) is not None:
            nbytes[r.label] = n
    rows = summarise(rounds, pairs(files, tuple(runners)))
    roofline = roofline_rows(rounds, bandwidths, nbytes)
    print_summary(rows, roofline, len(rounds))
    quality = _quality(last, batches, list(engines), tok)
    ppl = {name: heldout_perplexity(folder, name == "int8") for name in ("float32", "int8")}
    print(f"held-out perplexity: float32 {ppl['float32']:.3f}  int8 {ppl['int8']:.3f}", flush=True)
    return {
        "provenance": provenance(),
        "llama_cpp_python_sdist": tools.version,
        **_what_ran(files, runners),
        "threads": threads,
        "prompt_len": args.prompt_len,
        "decode_steps": args.max_tokens - 1,
        "read_bandwidth_bytes_per_s": bandwidths,
        "bytes_per_token": nbytes,
        "rounds": [{str(b): tps for b, tps in r.items()} for r in rounds],
        "rows": rows,
        "roofline_batch1": roofline,
        "quality": quality,
        "heldout_perplexity": ppl,
        "load_average_end": os.getloadavg(),
    }
