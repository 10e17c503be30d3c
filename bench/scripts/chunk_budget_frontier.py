"""The trade-off that the budget sets, in one process: for each max_num_batched_tokens, the passes
that prefill a 1,336-token prompt beside 8 streams decoding at full depth, as multiples of the
streams' decode step measured just before (the gap ratio that the server scenario's p99 and max
see), against the prompt's prefill time chunked over unchunked (its TTFT ratio). Budgets are taken
in turn in each round, so the machine's drift hits them alike.
Usage: chunk_budget_frontier.py [ROUNDS [BUDGET ...]] (defaults 3; 96 112 128 160 192 256 384)."""

import dataclasses
import statistics as st
import sys
import time

import torch

from eeserve import LLM, SamplingParams
from eeserve.bench.arrivals import long_prompt_texts
from eeserve.exit_params import ExitParams
from eeserve.tuning.prompts import prompt_texts

torch.set_num_threads(2)
FULL = ExitParams(enabled=False)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
budgets = [int(b) for b in sys.argv[2:]] or [96, 112, 128, 160, 192, 256, 384]
prompt = long_prompt_texts(1, 6000, 0)[0]


def make(chunked):
    e = LLM("smollm2", enable_chunked_prefill=chunked, enable_prefix_caching=False).engine
    for p in prompt_texts(8, 0, "bench", max_chars=400):
        e.add_request(
            p, SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0), exit_params=FULL
        )
    for _ in range(3):
        e.step()
    return e


def timed_step(e):
    t = time.perf_counter()
    e.step()
    return (time.perf_counter() - t) * 1e3


def prefill(e):
    """The decode step's median over 10 steps, then the prompt's passes (ms)."""
    d = st.median(timed_step(e) for _ in range(10))
    e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), exit_params=FULL)
    passes = []
    while len(e.scheduler.running) > 8 or e.scheduler.waiting:
        passes.append(timed_step(e))
    return d, passes


chunked, unchunked = make(True), make(False)
res = {b: [] for b in budgets}
base = []
for _r in range(rounds):
    base.append(sum(prefill(unchunked)[1]))
    for b in budgets:
        chunked.scheduler.config = dataclasses.replace(
            chunked.scheduler.config, max_num_batched_tokens=b
        )
        res[b].append(prefill(chunked))
u = st.median(base)
print(f"unchunked prefill beside the streams: median {u:.0f} ms (runs {[round(x) for x in base]})")
print("budget  passes  decode step  pass max / step  pass median / step  prefill  vs unchunked")
for b in budgets:
    d = st.median(x[0] for x in res[b])
    tot = st.median(sum(x[1]) for x in res[b])
    mx = st.median(max(x[1]) / x[0] for x in res[b])
    md = st.median(st.median(x[1]) / x[0] for x in res[b])
    print(
        f"{b:6d}  {len(res[b][0][1]):6d}  {d:8.1f} ms  {mx:15.2f}  {md:18.2f}  "
        f"{tot:5.0f} ms  {tot / u:10.2f}"
    )
