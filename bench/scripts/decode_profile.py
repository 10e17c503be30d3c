"""Where a batch-1 decode step's time goes: torch's profiler over one greedy request (first bench
prompt, 64 tokens, full depth, after two untimed runs), each op's self time per decoded token
beside the step's wall time per token, and the LM head's share of the linear kernel.
Usage: decode_profile.py MODEL [int8]"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.report_run import build_prompts
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.loader import resolve_model

torch.set_num_threads(2)
model = sys.argv[1]
quant = sys.argv[2] if len(sys.argv) > 2 else None
engine = LLMEngine(
    EngineConfig(model=model, enable_prefix_caching=False, max_num_seqs=1, quantization=quant)
)
tok = AutoTokenizer.from_pretrained(resolve_model(model))
prompts = build_prompts(tok, 1, 0, tok.chat_template is not None)
full = ExitParams(enabled=False)
for _ in range(2):
    run_engine(engine, prompts, 64, full)
start = time.perf_counter()
plain = run_engine(engine, prompts, 64, full)
wall = time.perf_counter() - start
with profile(activities=[ProfilerActivity.CPU]) as prof:
    run_engine(engine, prompts, 64, full)
tokens = 64
print(f"{model} {quant or 'float32'}: {plain.decode_tokens_per_s:.1f} tok/s unprofiled, "
      f"{wall / tokens * 1e3:.2f} ms a token (prefill included)")  # fmt: skip
events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
total = sum(e.self_cpu_time_total for e in events)
print(f"profiled ops: {total / tokens / 1e3:.2f} ms a token")
for e in events[:14]:
    print(f"  {e.key:32s} {e.self_cpu_time_total / tokens / 1e3:6.3f} ms a token, "
          f"{e.count / tokens:6.1f} calls")  # fmt: skip
