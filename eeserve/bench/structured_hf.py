"""HF transformers under the same constraint: the structured benchmark's ``hf`` peer.

Contract: ``HFConstrained(folder, grammars)`` loads the model's float32 HF weights (the folder the
engine loads) and ``generate(prompts, grammar, batch, max_tokens)`` runs greedy ``generate`` in
groups of ``batch`` left-padded prompts, each row's logits masked by its own matcher of the same
compiled llguidance grammar the engine uses (``GrammarMask``, a ``LogitsProcessor``), and returns
each prompt's output token ids (up to and including the end of sequence) and the wall time.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from eeserve.engine.grammar import Grammar, TokenMatcher


class GrammarMask(LogitsProcessor):
    """Masks each row's scores [B, V] to what its grammar allows after the tokens generated so
    far; a row that has ended (end of sequence) may only repeat it (HF pads finished rows)."""

    def __init__(self, grammar: Grammar, batch: int, prompt_len: int, eos: int) -> None:
        self.matchers: list[TokenMatcher] = [grammar.matcher() for _ in range(batch)]
        self.seen = prompt_len
        self.eos = eos
        self.done = [False] * batch

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        fresh = input_ids[:, self.seen :].tolist()
        self.seen = input_ids.shape[1]
        for b, m in enumerate(self.matchers):
            for t in fresh[b]:
                if not self.done[b]:
                    m.accept([t])
                    self.done[b] = t == self.eos
            if self.done[b]:
                keep = scores[b, self.eos].clone()
                scores[b].fill_(float("-inf"))
                scores[b, self.eos] = keep
            else:
                m.mask_(scores[b])
        return scores


class HFConstrained:
    def __init__(self, folder: Path, *, eos: int, pad: int) -> None:
        self.model: Any = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        self.model.eval()
        self.eos, self.pad = eos, pad

    def generate(
        self, prompts: list[list[int]], grammar: Grammar, batch: int, max_tokens: int
    ) -> tuple[list[list[int]], float]:
        outs: list[list[int]] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += self._group(prompts[i : i + batch], grammar, max_tokens)
        return outs, time.perf_counter() - start

    def _group(
        self, prompts: list[list[int]], grammar: Grammar, max_tokens: int
    ) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gen = copy.deepcopy(self.model.generation_config)
        gen.update(
            eos_token_id=self.eos, pad_token_id=self.pad, max_new_tokens=max_tokens, do_sample=False
        )
        processor = GrammarMask(grammar, len(prompts), width, self.eos)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                generation_config=gen,
                logits_processor=LogitsProcessorList([processor]),
            )
        rows = out[:, width:].tolist()
        return [r[: r.index(self.eos) + 1] if self.eos in r else r for r in rows]
