"""``eeserve bench``: this engine vs HF transformers ``generate``, side by side in one process.

Contract: for each dtype and batch size, the same fixed-length prompts (from ``tuning.prompts``)
are generated greedily to the same length by this engine (prefix caching off, so repeats do not
hit the cache) and by HF ``generate``; the median over repeats of generated tokens/s is printed
with the ratio engine/HF, and everything is written as JSON. Early-exit sweeps
(``bench.exit_sweep``) add policies and thresholds next to full depth with their quality
against full depth.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eeserve.bench.exit_sweep import bench_exits
from eeserve.bench.measure import median_run, run_engine, run_hf, token_agreement_mean
from eeserve.bench.peer import bench_peer
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts
from eeserve.tuning.provenance import machine_description, provenance


def bench_vs_hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    results: dict[str, Any] = {"machine": machine_description(), "args": vars(args), "rows": []}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=dtype,
                enable_prefix_caching=False,
                max_num_seqs=max(batch_sizes),
                exit_policy="none",
                quantization=args.quantization,
            )
        )
        hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=getattr(torch, dtype))
        hf.eval()
        texts = prompt_texts(max(batch_sizes), seed=args.seed, split="bench")
        prompts = fixed_length_ids(engine.tokenizer, texts, args.prompt_len)
        pad = engine.tokenizer.pad_token_id or 0
        run_engine(engine, prompts[:2], 4)  # warm-up
        run_hf(hf, prompts[:2], 4, pad)
        for b in batch_sizes:
            e = median_run(partial(run_engine, engine, prompts[:b], args.max_tokens), args.repeats)
            h = median_run(partial(run_hf, hf, prompts[:b], args.max_tokens, pad), args.repeats)
            agree = token_agreement_mean(e.outputs, h.outputs)
            row = {
                "dtype": dtype,
                "batch": b,
                "engine_tok_s": e.tokens_per_s,
                "hf_tok_s": h.tokens_per_s,
                "ratio": e.tokens_per_s / h.tokens_per_s,
                "token_agreement_vs_hf": agree,
            }
            results["rows"].append(row)
            print(
                f"{dtype:9s} batch {b:3d}: engine {e.tokens_per_s:7.1f} tok/s  HF "
                f"{h.tokens_per_s:7.1f} tok/s  ratio {row['ratio']:.2f}x  "
                f"(greedy token agreement with HF {agree:.3f})",
                flush=True,
            )
    return results


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    results: dict[str, Any] = {"provenance": provenance(), "args": vars(args)}
    results["machine"] = machine_description() | {"load_average_at_start": os.getloadavg()}
    if "hf" in sections:
        results.update(bench_vs_hf(args))
    if "peer" in sections:
        results["peer"] = bench_peer(args)
    if "exits" in sections:
        tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
        batch = max(int(b) for b in args.batch_sizes.split(","))
        prompts = fixed_length_ids(tok, prompt_texts(batch, seed=args.seed), args.prompt_len)
        results["exits"] = bench_exits(args, prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
    return 0
