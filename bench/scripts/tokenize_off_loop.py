"""How long preparing a burst holds the server's event loop: 400 chat requests like the soak's
bursts (the default model's tokenizer and chat template, ~100-token messages), then 100 with
~1.5k-token messages, prepared on the loop itself and on the server's preparation thread
(``server.prepare_thread.Preparer``), while a 1 ms ticker on the loop records how late it wakes.
Prints, per burst, way and round, the time to prepare them all and the ticker's lag (p50, p99,
most). Also: the longest the loop waits while
the thread prepares one ~400 KB message (transformers' encoding lets go of the interpreter's lock;
the tokenizer's own ``encode`` called directly does not).
Usage: tokenize_off_loop.py [rounds]"""

import asyncio
import random
import statistics as st
import sys
import threading
import time
from typing import Any

from transformers import AutoTokenizer

from eeserve.bench.arrivals import long_prompt_texts
from eeserve.bench.soak_load import Mix
from eeserve.models.loader import resolve_model
from eeserve.server.prepare import ModelInfo, parse_body, prepare
from eeserve.server.prepare_thread import Preparer
from eeserve.tuning.prompts import prompt_texts

tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
info = ModelInfo(tokenizer=tok, model_names=["smollm2"], max_model_len=8192, num_layers=30)
mix = Mix(
    model="smollm2",
    short_prompts=prompt_texts(64, 0, "bench", max_chars=400),
    long_prompts=long_prompt_texts(16, 6000, 0),
    max_tokens=64,
    long_share=0.0,
    stream_share=0.0,
    disconnect_share=0.0,
    early_exit=None,
    rng=random.Random(0),
    chat_share=1.0,
)
BURSTS = {
    "400 short": [parse_body("chat", mix.draw().body) for _ in range(400)],
    "100 long": [
        parse_body("chat", {**mix.draw().body, "messages": [{"role": "user", "content": t}]})
        for t in mix.long_prompts * 7
    ][:100],
}


async def ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        due = time.perf_counter() + 0.001
        await asyncio.sleep(0.001)
        lags.append(max(0.0, time.perf_counter() - due))


async def burst(way: str, bodies: list[Any]) -> tuple[float, list[float]]:
    preparer = Preparer(info)
    stop, lags = asyncio.Event(), []
    tick = asyncio.create_task(ticker(stop, lags))
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    if way == "loop":
        for body in bodies:
            prepare(info, body, "chat")
            await asyncio.sleep(0)  # a request's turn ends: the loop may run the ticker
    else:
        await asyncio.gather(*(preparer.prepare(body, "chat") for body in bodies))
    took = time.perf_counter() - start
    stop.set()
    await tick
    preparer.close()
    return took, sorted(lags)


def ms(x: float) -> str:
    return f"{x * 1000:.1f}"


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for name, bodies in BURSTS.items():
    for r in range(rounds):
        for way in ("loop", "thread"):
            took, lags = asyncio.run(burst(way, bodies))
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            print(
                f"{name}, round {r}, {way:>6}: prepared in {ms(took)} ms; loop lag p50 "
                f"{ms(st.median(lags))} p99 {ms(p99)} most {ms(lags[-1])} ms"
            )

long = "word and more words, " * 20000
for name, fn in (
    ("apply_chat_template", lambda: tok.apply_chat_template([{"role": "user", "content": long}])),
    ("tokenizer encode", lambda: tok._tokenizer.encode(long)),
):
    gaps: list[float] = []
    worker = threading.Thread(target=lambda f=fn: [f() for _ in range(3)])
    worker.start()
    while worker.is_alive():
        t = time.perf_counter()
        time.sleep(0.0005)
        gaps.append(time.perf_counter() - t)
    print(f"a thread running {name} on 400 KB three times: the longest wait {ms(max(gaps))} ms")
