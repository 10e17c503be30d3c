"""Offline API in vLLM's shape: ``LLM(model).generate(prompts, SamplingParams(...))``.

Contract: ``generate`` takes one or many prompts (strings or token-id lists) and returns one
``RequestOutput`` per prompt, in input order, after running them together through the engine's
continuous batching. ``chat`` applies the tokenizer's chat template first.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.outputs import RequestOutput
from eeserve.sampling_params import SamplingParams, check_text

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        exit_params: ExitParams | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params = _per_prompt(sampling_params, len(prompt_list))
        # Validate everything before queueing anything, so a bad prompt leaves the engine clean.
        ids = [self.engine.tokenize(p) for p in prompt_list]
        order: dict[str, int] = {}
        try:
            for i, (p, sp, tok) in enumerate(zip(prompt_list, params, ids)):
                rid = self.engine.add_request(p, sp, prompt_token_ids=tok, exit_params=exit_params)
                order[rid] = i
        except Exception:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        bar = tqdm(total=len(prompt_list), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return [r for r in results if r is not None]

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        exit_params: ExitParams | None = None,
    ) -> list[RequestOutput]:
        convs = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else conversations
        )
        prompts = [self.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, exit_params=exit_params)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, ready to answer."""
    for i, m in enumerate(messages):
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"messages[{i}].{key}")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _per_prompt(
    params: SamplingParams | Seq[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
