"""Greedy decode with the LM head screened (``screen_head=True``, the default) and without, the two
engines alternated run by run: decode tok/s per run and the median of the per-round ratios, for
full depth and the model's default mode, at each batch size. Every screened run's tokens are
checked equal to the unscreened run's.
Usage: screened_head.py MODEL BATCHES [ROUNDS]   (BATCHES: comma-separated, e.g. 1,8,16)"""

import statistics as st
import sys

import torch
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.loader import resolve_model

torch.set_num_threads(2)
model, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
engines = {
    screen: LLMEngine(
        EngineConfig(
            model=model, enable_prefix_caching=False, max_num_seqs=max(batches), screen_head=screen
        )
    )
    for screen in (False, True)
}
tok = AutoTokenizer.from_pretrained(resolve_model(model))
prompts = build_prompts(tok, max(batches), 0, tok.chat_template is not None)
modes = {"full depth": ExitParams(enabled=False), "default mode": None}
for mode, params in modes.items():
    for b in batches:
        tps: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            runs = {s: run_engine(e, prompts[:b], 64, params) for s, e in engines.items()}
            assert runs[True].outputs == runs[False].outputs, "screened tokens differ"
            for s, r in runs.items():
                tps[s].append(r.decode_tokens_per_s)
        ratios = [a / b for a, b in zip(tps[True], tps[False])]
        print(
            f"{mode}, batch {b}: whole head {st.median(tps[False]):.1f} tok/s, screened "
            f"{st.median(tps[True]):.1f}; ratio {st.median(ratios):.3f} "
            f"[{min(ratios):.3f}-{max(ratios):.3f}]; tokens identical",
            flush=True,
        )
