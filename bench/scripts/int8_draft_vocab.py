"""Batch-1 speculative decoding with int8 drafts whose LM head covers the first N ids of the
model's shortlist (``ExitConfig.int8_draft_vocab = N``), alternated with full depth: decode tok/s
per run, medians, and the share of drafts accepted. Every speculative run's tokens are checked
equal to full depth's.
Usage: [SIDECAR=DIR] int8_draft_vocab.py MODEL SIZES [ROUNDS]
  SIZES: comma-separated N (0: the whole head); the shortlist is the sidecar's at DIR (default:
  the model's packaged one) and must hold at least the largest N."""

import dataclasses
import os
import statistics as st
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.draft_model import int8_head
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import DraftSource, ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import load_sidecar
from eeserve.models.loader import packaged_sidecar, resolve_model

torch.set_num_threads(2)
model, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
tok = AutoTokenizer.from_pretrained(resolve_model(model))
prompts = build_prompts(tok, 4, 0, tok.chat_template is not None)
cfg = EngineConfig(
    model=model, enable_prefix_caching=False, max_num_seqs=1, speculative_draft="int8"
)
engine = LLMEngine(cfg)
runner = engine.runner
assert runner.drafter is not None
folder = Path(os.environ["SIDECAR"]) if "SIDECAR" in os.environ else packaged_sidecar(model)
found = load_sidecar(folder) if folder else None
exits = found[0] if found else ExitConfig(runner.config.num_layers, [])
weight = runner.model.lm_head.weight.detach()  # [V, D]
heads = {
    n: int8_head(
        weight,
        dataclasses.replace(exits, int8_draft_vocab=n).draft_ids(weight.shape[0], DraftSource.INT8),
        runner.native,
    )
    for n in sizes
}
full, spec = ExitParams(enabled=False), ExitParams(mode="speculative")
res: dict[str, list[float]] = {}
for _ in range(rounds):
    for p in prompts:
        f = run_engine(engine, [p], 64, full)
        res.setdefault("full depth", []).append(f.decode_tokens_per_s)
        for n, head in heads.items():
            runner.drafter.lm_head = head
            s = run_engine(engine, [p], 64, spec)
            assert s.outputs == f.outputs, "speculative output differs from full depth"
            res.setdefault(f"int8 drafts, {n or 'all'} ids", []).append(s.decode_tokens_per_s)
            res.setdefault(f"accepted, {n or 'all'} ids", []).append(s.accepted / max(1, s.drafted))
for k, v in res.items():
    print(f"{k}: median {st.median(v):.3f}  runs {[round(x, 2) for x in v]}")
