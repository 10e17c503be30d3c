"""A 1,336-token prompt's prefill time, chunked and unchunked, beside 8 streams decoding at full
depth and alone: four engines in one process, taken in turn (the machine's drift hits all four
alike).
Usage: chunk_overhead.py [BUDGET [REPEATS]] (defaults 128, 3)."""

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
B = int(sys.argv[1]) if len(sys.argv) > 1 else 128
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
prompt = long_prompt_texts(1, 6000, 0)[0]


def make(streams, chunked):
    llm = LLM(
        "smollm2",
        max_num_batched_tokens=B if chunked else None,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
    )
    e = llm.engine
    for p in prompt_texts(streams, 0, "bench", max_chars=400):
        e.add_request(
            p, SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0), exit_params=FULL
        )
    for _ in range(3):
        e.step()
    return e, streams


engines = {
    "8 streams, chunked": make(8, True),
    "8 streams, unchunked": make(8, False),
    "alone, chunked": make(0, True),
    "alone, unchunked": make(0, False),
}
res = {k: [] for k in engines}
passes = {k: 0 for k in engines}
for _rep in range(reps):
    for name, (e, n) in engines.items():
        e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), exit_params=FULL)
        t0 = time.perf_counter()
        k = 0
        while len(e.scheduler.running) > n or e.scheduler.waiting:
            e.step()
            k += 1
        res[name].append((time.perf_counter() - t0) * 1e3)
        passes[name] = k
for name, v in res.items():
    print(
        f"{name:22s}: {passes[name]:2d} passes, prefill median {st.median(v):.0f} ms "
        f"(runs {[round(x) for x in v]})"
    )
c, u = st.median(res["8 streams, chunked"]), st.median(res["8 streams, unchunked"])
ca, ua = st.median(res["alone, chunked"]), st.median(res["alone, unchunked"])
print(
    f"chunked/unchunked: with streams {c / u:.3f}, alone {ca / ua:.3f}; "
    f"per pass, streams add {(c - ca) / passes['8 streams, chunked']:.1f} ms"
)
