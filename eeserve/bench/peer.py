"""``eeserve bench --sections peer``: this engine vs llama.cpp on the same weights, interleaved.

Contract: for each batch size, four runners decode the same fixed-length prompts greedily to the
same length with the same thread count: this engine in float32, llama.cpp on an F32 GGUF of the
same folder, this engine with weight-only int8 (``quantization="int8"``), llama.cpp on the Q8_0
GGUF. Each repeat runs all four back to back (so machine load hits them alike); the median decode
tok/s of each is reported with the ratios engine/llama.cpp, and beside them the quality: greedy
token agreement and ROUGE-L of int8 against float32 (this engine), and of llama.cpp F32 against
this engine's float32 (a check that both run the same model), and the held-out perplexity of
float32 and int8 (``bench.perplexity``). Without llama-cpp-python the section
is skipped with ``llamacpp.INSTALL_HINT``.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from typing import Any

import torch

from eeserve.bench import llamacpp
from eeserve.bench.measure import Run, median_of, quality_vs, run_engine
from eeserve.bench.perplexity import heldout_perplexity
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts

# (label, engine quantisation or llama.cpp GGUF kind); pairs: engine row i vs llama.cpp row i + 1.
RUNNERS = (
    ("eeserve float32", None),
    ("llama.cpp F32", "f32"),
    ("eeserve int8", "int8"),
    ("llama.cpp Q8_0", "q8_0"),
)


# Untimed pause before each run: the previous runner's OpenMP threads (PyTorch's or llama.cpp's)
# spin for a moment after their last work; on 2 cores that spin would be charged to the next one.
_SETTLE_S = 0.5


def _runners(
    args: argparse.Namespace, max_batch: int, max_len: int
) -> tuple[dict[str, Any], list[llamacpp.LlamaCpp]]:
    folder = resolve_model(args.model)
    ggufs = llamacpp.peer_ggufs(folder)
    threads = args.threads or torch.get_num_threads()
    out: dict[str, Any] = {}
    peers: list[llamacpp.LlamaCpp] = []
    for label, kind in RUNNERS:
        if label.startswith("eeserve"):
            cfg = EngineConfig(
                model=args.model,
                dtype="float32",
                quantization=kind,
                enable_prefix_caching=False,
                max_num_seqs=max_batch,
                exit_policy="none",
            )
            engine = LLMEngine(cfg)
            out[label] = partial(run_engine, engine)
        else:
            peer = llamacpp.LlamaCpp(ggufs[str(kind)], threads, max_batch, max_len)
            peers.append(peer)
            out[label] = peer.run
    return out, peers


def bench_peer(args: argparse.Namespace) -> dict[str, Any]:
    if not llamacpp.available():
        print(f"peer section skipped: llama-cpp-python is not installed; {llamacpp.INSTALL_HINT}")
        return {"skipped": "llama-cpp-python not installed"}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    from transformers import AutoTokenizer

    engine_tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    texts = prompt_texts(max(batch_sizes), seed=args.seed, split="bench")
    prompts = fixed_length_ids(engine_tok, texts, args.prompt_len)
    runners, peers = _runners(args, max(batch_sizes), args.prompt_len + args.max_tokens + 1)
    try:
        for fn in runners.values():  # warm-up: kernels built, caches touched
            fn(prompts[:2], 4)
        rows = []
        for b in batch_sizes:
            runs: dict[str, list[Run]] = {label: [] for label in runners}
            for _ in range(args.repeats):
                for label, fn in runners.items():
                    time.sleep(_SETTLE_S)
                    runs[label].append(fn(prompts[:b], args.max_tokens))
            med = {label: median_of(r, "decode_tokens_per_s") for label, r in runs.items()}
            rows.append(_row(b, med, engine_tok))
    finally:
        for peer in peers:
            peer.close()
    folder = resolve_model(args.model)
    ppl = {name: heldout_perplexity(folder, name == "int8") for name in ("float32", "int8")}
    print(f"held-out perplexity: float32 {ppl['float32']:.3f}  int8 {ppl['int8']:.3f}", flush=True)
    return {
        "heldout_perplexity": ppl,
        "threads": args.threads or torch.get_num_threads(),
        "load_average_end": os.getloadavg(),
        "rows": rows,
    }


def _row(batch: int, med: dict[str, Run], tok: Any) -> dict[str, Any]:
    tps = {label: run.decode_tokens_per_s for label, run in med.items()}
    int8_agree, int8_rouge = quality_vs(med["eeserve float32"], med["eeserve int8"], tok)
    peer_agree, peer_rouge = quality_vs(med["eeserve float32"], med["llama.cpp F32"], tok)
    q8_agree, q8_rouge = quality_vs(med["llama.cpp F32"], med["llama.cpp Q8_0"], tok)
    row = {
        "batch": batch,
        "decode_tok_s": tps,
        "float32_vs_llamacpp_f32": tps["eeserve float32"] / tps["llama.cpp F32"],
        "int8_vs_llamacpp_q8_0": tps["eeserve int8"] / tps["llama.cpp Q8_0"],
        "int8_vs_float32": {"token_agreement": int8_agree, "rouge_l": int8_rouge},
        "llamacpp_f32_vs_float32": {"token_agreement": peer_agree, "rouge_l": peer_rouge},
        "llamacpp_q8_0_vs_f32": {"token_agreement": q8_agree, "rouge_l": q8_rouge},
    }
    print(
        f"batch {batch:3d} decode tok/s: "
        + "  ".join(f"{k} {v:7.1f}" for k, v in tps.items())
        + f"\n          float32/F32 {row['float32_vs_llamacpp_f32']:.2f}x  "
        f"int8/Q8_0 {row['int8_vs_llamacpp_q8_0']:.2f}x  "
        f"int8 vs float32: agreement {int8_agree:.3f} ROUGE-L {int8_rouge:.3f}  "
        f"llama.cpp F32 vs float32: agreement {peer_agree:.3f}  "
        f"Q8_0 vs F32 (llama.cpp): agreement {q8_agree:.3f} ROUGE-L {q8_rouge:.3f}",
        flush=True,
    )
    return row
