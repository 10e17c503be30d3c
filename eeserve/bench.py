"""``eeserve bench``: this engine vs HF transformers ``generate``, side by side in one process.

Contract: for each dtype and batch size, the same fixed-length prompts (from ``prompts.py``) are
generated greedily to the same length by this engine (prefix caching off, so repeats do not hit
the cache) and by HF ``generate``; the median over repeats of generated tokens/s is printed with
the ratio engine/HF, and everything is written as JSON. Early-exit sweeps (``bench_exits``) add
policies and thresholds next to full depth with their quality against full depth.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eeserve.engine import LLMEngine
from eeserve.exits import ExitParams
from eeserve.outputs import RequestOutput
from eeserve.sampling_params import SamplingParams


@dataclass
class Run:
    tokens_per_s: float
    mean_itl_ms: float  # mean time between tokens of one request after its first token
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    mean_exit_layer: float = 0.0
    decode_tokens_per_s: float = 0.0  # tokens after each request's first / decode wall time
    exit_layers: list[list[int]] = field(default_factory=list, repr=False)  # per request, token


def run_engine(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    exit_params: ExitParams | None = None,
) -> Run:
    """Generate greedily (EOS ignored, so every request makes ``max_tokens``) and time it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, tuple[float, RequestOutput]] = {}
    for p in prompts:
        engine.add_request(p, params, prompt_token_ids=p, exit_params=exit_params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (now, out)
    end = time.perf_counter()
    decode_start = max(first.values())
    outs = [done[k][1] for k in sorted(done, key=int)]
    itl = [(done[k][0] - first[k]) / max(1, max_tokens - 1) for k in done]
    layers = [x for o in outs for x in o.outputs[0].exit_layers[1:]]
    return Run(
        tokens_per_s=len(prompts) * max_tokens / (end - start),
        mean_itl_ms=1000 * statistics.mean(itl),
        outputs=[o.outputs[0].token_ids for o in outs],
        mean_exit_layer=statistics.mean(layers) if layers else 0.0,
        decode_tokens_per_s=len(prompts) * (max_tokens - 1) / max(end - decode_start, 1e-9),
        exit_layers=[list(o.outputs[0].exit_layers) for o in outs],
    )


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (its 2nd ``put``)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    pad_id: int,
    device: torch.device | str = "cpu",
) -> Run:
    """HF ``generate``, greedy, exactly ``max_tokens`` each; prompts of unequal length are
    left-padded (with an attention mask), as HF expects for decoder-only batches."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = _FirstTokenClock()
    # EOS ignored like the engine's ``ignore_eos``: no stop token at all. (``min_new_tokens``
    # would instead forbid EOS, so the texts part wherever the model wants to stop.)
    gen = copy.deepcopy(model.generation_config)
    gen.update(eos_token_id=[], pad_token_id=pad_id, max_new_tokens=max_tokens, do_sample=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=gen, streamer=clock)
    end = time.perf_counter()
    elapsed = end - start
    decode_s = end - (clock.first or start)
    return Run(
        tokens_per_s=len(prompts) * max_tokens / elapsed,
        mean_itl_ms=1000 * elapsed / max_tokens,
        outputs=out[:, ids.shape[1] :].tolist(),
        decode_tokens_per_s=len(prompts) * (max_tokens - 1) / max(decode_s, 1e-9),
    )


def median_of(runs: list[Run], key: str = "tokens_per_s") -> Run:
    """The median run by ``key`` (the upper one of an even count)."""
    return sorted(runs, key=lambda r: float(getattr(r, key)))[len(runs) // 2]


def median_run(fn: Any, repeats: int) -> Run:
    return median_of([fn() for _ in range(repeats)])


def machine_description() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def bench_vs_hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from eeserve.config import EngineConfig
    from eeserve.prompts import fixed_length_ids, prompt_texts

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


def token_agreement_mean(a: list[list[int]], b: list[list[int]]) -> float:
    from eeserve.quality import token_agreement

    return statistics.mean(token_agreement(x, y) for x, y in zip(a, b))


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark: this engine vs HF transformers (and exits)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/bench.json")
    p.add_argument("--sections", default="hf,exits", help="hf (engine vs HF), exits, or both")
    p.add_argument("--policies", default="per_sequence,batch_all")
    p.add_argument("--kv-fills", default="fill", help="fill, recompute or both")
    p.add_argument("--thresholds", default="0.5,0.8,0.9,0.95")
    p.add_argument("--measure", default=None, help="default: the model's exit config")
    p.add_argument(
        "--efficiency-layer",
        type=int,
        default=None,
        help="exit layer of the threshold-0 efficiency check (default: the first exit layer)",
    )
    p.add_argument("--exit-dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    p.set_defaults(func=main)
    sub_bench = p.add_subparsers(dest="bench_command", metavar="{report,serve}")
    from eeserve.bench_report import add_report_parser

    add_report_parser(sub_bench)
    try:
        from eeserve.server.bench_serve import add_bench_serve_parser
    except ImportError:  # server dependencies missing: the offline benchmark still works
        return
    add_bench_serve_parser(sub_bench)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from eeserve.bench_exits import bench_exits
    from eeserve.loader import resolve_model
    from eeserve.prompts import fixed_length_ids, prompt_texts

    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    results: dict[str, Any] = {"machine": machine_description(), "args": vars(args)}
    results["machine"]["load_average_at_start"] = os.getloadavg()
    if "hf" in sections:
        results.update(bench_vs_hf(args))
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
