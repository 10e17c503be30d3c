"""Token groups for exit-head tuning: what the heads are trained and evaluated on.

Contract:
- A ``Group`` is one context (``prompt``, never trained on) followed by one or more
  ``continuations``, each of which sees the prompt and its own earlier tokens only. The trained
  positions are the decode inputs of each continuation: the hidden state of continuation token j
  predicts token j + 1 (the prompt's last position is a prefill position: it never exits).
- ``self_generated`` makes groups without network: prompts from ``prompt_texts(split=...)``, as
  plain text and in the chat template, each continued once greedily and once sampled by the
  engine itself with exits disabled, so the heads learn what the model actually generates.
- ``text_groups`` makes groups from the user's ``.txt`` (blank-line separated passages) or
  ``.jsonl`` files (``{"text"}`` or ``{"prompt", "completion"}`` per line).
- ``load_groups`` gives the tuning and held-out groups of a run, made once and cached as token
  ids (``groups_to_lists`` / ``groups_from_lists``) under a key of everything that makes them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eeserve.exit_params import ExitParams
from eeserve.llm import LLM, chat_token_ids
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.prompts import prompt_texts


@dataclass
class Group:
    prompt: list[int]
    continuations: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + sum(len(c) for c in self.continuations)

    @property
    def num_trained(self) -> int:
        return sum(max(0, len(c) - 1) for c in self.continuations)


def groups_to_lists(groups: list[Group]) -> list[Any]:
    return [[g.prompt, g.continuations] for g in groups]


def groups_from_lists(raw: list[Any]) -> list[Group]:
    return [Group(p, c) for p, c in raw]


def self_generated(
    llm: Any,
    tokens: int,
    split: str,
    seed: int,
    max_tokens: int = 192,
    max_chars: int = 600,
    batch: int = 64,
) -> list[Group]:
    """At least ``tokens`` trained positions of the model's own greedy and sampled output.

    Each prompt (even ones in the chat template when the tokenizer has one, odd ones plain) is
    continued once greedily and once sampled; rounds of at most ``batch`` prompts, sized to what
    is still missing.
    """
    groups: list[Group] = []
    bar = tqdm(total=tokens, desc=f"generate ({split})", unit="tok")
    made = 0
    room = llm.engine.max_model_len - max_tokens  # only a tiny test model's context is short
    while made < tokens:
        n = min(batch, max(4, math.ceil((tokens - made) / (1.5 * max_tokens))))
        first = len(groups)
        texts = prompt_texts(first + n, seed=seed, split=split, max_chars=max_chars)[first:]
        prompts: list[list[int]] = []
        for i, text in enumerate(texts, start=first):
            msg = [{"role": "user", "content": text}]
            chat = i % 2 == 0 and llm.tokenizer.chat_template is not None  # base models: none
            ids = chat_token_ids(llm.tokenizer, msg) if chat else llm.engine.tokenize(text)
            prompts.append(ids[-room:])
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0) for _ in prompts]
        params += [
            SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=seed * 7919 + i)
            for i in range(first, first + n)
        ]
        outs = llm.generate(
            prompts + prompts, params, use_tqdm=False, exit_params=ExitParams(enabled=False)
        )
        for i, ids in enumerate(prompts):
            conts = [list(outs[i].outputs[0].token_ids), list(outs[i + n].outputs[0].token_ids)]
            group = Group(ids, [c for c in conts if len(c) > 1])
            groups.append(group)  # kept even without continuations: indexes the prompts
            made += group.num_trained
            bar.update(group.num_trained)
    bar.close()
    return [g for g in groups if g.continuations]


def text_groups(files: list[Path], tokenizer: Any, max_len: int = 512) -> list[Group]:
    """Groups from the user's files; long texts are cut into windows of ``max_len`` tokens."""
    groups: list[Group] = []
    for path in files:
        for prompt, text in _read_texts(path):
            p_ids = list(tokenizer(prompt).input_ids) if prompt else []
            ids = list(tokenizer(text, add_special_tokens=not prompt).input_ids)
            step = max(2, max_len - len(p_ids))
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                if len(chunk) > 1:
                    groups.append(Group(p_ids, [chunk]))
    if not groups:
        raise ValueError(f"no training text found in {[str(f) for f in files]}")
    return groups


def _read_texts(path: Path) -> Iterator[tuple[str, str]]:
    if path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" in row:
                yield "", str(row["text"])
            elif "prompt" in row and "completion" in row:
                yield str(row["prompt"]), str(row["completion"])
            else:
                raise ValueError(f"{path}:{n}: expected a 'text' or 'prompt'/'completion' field")
    elif path.suffix == ".txt":
        for para in path.read_text().split("\n\n"):
            if para.strip():
                yield "", para.strip()
    else:
        raise ValueError(f"{path}: training data must be a .txt or .jsonl file")


def load_groups(
    model: str,
    data: list[Path],
    tokens: int,
    heldout_tokens: int,
    seed: int,
    max_tokens: int,
    cache: Path,
) -> tuple[list[Group], list[Group]]:
    """Tuning and held-out groups, generated once and cached as token ids under ``cache``."""
    key = json.dumps([model, [str(p) for p in data], tokens, heldout_tokens, seed, max_tokens])
    path = cache / f"groups-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        raw = json.loads(path.read_text())
        return groups_from_lists(raw["train"]), groups_from_lists(raw["heldout"])
    llm = LLM(model, exit_policy="none", max_num_seqs=128, kv_cache_memory=2 * 2**30)
    if data:
        train = text_groups(data, llm.tokenizer)
    else:
        train = self_generated(llm, tokens, "tune", seed, max_tokens)
    heldout = self_generated(llm, heldout_tokens, "heldout", seed, max_tokens)
    del llm
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(
        json.dumps({"train": groups_to_lists(train), "heldout": groups_to_lists(heldout)})
    )
    tmp.rename(path)
    return train, heldout
