"""Exit mode under each batch policy against full depth, beside the cost model's ideals.

Usage: exit_policies_vs_ideal.py MODEL BATCH POLICIES THRESHOLD (e.g. smollm2-ee 32
auto,per_sequence,batch_all 0.5). One engine per policy, held-out prompts cut to 32 tokens, 48
new tokens, ``classifier`` >= THRESHOLD; two rounds, each a full-depth run then every policy
(alternated: the machine's drift cancels in the ratios); per policy the median decode speed ratio,
the mean exit layer, the layers run per pass (``LLMEngine.stats``), the per-token and per-pass
ideals (``CostModel``) and ROUGE-L against full depth's text."""

import statistics
import sys

import torch

from eeserve.bench.measure import quality_vs, run_engine
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.cost import CostModel
from eeserve.tuning.prompts import fixed_length_ids, prompt_texts

torch.set_num_threads(2)
model, batch, policies, threshold = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
engines = {
    p: LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, exit_policy=p))
    for p in policies.split(",")
}
first = next(iter(engines.values()))
cfg = first.model_config
prompts = fixed_length_ids(first.tokenizer, prompt_texts(batch, 0, "heldout"), 32)
adapter = cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size  # a tuned linear exit head
cost = CostModel.of(cfg, adapter)
L = cfg.num_layers
full_depth = ExitParams(enabled=False)
exits = ExitParams(mode="exit", threshold=threshold, measure="classifier")
for engine in engines.values():
    run_engine(engine, prompts, 8, full_depth)  # warm-up
runs: dict[str, list[tuple[float, float]]] = {p: [] for p in engines}
last = {}
for _ in range(2):
    full = run_engine(first, prompts, 48, full_depth)
    for policy, engine in engines.items():
        passes, layer_passes = engine.stats.passes, engine.stats.layer_passes
        run = run_engine(engine, prompts, 48, exits)
        per_pass = (engine.stats.layer_passes - layer_passes) / (engine.stats.passes - passes)
        runs[policy].append((run.decode_tokens_per_s / full.decode_tokens_per_s, per_pass))
        last[policy] = (full, run)
for policy, pairs in runs.items():
    full, run = last[policy]
    ratio = statistics.median(r for r, _ in pairs)
    per_pass = statistics.median(p for _, p in pairs)
    _, rouge = quality_vs(full, run, first.tokenizer)
    ideal_token = cost.ideal_ratio(L, round(run.mean_exit_layer))
    paid = per_pass * cost.layer + cost.head + cost.adapter + (L - per_pass) * cost.kv_fill
    print(
        f"batch {batch} {policy:12s} classifier >= {threshold}: {ratio:.3f}x full depth; "
        f"mean exit {run.mean_exit_layer:.1f}; layers/pass {per_pass:.1f}; ideal per token "
        f"{ideal_token:.2f}x, per pass {(L * cost.layer + cost.head) / paid:.2f}x; "
        f"ROUGE-L {rouge:.3f}"
    )
