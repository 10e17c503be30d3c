"""What a serving process does once at startup, around building its engine.

Contract: ``build_engine(config)`` loads an ``LLMEngine`` for an ``EngineLoop`` without leaving
torch's parallel state on the calling thread (see there); ``freeze_startup_heap()``, called once
the engine and app are built, keeps the garbage collector off what startup allocated. A server
process and every replica call both.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> LLMEngine:
    """``LLMEngine(config)``, built on a short-lived thread of its own.

    Why: loading runs torch's parallel loops, and with the OpenMP backend every thread that runs
    one keeps a pool of worker threads until it exits. Built on the main thread, that pool would
    live on beside the engine thread's; with more OpenMP threads than cores, libgomp stops
    spinning between parallel regions, so every kernel call waits for its workers to wake (a
    batch-8 decode step of the default model 17 -> 24-26 ms on two cores, measured). A thread's
    pool ends with the thread."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eeserve-load") as pool:
        return pool.submit(LLMEngine, config).result()


def freeze_startup_heap() -> None:
    """Once a serving process has built its engine and app: startup leaves ~380,000 long-lived
    objects (torch, transformers, the model's modules) that every collection of the oldest
    generation scans again, 220 ms for the default model on this project's CPU (measured): a
    stall of every stream, and of every 429, whenever the collector runs one while serving.
    Frozen, the collector skips them (vLLM's engine does the same); they are still freed by
    reference counting."""
    gc.collect()
    gc.freeze()
    log.info("froze %d startup objects out of the garbage collector", gc.get_freeze_count())
