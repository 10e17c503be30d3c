"""Request preparation off the event loop: templating and tokenizing on a thread of their own.

Contract: ``Preparer(info)`` owns one worker thread and a copy of ``info``'s tokenizer that only
that thread uses (a tokenizer is not to be shared between threads that call it at once);
``await preparer.prepare(req, kind)`` runs ``prepare.prepare`` there and returns its
``Prepared`` or raises its ``ApiError``, so that the event loop goes on answering 429s, health
checks and stream events while a burst is templated and tokenized. Requests are prepared one at a
time, in arrival order. ``close()`` ends the thread; work still queued is dropped.

Why a thread and not worker processes: the tokenizer (Rust, called through transformers) lets
go of the interpreter's lock while it encodes, so a thread that tokenizes holds the event loop
up only for the Python around each call: templating, the call itself, building the
``Prepared``. Measured with ``bench/scripts/tokenize_off_loop.py`` (numbers in docs/server.md):
the loop's lag while a thread prepares 400 chat requests stays at the interpreter's switch
interval, where preparing them on the loop holds it for the whole time. Processes would add a
copy of the interpreter and the tokenizer each, and a pickled request each way, for nothing the
thread does not already give.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from eeserve.server.formatting import Kind
from eeserve.server.prepare import GenerationRequest, ModelInfo, Prepared, prepare


class Preparer:
    def __init__(self, info: ModelInfo) -> None:
        self.info = dataclasses.replace(info, tokenizer=copy.deepcopy(info.tokenizer))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eeserve-prepare")

    async def prepare(self, req: GenerationRequest, kind: Kind) -> Prepared:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, prepare, self.info, req, kind)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
