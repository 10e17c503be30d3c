"""Batch 1 at the report's operating point, timed alone: the report's per_sequence and batch_all
engines (exit heads as drafters), its first chat prompt, 128 tokens, full depth and
classifier >= 0.98 alternated over four rounds; decode tok/s per round and median.
Usage: batch1_alone.py"""

import statistics as st

import torch
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.loader import resolve_model

torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
prompts = build_prompts(tok, 1, 0, True)
E = {
    p: LLMEngine(
        EngineConfig(
            model="smollm2",
            enable_prefix_caching=False,
            max_num_seqs=1,
            exit_policy=p,
            speculative_draft="exits",
        )
    )
    for p in ("per_sequence", "batch_all")
}
full, ee = ExitParams(enabled=False), ExitParams(threshold=0.98, measure="classifier")
res = {}
for _r in range(4):
    for p, e in E.items():
        for name, ep in (("full", full), ("ee", ee)):
            run = run_engine(e, prompts, 128, ep)
            res.setdefault((p, name), []).append(run.decode_tokens_per_s)
for k, v in res.items():
    print(k, [round(x, 1) for x in v], round(st.median(v), 1))
