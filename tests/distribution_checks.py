"""Checks that sampled outputs follow full depth's distribution, shared by the speculative-mode
tests (exit drafts and int8 drafts): sampling requests in small batches, and a chi-square of the
second generated token against HF's conditional distribution."""

from __future__ import annotations

from typing import Any

import torch

from eeserve import LLM, SamplingParams
from eeserve.exit_params import ExitParams
from tests.tiny_model import hf_logprobs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def sample_in_batches(
    llm: LLM, ids: list[int], params: list[SamplingParams], ep: ExitParams
) -> list[Any]:
    """One request per ``params`` (same prompt), four at a time (larger decode batches of the
    exits drafter do not draft); the completions in order."""
    engine = llm.engine
    rids: list[str] = []
    done = {}
    for i in range(0, len(params), 4):
        rids += [engine.add_request(ids, p, exit_params=ep) for p in params[i : i + 4]]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    return [done[r] for r in rids]


def second_token_chi_square(
    hf: Any, ids: list[int], outs: list[Any], temperature: float = 1.0, top_k: int = 8
) -> tuple[float, int]:
    """Chi-square of the second generated tokens of ``outs`` against full depth's (HF) sampling
    distribution given each first token (exact conditional per group of >= 30 samples)."""
    counts: dict[int, torch.Tensor] = {}
    probs: dict[int, torch.Tensor] = {}
    for out in outs:
        first = out.token_ids[0]
        if first not in probs:
            top = (hf_logprobs(hf, [*ids, first])[-1] / temperature).topk(top_k)
            pr = torch.zeros(hf.config.vocab_size)
            pr[top.indices] = top.values.softmax(-1)
            probs[first], counts[first] = pr, torch.zeros_like(pr)
        counts[first][out.token_ids[1]] += 1
    stat, dof = 0.0, 0
    for first, c in counts.items():
        if c.sum() >= 30:
            s, d = chi_square(c, probs[first])
            stat, dof = stat + s, dof + d
    assert dof > 0, "no first token sampled often enough"
    return stat, dof
