"""llama.cpp decode worker, run as its own process by ``bench.llamacpp`` (not imported by eeserve).

Contract: ``python llamacpp_worker.py GGUF THREADS MAX_BATCH MAX_LEN`` loads the model, prints
``ready``, then answers each JSON line ``{"prompts": [[ids]], "max_tokens": n}`` on stdin with one
JSON line ``{"outputs": [[ids]], "prefill_s": s, "decode_s": s}``: every prompt prefilled in one
batch, then greedy decoding of all of them together to exactly ``max_tokens`` (no stop token);
``decode_s`` runs from the moment every sequence has its first token.

Why a separate process: llama.cpp and PyTorch each keep an OpenMP thread pool; in one process on
a 2-core machine the two pools' spinning threads fight (llama.cpp measured ~40x slower there).
This file imports neither torch nor eeserve.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _logger


class Decoder:
    def __init__(self, path: str, threads: int, max_batch: int, max_len: int) -> None:
        lib = llama_cpp
        _logger.set_verbose(False)
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = max_batch * max_len
        cp.n_batch = cp.n_ubatch = max(512, max_batch * max_len)
        cp.n_seq_max = max_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(cp.n_batch, 0, 1)

    def _next(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits) -> argmax of each row wanting logits."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        n_out = sum(r[3] for r in rows)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), (n_out, self.n_vocab))
        return [int(t) for t in logits.argmax(-1)]

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        rows = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        outputs = [[t] for t in self._next(rows)]
        decode_start = time.perf_counter()
        for step in range(1, max_tokens):
            rows = [
                (o[-1], len(p) + step - 1, s, True)
                for s, (p, o) in enumerate(zip(prompts, outputs))
            ]
            for o, t in zip(outputs, self._next(rows)):
                o.append(t)
        end = time.perf_counter()
        return {
            "outputs": outputs,
            "prefill_s": decode_start - start,
            "decode_s": end - decode_start,
        }


def main() -> None:
    path, threads, max_batch, max_len = sys.argv[1], *map(int, sys.argv[2:5])
    decoder = Decoder(path, threads, max_batch, max_len)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(decoder.run(req["prompts"], req["max_tokens"])), flush=True)


if __name__ == "__main__":
    main()
