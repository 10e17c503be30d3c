"""Where a batch-1 decode step's time goes: one greedy request (first bench prompt, 64 tokens, full
depth, after two untimed runs), its wall time per decoded token split into the decoder layers
(``LayerStack.run``), the LM head (``ModelRunner.logits``) and the rest of the step (embedding,
sampling, scheduling, Python), each beside its roofline (its bytes at the measured read
bandwidth); then torch's profiler's self time per op over one more run.
Usage: decode_profile.py MODEL [int8]"""

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from eeserve.bench.measure import run_engine
from eeserve.bench.peer import screens_head
from eeserve.bench.report_run import build_prompts
from eeserve.bench.roofline import engine_bytes_split, read_bandwidth
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
tokens = 64
for _ in range(2):
    run_engine(engine, prompts, tokens, full)

seconds: dict[str, list[float]] = defaultdict(list)


def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds[label].append(time.perf_counter() - start)
        return out

    return call


runner = engine.runner
runner.stack.run = timed("layers", runner.stack.run)  # type: ignore[method-assign]
runner.logits = timed("head", runner.logits)  # type: ignore[method-assign]
engine.step = timed("step", engine.step)  # type: ignore[method-assign]
plain = run_engine(engine, prompts, tokens, full)
bandwidth = read_bandwidth(2)
layer_bytes, head_bytes = engine_bytes_split(
    resolve_model(model), quant or "float32", screens_head(engine) and quant is None
)
# The first step is the prompt's: decode steps are the rest.
decode = {k: sum(v[1:]) / (len(v) - 1) * 1e3 for k, v in seconds.items()}
rest = decode["step"] - decode["layers"] - decode["head"]
ceiling = {"layers": layer_bytes / bandwidth * 1e3, "head": head_bytes / bandwidth * 1e3}
print(f"{model} {quant or 'float32'}: {plain.decode_tokens_per_s:.1f} tok/s, "
      f"{decode['step']:.2f} ms a decode step; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
      f"roofline {sum(ceiling.values()):.2f} ms ({(layer_bytes + head_bytes) / 1e6:.0f} MB), "
      f"{sum(ceiling.values()) / decode['step']:.0%} of it")  # fmt: skip
for part in ("layers", "head"):
    print(f"  {part:7s} {decode[part]:6.2f} ms, roofline {ceiling[part]:5.2f} ms "
          f"({ceiling[part] / decode[part]:.0%})")  # fmt: skip
print(f"  rest    {rest:6.2f} ms (embedding, sampling, scheduling, Python)")

with profile(activities=[ProfilerActivity.CPU]) as prof:
    run_engine(engine, prompts, tokens, full)
events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
total = sum(e.self_cpu_time_total for e in events)
print(f"profiled ops: {total / tokens / 1e3:.2f} ms a token")
for e in events[:14]:
    print(f"  {e.key:32s} {e.self_cpu_time_total / tokens / 1e3:6.3f} ms a token, "
          f"{e.count / tokens:6.1f} calls")  # fmt: skip
