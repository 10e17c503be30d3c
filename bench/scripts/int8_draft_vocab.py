"""Batch-1 speculative decoding with int8 drafts whose LM head covers N ids of a shortlist,
alternated with full depth: decode tok/s per run, medians, and the share of drafts accepted.
Every speculative run's tokens are checked equal to full depth's.
Usage: [SIDECAR=DIR] int8_draft_vocab.py MODEL SIZES [ROUNDS]
  SIZES: comma-separated N (0: the whole head); N ids come from the shortlist of the sidecar at
  DIR (default: the model's packaged one) when it ranks that many, else ids 0 .. N-1."""

import os
import statistics as st
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.draft_vocab import SubsetHead
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.kernels.quant import Int8Linear
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
shortlist = found[0].shortlist if found else []
weight = runner.model.lm_head.weight.detach()  # [V, D]
heads: dict[int, torch.nn.Module] = {}
for n in sizes:
    if n == 0:
        heads[n] = Int8Linear(weight.contiguous(), None, runner.native)
        continue
    ids = shortlist[:n] if len(shortlist) >= n else list(range(n))
    rows = Int8Linear(weight[ids].contiguous(), None, runner.native)
    heads[n] = SubsetHead(rows, ids, weight.shape[0], weight.device)
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
