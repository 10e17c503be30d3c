"""The HF-parity prompts and sampling of the real default model's tests (full depth against HF
transformers, float32 and native weights alike)."""

from __future__ import annotations

from eeserve import SamplingParams

N_NEW = 28
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=N_NEW, logprobs=logprobs)
