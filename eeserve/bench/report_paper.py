"""The seed paper's comparison in ``eeserve bench report`` (``--sections paper``): batch policies
across thresholds, with the layers the hardware ran and what the cost model allows for them.

Contract:
- ``paper_blocks(run)``: per batch size one block, measured in the same interleaved repeats as
  the other sections: full depth, then each policy of ``cfg.paper_policies`` (KV debt ``fill``,
  one engine each) at each threshold of each paper measure. Every job is timed as
  ``bench.measure.run_engine`` times (greedy, EOS ignored, decode tokens/s after every request's
  first token) and reads the engine's pass counters (``LLMEngine.stats``) over exactly those
  decode passes.
- ``paper_quality(run)``: the teacher-forced held-out quality (``tuning.teacher_forced``) of every
  (measure, threshold): one set of scores, the same for every policy and batch size (per-token
  decisions; ``batch_all`` and ``auto`` exit no token earlier).
- ``paper_rows(run, blocks, quality)``: per batch, policy, measure and threshold: decode tokens/s
  and the ratio to full depth; ROUGE-L and token agreement of the text against full depth's; the
  teacher-forced perplexity ratio; the mean exit layer of the decode tokens; decoder layers run
  per decode pass (a layer counts once per pass if any row ran it: what the weight reads pay)
  and per token (summed over rows: what the arithmetic pays); and two cost-model ideals
  (``models.cost.CostModel``), both full depth's cost L·layer + head over:
  - ``ideal_token``: the mean over decode tokens of the cost of the token's own exit
    (``ideal_ratio``: e·layer + head + adapter + (L − e)·kv_fill): every row paying only its
    own layers;
  - ``ideal_pass``: the mean over decode passes of P·layer + head + adapter + (L − P)·kv_fill,
    P the layers the pass ran (L·layer + head when P = L): a pass costing the weights of the
    layers it ran, one head, and the K/V projections of the layers it skipped. Checks and the
    fill of layers that some rows ran and others skipped are left out: a bound, not a forecast.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from eeserve.bench.measure import Run, quality_vs
from eeserve.bench.report_blocks import Block, Job
from eeserve.bench.report_run import ReportRun, build_prompts
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.models.cost import CostModel
from eeserve.outputs import RequestOutput
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.calibration_prompts import run_prompts
from eeserve.tuning.teacher_forced import (
    collect_scores,
    continuation_texts,
    evaluate,
    passage_texts,
)

PASSAGE_TOKENS = 256  # held-out passages are cut to this many tokens


@dataclass
class CountedRun(Run):
    """A ``Run`` with the engine's pass counters over its decode passes."""

    pass_layers: list[int] = field(default_factory=list, repr=False)  # per decode pass
    row_layers: int = 0  # decoder layers summed over the rows of the decode passes
    decode_rows: int = 0  # rows (tokens) of the decode passes


def counted_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, exit_params: ExitParams
) -> CountedRun:
    """``run_engine``'s timing, plus the counters of every pass that starts after each request
    has its first token (the decode passes: the window of the decode tokens/s)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params, prompt_token_ids=p, exit_params=exit_params)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, RequestOutput]] = {}
    run = CountedRun(tokens_per_s=0.0, mean_itl_ms=0.0)
    while engine.has_unfinished_requests():
        decoding = len(first) == len(prompts)
        passes, layers, rows = (
            engine.stats.passes,
            engine.stats.layer_passes,
            engine.stats.row_layers,
        )
        outs = engine.step()
        now = time.perf_counter()
        if decoding and engine.stats.passes > passes:
            run.pass_layers.append(engine.stats.layer_passes - layers)
            run.row_layers += engine.stats.row_layers - rows
            run.decode_rows += len(outs)
        for out in outs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (now, out)
    end = time.perf_counter()
    completions = [done[k][1].outputs[0] for k in sorted(done, key=int)]
    itl = [(done[k][0] - first[k]) / max(1, max_tokens - 1) for k in done]
    run.tokens_per_s = len(prompts) * max_tokens / (end - start)
    run.mean_itl_ms = 1000 * statistics.mean(itl)
    run.decode_tokens_per_s = len(prompts) * (max_tokens - 1) / max(end - max(first.values()), 1e-9)
    run.outputs = [list(c.token_ids) for c in completions]
    run.exit_layers = [list(c.exit_layers) for c in completions]
    return run


# -- the plan ---------------------------------------------------------------------------------


def settings(run: ReportRun) -> list[tuple[str, float]]:
    """(measure, threshold) of every paper point, most conservative threshold first."""
    measures = run.cfg.paper_measures or [run.exit_config.default_measure]
    return [(m, t) for m in measures for t in sorted(run.cfg.thresholds_for(m), reverse=True)]


def _key(policy: str, measure: str, threshold: float) -> str:
    return f"{policy}/{measure}@{threshold:g}"


def _job(run: ReportRun, engine: LLMEngine, b: int, params: ExitParams) -> Callable[[], Run]:
    return partial(counted_run, engine, run.prompts[:b], run.cfg.max_tokens, params)


def paper_blocks(run: ReportRun) -> list[Block]:
    full_engine = next(iter(run.paper_engines.values()))
    out = []
    for b in run.batch_sizes:
        jobs: list[Job] = [("full", _job(run, full_engine, b, ExitParams(enabled=False)))]
        for policy, engine in run.paper_engines.items():
            for m, t in settings(run):
                params = ExitParams(threshold=t, measure=m)
                jobs.append((_key(policy, m, t), _job(run, engine, b, params)))
        out.append(Block(f"paper, batch {b}", b, jobs))
    return out


def paper_warm_up(run: ReportRun) -> None:
    m, t = settings(run)[-1]
    prompts = run.prompts[: min(2, max(run.batch_sizes))]  # the KV pool holds the largest batch
    for engine in run.paper_engines.values():
        counted_run(engine, prompts, 4, ExitParams(threshold=t, measure=m))


# -- teacher-forced quality ---------------------------------------------------------------------


def paper_quality(run: ReportRun) -> dict[str, Any]:
    """Held-out teacher-forced quality of every paper (measure, threshold), and its texts."""
    cfg, engine = run.cfg, next(iter(run.paper_engines.values()))
    prompts = build_prompts(run.tokenizer, cfg.paper_texts, cfg.seed, cfg.chat, "heldout")
    if cfg.paper_text_source == "generated":
        fits = [p for p in prompts if len(p) + cfg.max_tokens <= engine.max_model_len]
        ref = run_prompts(engine, fits, cfg.max_tokens, ExitParams(enabled=False))
        texts = continuation_texts(fits, ref.token_ids)
    else:
        raw = build_prompts(run.tokenizer, cfg.paper_texts, cfg.seed, False, "heldout")
        texts = passage_texts(raw, min(PASSAGE_TOKENS, engine.max_model_len))
    points = settings(run)
    plans = {(m, t): engine.exit_plan(ExitParams(threshold=t, measure=m)) for m, t in points}
    layers = sorted({lay for p in plans.values() if p is not None for lay in p.layers})
    scores = collect_scores(engine, texts, sorted({m for m, _ in points}), layers or None)
    quality = {f"{m}@{t:g}": asdict(evaluate(scores, plans[(m, t)])) for m, t in points}
    return {
        "texts": {
            "source": cfg.paper_text_source,
            "split": "heldout",
            "count": len(texts),
            "scored_tokens": scores.tokens,
            "max_tokens": cfg.max_tokens if cfg.paper_text_source == "generated" else None,
        },
        "full_perplexity": evaluate(scores, None).full_perplexity,
        "points": quality,
    }


# -- rows ---------------------------------------------------------------------------------------


def cost_model(run: ReportRun) -> CostModel:
    """The cost model of the paper engines' model and exit heads (their adapter included)."""
    engine = next(iter(run.paper_engines.values()))
    heads, xc = engine.runner.exit_loop.checks.heads, engine.exit_config
    adapter = 0
    if heads is not None and xc.head == "tuned":
        params = heads.head(xc.exit_layers[0]).named_parameters()
        adapter = sum(p.numel() for n, p in params if "classifier" not in n)
    return CostModel.of(engine.model_config, adapter)


def exit_cost(cm: CostModel, num_layers: int, layer: int, layer_heads: bool) -> float:
    """Cost of a token (or a pass) that stops at ``layer`` (``num_layers``: full depth). A
    ``layer`` head's exit at l runs layer l + 1's attention: a pass that ran P layers stopped
    its deepest rows at exit P - 1."""
    full = num_layers * cm.layer + cm.head
    if layer >= num_layers:
        return full
    return full / cm.ideal_ratio(num_layers, layer, layer_heads)


def ideals(run: ReportRun, r: CountedRun, cm: CostModel) -> dict[str, float]:
    """``ideal_token`` and ``ideal_pass`` of a run (see the module docstring)."""
    n, lh = run.num_layers, bool(run.first.runner.exit_loop.layer_heads)
    full = n * cm.layer + cm.head
    tokens = [x for per in r.exit_layers for x in per[1:]]
    token_cost = statistics.mean(exit_cost(cm, n, x, lh) for x in tokens) if tokens else full
    passes = [p - 1 if lh and p < n else p for p in r.pass_layers]
    pass_cost = statistics.mean(exit_cost(cm, n, p, lh) for p in passes) if passes else full
    return {"ideal_token": full / token_cost, "ideal_pass": full / pass_cost}


def _counts(r: CountedRun, num_layers: int) -> dict[str, float]:
    decode = [x for per in r.exit_layers for x in per[1:]]
    return {
        "decode_passes": len(r.pass_layers),
        "layers_per_iteration": statistics.mean(r.pass_layers) if r.pass_layers else float("nan"),
        "layers_per_token": r.row_layers / r.decode_rows if r.decode_rows else float("nan"),
        "mean_exit_layer": statistics.mean(decode) if decode else float(num_layers),
    }


def paper_rows(run: ReportRun, blocks: list[Block], quality: dict[str, Any]) -> dict[str, Any]:
    cm, n = cost_model(run), run.num_layers
    rows: list[dict[str, Any]] = []
    full_rows: list[dict[str, Any]] = []
    for block in blocks:
        med, b = block.median(), block.batch
        full = med["full"]
        assert isinstance(full, CountedRun)
        full_rows.append(
            {
                "batch": b,
                "decode_tok_s": full.decode_tokens_per_s,
                "itl_ms": full.mean_itl_ms,
                **_counts(full, n),
            }
        )
        for policy in run.paper_engines:
            for m, t in settings(run):
                r = med[_key(policy, m, t)]
                assert isinstance(r, CountedRun)
                agree, rouge = quality_vs(full, r, run.tokenizer)
                tf = quality["points"][f"{m}@{t:g}"]
                rows.append(
                    {
                        "batch": b,
                        "policy": policy,
                        "kv_fill": "fill",
                        "measure": m,
                        "threshold": t,
                        "decode_tok_s": r.decode_tokens_per_s,
                        "full_decode_tok_s": full.decode_tokens_per_s,
                        "ratio": r.decode_tokens_per_s / full.decode_tokens_per_s,
                        "itl_ms": r.mean_itl_ms,
                        "token_agreement": agree,
                        "rouge_l": rouge,
                        "ppl_ratio": tf["ratio"],
                        "argmax_agreement": tf["argmax_agreement"],
                        **_counts(r, n),
                        **ideals(run, r, cm),
                    }
                )
    return {
        "policies": list(run.paper_engines),
        "settings": [{"measure": m, "threshold": t} for m, t in settings(run)],
        "cost_model": asdict(cm),
        "full_depth": full_rows,
        "rows": rows,
        "teacher_forced": quality,
    }
