"""The measuring child of the A/B decode scripts (``decode_ab.py``, ``native_weights.py``): one
engine's greedy decode at batch 1, 8 and 32 (32-token bench prompts, 64 new tokens, 2 torch
threads, after a short warm-up), printed as one JSON line a batch size with its decode tok/s and
an MD5 of its tokens (the parents compare tokens across processes by it).

It imports ``eeserve`` from whatever checkout PYTHONPATH names (``decode_ab.py`` times two), so
it uses only what every checkout it is run against has: ``bench.measure.run_engine``,
``bench.report_run.build_prompts`` and the engine.
"""

import hashlib
import json

import torch

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine

BATCHES = (1, 8, 32)


def print_rows(config: EngineConfig, label: dict[str, str]) -> None:
    """Time ``config``'s engine at each of ``BATCHES``; each row carries ``label``."""
    torch.set_num_threads(2)
    engine = LLMEngine(config)
    prompts = [p[:32] for p in build_prompts(engine.tokenizer, 32, seed=0, chat=False)]
    run_engine(engine, prompts[:2], 8)  # warm-up
    for b in BATCHES:
        run = run_engine(engine, prompts[:b], 64)
        tokens = hashlib.md5(json.dumps(run.outputs).encode()).hexdigest()
        row = {**label, "batch": b, "decode_tok_s": run.decode_tokens_per_s}
        print(json.dumps({**row, "tokens_md5": tokens}), flush=True)
