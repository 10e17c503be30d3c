"""Per-step times: 8 streams decoding at full depth, then a long prompt arrives; chunked at
budget B (0: off) with attention_context K (0: plain token count). Prints decode median, each
prefill step.
Usage: chunk_steps.py THREADS B K [CHARS [STREAMS]] (STREAMS 0: the prompt alone)."""

import dataclasses
import statistics as st
import sys
import time

import torch

from eeserve import LLM, SamplingParams
from eeserve.bench.arrivals import long_prompt_texts
from eeserve.exit_params import ExitParams
from eeserve.tuning.prompts import prompt_texts

FULL = ExitParams(enabled=False)

threads, budget, K = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
chars = int(sys.argv[4]) if len(sys.argv) > 4 else 6000
streams = int(sys.argv[5]) if len(sys.argv) > 5 else 8
torch.set_num_threads(threads)
chunk = budget > 0
llm = LLM(
    "smollm2",
    max_num_batched_tokens=budget if chunk else 8192,
    enable_chunked_prefill=chunk,
    enable_prefix_caching=False,
)
e = llm.engine
e.scheduler.config = dataclasses.replace(e.scheduler.config, attention_context=K)
sp = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0)
for p in prompt_texts(streams, 0, "bench", max_chars=400):
    e.add_request(p, sp, exit_params=FULL)
for _ in range(4):
    e.step()


def decode_median():
    if not streams:
        return float("nan")
    dec = []
    for _ in range(6):
        t = time.perf_counter()
        e.step()
        dec.append((time.perf_counter() - t) * 1e3)
    return st.median(dec)


res = []
for rep in range(2):
    d0 = decode_median()
    t0 = time.perf_counter()
    e.add_request(
        long_prompt_texts(1, chars, rep)[0],
        SamplingParams(max_tokens=1, ignore_eos=True),
        exit_params=FULL,
    )
    steps = []
    while len(e.scheduler.running) > streams or e.scheduler.waiting:
        t = time.perf_counter()
        e.step()
        steps.append((time.perf_counter() - t) * 1e3)
    wall = (time.perf_counter() - t0) * 1e3
    d1 = decode_median()
    dm = (d0 + d1) / 2
    res.append((dm, steps, wall))
    print(
        f"B {budget} K {K:g}: decode {dm:.1f} ms; {len(steps)} steps {[round(x) for x in steps]}; "
        f"max/dec {max(steps) / dm:.2f}x mean/dec {st.mean(steps[:-1] or steps) / dm:.2f}x; "
        f"prefill {wall:.0f} ms",
        flush=True,
    )
