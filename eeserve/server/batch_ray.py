"""``eeserve batch --ray``: a batch file sharded over a Ray cluster with Ray Data.

Contract: ``run_on_ray(opts, items, emit)`` takes what ``batch.read_envelopes`` yields (read and
checked on this machine, so duplicates and resumed ``custom_id``s are handled as without Ray),
emits the error lines among them at once, and hands the envelopes to Ray Data: ``map_batches``
over a pool of ``opts.replicas`` ``EngineActor``s (one engine per actor, ``opts.threads`` CPUs
and torch threads each), each running its shard of lines through the same ``BatchProcessor`` as
the single-process path, so output lines are the same. Results stream back as shards finish and
are emitted here. Connects to ``opts.address`` (default: an existing connection, else a cluster
started on this machine, shut down afterwards). Ray is imported lazily.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.server.batch import Envelope
from eeserve.server.batch_run import BatchProcessor, Emit
from eeserve.server.replicas import import_ray, init_ray


@dataclass
class RayBatchOptions:
    engine: dict[str, Any]  # EngineConfig fields
    model_names: list[str]
    replicas: int = 2
    threads: int = 1
    address: str | None = None


class EngineActor:
    """One engine per actor; each call runs a shard of envelopes (JSON strings) to result lines."""

    def __init__(self, engine: dict[str, Any], model_names: list[str], threads: int) -> None:
        torch.set_num_threads(threads)
        self.processor = BatchProcessor(LLMEngine(EngineConfig(**engine)), model_names)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        envelopes = [Envelope(**json.loads(str(s))) for s in batch["envelope"]]
        out: list[dict[str, Any]] = []
        self.processor.run(envelopes, out.append)
        return {"result": [json.dumps(o) for o in out]}


def run_on_ray(
    opts: RayBatchOptions, items: Iterable[Envelope | dict[str, Any]], emit: Emit
) -> None:
    ray = import_ray("data")

    rows: list[dict[str, str]] = []
    for item in items:
        if isinstance(item, Envelope):
            rows.append({"envelope": json.dumps(dataclasses.asdict(item))})
        else:
            emit(item)
    if not rows:
        return
    started = not ray.is_initialized()
    if started:
        init_ray(ray, opts.address)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        # Enough shards to keep every actor busy; a shard is batched inside one engine.
        max_seqs = int(opts.engine.get("max_num_seqs", 64))
        size = max(1, min(4 * max_seqs, math.ceil(len(rows) / opts.replicas)))
        ds = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / size))
        results = ds.map_batches(
            EngineActor,
            fn_constructor_args=(opts.engine, opts.model_names, opts.threads),
            batch_size=size,
            concurrency=opts.replicas,
            num_cpus=opts.threads,
        )
        for row in results.iter_rows():
            emit(json.loads(row["result"]))
    finally:
        if started:
            ray.shutdown()
