"""``eeserve shortlist``: the vocabulary shortlist of the cheap exit checks, counted and stored.

Contract: ``count_shortlist(engine, prompts, max_tokens)`` generates the model's own greedy
continuations of the prompts at full depth and ranks the token ids by how often it produced them
(ties by id; ids it never produced follow in id order, a BPE vocabulary being roughly
frequency-ordered). ``write_shortlist`` puts the ranking into the exit sidecar at ``out``
(copying the heads of the sidecar the engine loaded when ``out`` holds none yet), with
``--int8-draft-vocab`` how many of its ids the int8 copy drafts over. The ``shortlist_*``
measures read its first ``shortlist_size`` ids (docs/early-exit.md; drafts: docs/speculative.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine_args import add_engine_args, engine_config
from eeserve.exit_params import ExitParams
from eeserve.llm import chat_token_ids
from eeserve.models.base_delta import DELTA_NAME
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import CONFIG_NAME, WEIGHTS_NAME, config_json, load_sidecar
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.calibration_store import sidecar_source
from eeserve.tuning.prompts import prompt_texts

DEFAULT_SIZE = 4096


def count_shortlist(
    engine: LLMEngine, prompts: list[str], max_tokens: int, size: int = DEFAULT_SIZE
) -> tuple[list[int], int]:
    """The ``size`` most produced token ids, most frequent first, and how many tokens were
    counted."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    chat = engine.tokenizer.chat_template is not None
    for text in prompts:
        ids = (
            chat_token_ids(engine.tokenizer, [{"role": "user", "content": text}]) if chat else None
        )
        engine.add_request(
            text, params, prompt_token_ids=ids, exit_params=ExitParams(enabled=False)
        )
    counts: Counter[int] = Counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts.update(out.outputs[0].token_ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    seen = set(ranked)
    vocab = engine.model_config.vocab_size
    rest = (t for t in range(vocab) if t not in seen)
    ranked += [next(rest) for _ in range(min(size, vocab) - len(ranked))]
    return ranked, sum(counts.values())


def write_shortlist(
    model: str, out: Path, loaded: ExitConfig, ids: list[int], int8_draft_vocab: int | None = None
) -> Path:
    """Store ``ids`` as the shortlist of the sidecar at ``out`` (and ``int8_draft_vocab`` unless
    None); returns its config file."""
    found = load_sidecar(out)
    base = found[0] if found is not None else loaded
    if found is None:
        source = sidecar_source(model)
        for name in (WEIGHTS_NAME, DELTA_NAME):  # the heads, and a trained model's base delta
            if source is not None and (source / name).exists():
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / name, out / name)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG_NAME
    keep = base.int8_draft_vocab if int8_draft_vocab is None else int8_draft_vocab
    cfg = dataclasses.replace(base, shortlist=ids, int8_draft_vocab=keep)
    path.write_text(config_json(cfg))
    return path


def add_shortlist_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "shortlist",
        help="count the vocabulary shortlist of the cheap exit checks into an exit sidecar",
        description="Generate the model's own continuations of the offline 'tune' prompts at "
        "full depth, rank token ids by how often it produced them, and store the ranking in the "
        "exit sidecar at --out (the shortlist_margin and shortlist_max_prob measures read it).",
    )
    p.add_argument("model", help="smollm2, smollm2-ee, an HF folder or a .gguf file")
    p.add_argument("--out", required=True, type=Path, help="the exit sidecar folder to write")
    p.add_argument("--size", type=int, default=DEFAULT_SIZE, help="token ids kept, ranked")
    p.add_argument(
        "--int8-draft-vocab",
        type=int,
        default=None,
        help="speculative int8-copy drafts over the first N ids of this shortlist (0: the whole "
        "vocabulary; default: as the sidecar has it)",
    )
    p.add_argument("--prompts", type=int, default=64, help="offline 'tune' prompts generated")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens per continuation")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt set")
    add_engine_args(p.add_argument_group("engine options"))
    p.set_defaults(func=run_shortlist, exit_policy="none", kv_cache_memory=float(2**30))
    return p


def run_shortlist(args: argparse.Namespace) -> int:
    if args.size < 1:
        raise ValueError(f"--size must be >= 1, got {args.size}")
    if not 0 <= (args.int8_draft_vocab or 0) <= args.size:
        raise ValueError(f"--int8-draft-vocab must be in 0..--size, got {args.int8_draft_vocab}")
    engine = LLMEngine(engine_config(args))
    texts = prompt_texts(args.prompts, args.seed, "tune")
    ids, counted = count_shortlist(engine, texts, args.max_tokens, args.size)
    path = write_shortlist(args.model, args.out, engine.exit_config, ids, args.int8_draft_vocab)
    print(f"counted {counted} generated tokens; wrote a {len(ids)}-id shortlist into {path}")
    return 0
