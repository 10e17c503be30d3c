"""Measurement helpers shared by every benchmark: timed runs of this engine and of HF ``generate``.

Contract: ``run_engine``/``run_hf`` generate the given prompts greedily to a fixed length and
return a ``Run`` (tokens/s, decode tokens/s, inter-token latency, outputs, exit layers);
``median_of``/``median_run`` pick the median run; ``token_agreement_mean``/``quality_vs``
compare outputs (quality beside every speed figure). Where a result comes from:
``tuning.provenance``.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.outputs import RequestOutput
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.quality import rouge_l, token_agreement


@dataclass
class Run:
    tokens_per_s: float
    mean_itl_ms: float  # mean time between tokens of one request after its first token
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    mean_exit_layer: float = 0.0
    decode_tokens_per_s: float = 0.0  # tokens after each request's first / decode wall time
    exit_layers: list[list[int]] = field(default_factory=list, repr=False)  # per request, token
    # ``speculative`` mode: verified drafts and accepted ones over all requests, and per output
    # token (draft layer or None, accepted or replaced or None) for acceptance per exit layer.
    drafted: int = 0
    accepted: int = 0
    draft_records: list[tuple[int, bool]] = field(default_factory=list, repr=False)


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
    stats = [o.outputs[0].exit_stats for o in outs]
    records = [
        (lay, bool(acc))
        for o in outs
        for lay, acc in zip(o.outputs[0].draft_layers or [], o.outputs[0].draft_accepted or [])
        if lay is not None
    ]
    return Run(
        tokens_per_s=len(prompts) * max_tokens / (end - start),
        mean_itl_ms=1000 * statistics.mean(itl),
        outputs=[o.outputs[0].token_ids for o in outs],
        mean_exit_layer=statistics.mean(layers) if layers else 0.0,
        decode_tokens_per_s=len(prompts) * (max_tokens - 1) / max(end - decode_start, 1e-9),
        exit_layers=[list(o.outputs[0].exit_layers) for o in outs],
        drafted=sum(s.num_drafted or 0 for s in stats if s is not None),
        accepted=sum(s.num_accepted or 0 for s in stats if s is not None),
        draft_records=records,
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


def token_agreement_mean(a: list[list[int]], b: list[list[int]]) -> float:
    return statistics.mean(token_agreement(x, y) for x, y in zip(a, b))


def quality_vs(ref: Run, run: Run, tokenizer: Any) -> tuple[float, float]:
    """Mean token agreement and mean ROUGE-L (on decoded text) of ``run`` against ``ref``."""
    agree = statistics.mean(token_agreement(a, b) for a, b in zip(run.outputs, ref.outputs))
    rouge = statistics.mean(
        rouge_l(tokenizer.decode(a), tokenizer.decode(b)) for a, b in zip(run.outputs, ref.outputs)
    )
    return agree, rouge
