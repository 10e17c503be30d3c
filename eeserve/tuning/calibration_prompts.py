"""Calibration prompts and their greedy runs, for ``eeserve calibrate`` (both losses).

Contract: ``load_prompts`` reads the user's prompt file or the offline ``prompt_texts`` split;
``prompt_ids`` tokenizes them (plain, in the chat template, or alternating); ``run_prompts``
generates them greedily (EOS respected) with one exit rule and returns the outputs in input
order with the decode speed and mean exit layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.llm import chat_token_ids
from eeserve.sampling_params import SamplingParams
from eeserve.structured_outputs import StructuredOutputsParams
from eeserve.tuning.prompts import prompt_texts


@dataclass
class RunResult:
    """Greedy outputs of a prompt set in input order, with decode speed and depth."""

    token_ids: list[list[int]]
    texts: list[str]
    decode_tokens_per_s: float  # tokens of decode steps / wall time of decode steps
    mean_exit_layer: float  # over decode tokens (the prefill token is always full depth)


def run_prompts(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    exit_params: ExitParams,
    structured: StructuredOutputsParams | None = None,
) -> RunResult:
    """Generate greedily (under ``structured`` where given); steps that prefill are left out of
    the decode speed, and tokens a grammar forced out of the mean exit layer."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=structured)
    order = {
        engine.add_request(p, params, prompt_token_ids=p, exit_params=exit_params): i
        for i, p in enumerate(prompts)
    }
    done: dict[int, Any] = {}
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if outs and all(len(o.outputs[0].token_ids) > 1 for o in outs):
            decode_s += elapsed
            decode_tokens += len(outs)
        for o in outs:
            if o.finished and o.request_id in order:
                done[order[o.request_id]] = o.outputs[0]
    outs_in_order = [done[i] for i in range(len(prompts))]
    layers = [x for c in outs_in_order for x, f in zip(c.exit_layers[1:], c.forced[1:]) if not f]
    return RunResult(
        token_ids=[list(c.token_ids) for c in outs_in_order],
        texts=[c.text for c in outs_in_order],
        decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else float("nan"),
        mean_exit_layer=statistics.mean(layers) if layers else float("nan"),
    )


def load_prompts(args: argparse.Namespace, split: str, n: int) -> list[str]:
    """The user's file (one prompt a line, or JSONL with "prompt"), else the offline set."""
    if args.prompts and split == "calib":
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        texts = [
            json.loads(ln)["prompt"] if args.prompts.endswith(".jsonl") else ln for ln in lines
        ]
        return texts[:n]
    return prompt_texts(n, seed=args.seed, split=split)


def prompt_ids(engine: LLMEngine, texts: list[str], chat: str) -> list[list[int]]:
    """Token ids: plain text (``no``), in the chat template (``yes``) or alternating (``mixed``,
    as the exit-head tuning data)."""

    def wrap(i: int) -> bool:
        return chat == "yes" or (chat == "mixed" and i % 2 == 0)

    return [
        chat_token_ids(engine.tokenizer, [{"role": "user", "content": t}])
        if wrap(i)
        else engine.tokenize(t)
        for i, t in enumerate(texts)
    ]
