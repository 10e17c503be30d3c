"""Batch-1 decode after a long prompt, where paged attention reads the whole context every layer:
full depth and the model's default mode, each prompt length's runs repeated, decode tok/s per
run and the median. Prompts are random token ids (what is timed does not depend on the text).
Usage: long_context_decode.py MODEL LENGTHS [ROUNDS]   (LENGTHS: comma-separated, e.g. 1000,1900)"""

import statistics as st
import sys

import torch

from eeserve.bench.measure import run_engine
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams

torch.set_num_threads(2)
model, lengths = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, max_num_seqs=1))
vocab = engine.model_config.vocab_size
gen = torch.Generator().manual_seed(0)
for n in lengths:
    prompt = torch.randint(100, min(vocab, 40000), (n,), generator=gen).tolist()
    for mode, params in (("full depth", ExitParams(enabled=False)), ("default mode", None)):
        runs = [run_engine(engine, [prompt], 64, params).decode_tokens_per_s for _ in range(rounds)]
        print(
            f"prompt {n} tokens, {mode}: median {st.median(runs):.1f} tok/s, runs "
            f"{[round(r, 1) for r in runs]}",
            flush=True,
        )
