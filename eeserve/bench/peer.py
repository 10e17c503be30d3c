"""``eeserve bench --sections peer``: this engine against llama.cpp's own batched bench, A B A B.

Contract: llama.cpp's native ``llama-batched-bench`` (``bench.llamacpp_build``: built once from
the source vendored in the llama-cpp-python sdist, cached under ``$EESERVE_HOME/llamacpp``) runs
on GGUFs of the same weights (``bench.llamacpp``: F32 of the model folder's weights, Q8_0 made
from it by ``llama-quantize``, and a named model's own GGUF for reference: the default model's
Q4_1, ``gemma3-270m``'s Q4_K_M). Each round, for each batch size, runs back to back, with the
same thread count, prompt length and decode steps (``bench.llamacpp_native`` says how the two
are timed alike): llama.cpp F32, eeserve float32, llama.cpp Q8_0, eeserve int8, eeserve's
default mode (speculative, lossless against float32), llama.cpp on the model's own GGUF; every
timed run follows an untimed pause so that one runner's spinning threads are not charged to the
next. Before each round a streaming-read probe measures the memory bandwidth
(``bench.roofline``). ``bench.peer_summary`` turns the rounds into the median and spread of the
per-round ratios and, at batch 1, each runner's fraction of its roofline. Beside them: greedy
token agreement and ROUGE-L of int8 and of the default mode against float32, and held-out
perplexity of float32 and int8. Without cmake or a compiler the section is skipped and says what
is missing.
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
from eeserve.bench.peer_summary import Pair, Round, print_summary, roofline_rows, summarise
from eeserve.bench.perplexity import heldout_perplexity
from eeserve.bench.roofline import engine_bytes_per_token, gguf_bytes_per_token, read_bandwidth
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.kernels.screened_head import ScreenedHead
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts
from eeserve.tuning.provenance import provenance

# ``own``: the GGUF a named model is converted from (its label is its format: Q4_1, Q4_K_M).
FORMATS = ("F32", "Q8_0", "own")
# This engine's runners: label -> (EngineConfig overrides, llama.cpp format it needs).
ENGINES: dict[str, tuple[dict[str, Any], str]] = {
    "eeserve float32": ({"quantization": None, "exit_policy": "none"}, "F32"),
    "eeserve int8": ({"quantization": "int8", "exit_policy": "none"}, "Q8_0"),
    "eeserve default": ({}, "Q8_0"),  # the model's default mode: speculative, int8 drafts
}
# One round at one batch size, in this order: each engine right after the peer it is held to;
# then llama.cpp on the model's own GGUF, if any.
ORDER = ("llama.cpp F32", "eeserve float32", "llama.cpp Q8_0", "eeserve int8", "eeserve default")
PAIRS: list[Pair] = [
    ("eeserve float32", "llama.cpp F32"),
    ("eeserve int8", "llama.cpp Q8_0"),
    ("eeserve default", "llama.cpp Q8_0"),
]
# Untimed pause before each run: the previous runner's OpenMP threads (PyTorch's or llama.cpp's)
# spin for a moment after their last work; on 2 cores that spin would be charged to the next one.
_SETTLE_S = 0.5

Runner = Callable[[int], float]  # batch size -> decode tok/s of one timed run


def _ggufs(folder: Path, tools: NativeTools, formats: list[str]) -> dict[str, Path]:
    """Format name -> GGUF; the model's own file under its format's name (none for a folder
    that is not a named model)."""
    out = {}
    if "F32" in formats:
        out["F32"] = llamacpp.f32_gguf(folder, tools.quantize)
    if "Q8_0" in formats:
        out["Q8_0"] = llamacpp.q8_0_gguf(folder, tools.quantize)
    own = llamacpp.own_gguf(folder) if "own" in formats else None
    if own is not None:
        out[own[0]] = own[1]
    return out


def _order_and_pairs(ggufs: dict[str, Path]) -> tuple[list[str], list[Pair]]:
    """The round's order and the pairs compared, with the model's own GGUF last: for reference,
    as it reads fewer bytes a token than int8 does."""
    own = [f"llama.cpp {fmt}" for fmt in ggufs if fmt not in ("F32", "Q8_0")]
    return [*ORDER, *own], [*PAIRS, *(("eeserve int8", label) for label in own)]


def screens_head(engine: LLMEngine) -> bool:
    """Does the engine read its LM head through an int8 screen (``kernels.screened_head``)?"""
    return isinstance(engine.runner.lm_head, ScreenedHead)


def _engine_bytes(folder: Path, engines: dict[str, LLMEngine]) -> dict[str, int]:
    """Bytes a batch-1 step of each engine reads (greedy float32 steps read the LM head through
    its int8 screen where there is one)."""
    out = {}
    for scheme in ("float32", "int8"):
        engine = engines.get(f"eeserve {scheme}")
        if engine is not None:
            out[f"eeserve {scheme}"] = engine_bytes_per_token(folder, scheme, screens_head(engine))
    return out


def _engines(args: argparse.Namespace, formats: set[str], max_batch: int) -> dict[str, LLMEngine]:
    out = {}
    for label, (overrides, needs) in ENGINES.items():
        if needs in formats:
            cfg = dict(dtype="float32", enable_prefix_caching=False, max_num_seqs=max_batch)
            out[label] = LLMEngine(EngineConfig(model=args.model, **{**cfg, **overrides}))
    return out


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


def _quality(last: dict[tuple[str, int], Run], batches: list[int], tok: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in batches:
        ref = last.get(("eeserve float32", b))
        for label in ("eeserve int8", "eeserve default"):
            if ref is not None and (label, b) in last:
                agree, rouge = quality_vs(ref, last[(label, b)], tok)
                key = f"{label.split()[1]}_vs_float32"
                out.setdefault(str(b), {})[key] = {"token_agreement": agree, "rouge_l": rouge}
                print(f"batch {b:3d} {label} vs float32: agreement {agree:.3f} ROUGE-L {rouge:.3f}")
    return out


def bench_peer(args: argparse.Namespace) -> dict[str, Any]:
    try:
        tools = native_tools()
    except BuildToolMissing as e:
        print(f"peer section skipped: {e}")
        return {"skipped": str(e)}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    formats = [f for f in args.peer_formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        raise ValueError(f"--peer-formats: unknown {sorted(unknown)}; choose from {FORMATS}")
    threads = args.threads or torch.get_num_threads()
    folder = resolve_model(args.model)
    ggufs = _ggufs(folder, tools, formats)
    order, pairs = _order_and_pairs(ggufs)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = fixed_length_ids(
        tok, prompt_texts(max(batches), seed=args.seed, split="bench"), args.prompt_len
    )
    last: dict[tuple[str, int], Run] = {}
    runners: dict[str, Runner] = {
        f"llama.cpp {fmt}": _peer_runner(tools, path, threads, args) for fmt, path in ggufs.items()
    }
    engines = _engines(args, set(ggufs), max(batches))
    for label, engine in engines.items():
        for b in batches:  # warm-up: kernels built, caches touched, every batch shape seen once
            run_engine(engine, prompts[:b], 4)
        runners[label] = _engine_runner(engine, label, prompts, args.max_tokens, last)
    rounds, bandwidths = _rounds(runners, batches, order, threads, args.repeats)
    nbytes = {f"llama.cpp {fmt}": gguf_bytes_per_token(path) for fmt, path in ggufs.items()}
    nbytes |= _engine_bytes(folder, engines)
    rows = summarise(rounds, pairs)
    roofline = roofline_rows(rounds, bandwidths, nbytes)
    print_summary(rows, roofline, len(rounds))
    quality = _quality(last, batches, tok)
    ppl = {name: heldout_perplexity(folder, name == "int8") for name in ("float32", "int8")}
    print(f"held-out perplexity: float32 {ppl['float32']:.3f}  int8 {ppl['int8']:.3f}", flush=True)
    return {
        "provenance": provenance(),
        "llama_cpp_python_sdist": tools.version,
        "ggufs": {fmt: str(path) for fmt, path in ggufs.items()},
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
