"""``eeserve calibrate --structured``: the threshold of constrained requests, on a constrained
workload.

Contract: ``structured_prompts(engine, name, n, split)`` gives the workload's (``extraction`` or
``classification``, ``tuning.structured_workloads``) chat prompts as token ids with the workload,
drawn with a seed of their own per split (``calib``, ``heldout``), so neither the calibration
nor its check sees the benchmark's prompts (seed 0). ``field_losses`` is the ``fields`` loss:
per prompt, 1 - the share of the full-depth answer's fields that the early-exit answer has
equal (an answer that does not parse agrees on none). The calibration itself is
``tuning.calibrate``'s; its entry carries ``structured`` (the workload), which makes
``calibration_store`` set the measure's constrained threshold (``ExitConfig.
constrained_thresholds``) and leave the free-text one and the default measure alone.
"""

from __future__ import annotations

from eeserve.engine.llm_engine import LLMEngine
from eeserve.llm import chat_token_ids
from eeserve.tuning.calibration_prompts import RunResult
from eeserve.tuning.structured_workloads import (
    Workload,
    classification,
    extraction,
    field_agreement,
)

STRUCTURED_WORKLOADS = ("extraction", "classification")
SPLIT_SEEDS = {"calib": 1000, "heldout": 2000}  # the benchmark's prompts are seed 0


def structured_prompts(
    engine: LLMEngine, name: str, n: int, split: str
) -> tuple[list[list[int]], Workload]:
    make = extraction if name == "extraction" else classification
    w = make(n, seed=SPLIT_SEEDS[split])
    return [chat_token_ids(engine.tokenizer, c) for c in w.prompts], w


def field_losses(w: Workload, run: RunResult, ref: RunResult) -> list[float]:
    return [1.0 - field_agreement(w.fields(a), w.fields(b)) for a, b in zip(run.texts, ref.texts)]
