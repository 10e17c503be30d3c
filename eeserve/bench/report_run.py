"""The measuring half of ``eeserve bench report`` (see ``bench.report`` for the contract).

Contract: ``ReportRun(cfg)`` loads one engine per exit policy and KV-debt strategy that its
sections use (``engine_keys``; prefix caching off, a KV pool sized for the largest batch that
fits, ``report_memory``), the HF model (for section 3) and the prompts (``build_prompts``);
``blocks`` are the jobs of sections 1-3, measured side by side by ``report_blocks.run_blocks``,
and ``rows`` turns their medians into rows of raw figures. Every early-exit row carries its speed
next to full depth measured in the same interleaved repeats, its quality against the full-depth
text and its exit telemetry. The operating point (``operating_point``) and the frontier's points
(``frontier_settings``) come from the command line, else from the model's exit config.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eeserve.bench.measure import Run, quality_vs, run_engine, run_hf, token_agreement_mean
from eeserve.bench.report_blocks import Block, Job
from eeserve.bench.report_config import ReportConfig
from eeserve.bench.report_memory import fit_batch_sizes, kv_bytes
from eeserve.config import EngineConfig
from eeserve.engine.llm_engine import LLMEngine
from eeserve.exit_params import ExitParams
from eeserve.llm import chat_token_ids
from eeserve.models.exit_config import ExitConfig
from eeserve.models.loader import read_config, resolve_model
from eeserve.tuning.prompts import prompt_texts
from eeserve.tuning.provenance import machine_description

PROB_MEASURES = ("softmax_margin", "max_prob", "classifier")

# -- what the run measures ------------------------------------------------------------------


def build_prompts(
    tokenizer: Any, n: int, seed: int, chat: bool, split: str = "bench"
) -> list[list[int]]:
    """``n`` prompts of the offline ``split`` as token ids, in the chat template when ``chat``
    and the tokenizer has one."""
    texts = prompt_texts(n, seed=seed, split=split)
    if chat and getattr(tokenizer, "chat_template", None):
        return [chat_token_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return [list(tokenizer(t).input_ids) for t in texts]


def operating_point(cfg: ReportConfig, xc: ExitConfig) -> tuple[str, float, str]:
    """(measure, threshold, where the threshold came from) of the paper comparison."""
    measure = cfg.measure or xc.default_measure
    if cfg.threshold is not None:
        return measure, cfg.threshold, "--threshold"
    default = xc.thresholds.get(measure)
    if isinstance(default, (int, float)):
        return measure, float(default), "exit config default"
    cal = [c for c in xc.calibration if c.get("measure") == measure]
    if cal:
        return measure, float(cal[0]["threshold"]), "calibrated"  # type: ignore[arg-type]
    return measure, 0.99 if measure == "hidden_cosine" else 0.9, "report default"


def frontier_settings(cfg: ReportConfig, xc: ExitConfig) -> list[tuple[str, float, str]]:
    """(measure, threshold, source) for every frontier point, sorted by measure and threshold."""
    measures = cfg.measures or ["softmax_margin", "max_prob", "hidden_cosine"] + (
        ["classifier"] if xc.classifier else []
    )
    points: dict[tuple[str, float], str] = {}
    for m in measures:
        for t in cfg.thresholds if m in PROB_MEASURES else cfg.cosine_thresholds:
            points[(m, t)] = "sweep"
        default = xc.thresholds.get(m)
        if isinstance(default, (int, float)):
            points[(m, float(default))] = "default"
        for c in xc.calibration:
            if c.get("measure") == m:
                threshold = float(c["threshold"])  # type: ignore[arg-type]
                points[(m, threshold)] = f"calibrated δ={c.get('delta')}"
    return [(m, t, s) for (m, t), s in sorted(points.items())]


def engine_keys(cfg: ReportConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(policy, KV-debt strategy) of the engines that sections 1-4 and speculative use, and of
    those the paper section uses (``fill``; the same engine where both need it)."""
    exits = [(p, f) for p in cfg.policies for f in cfg.kv_fills]
    paper = [(p, "fill") for p in cfg.paper_policies] if "paper" in cfg.sections else []
    return (exits if {"exit", "speculative"} & set(cfg.sections) else []), paper


# -- the run -------------------------------------------------------------------------------


class ReportRun:
    """Engines (one per policy and KV-debt strategy), the HF model and the prompts of one run."""

    def __init__(self, cfg: ReportConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.folder = resolve_model(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        n = max([*cfg.batch_sizes, cfg.frontier_batch])
        self.prompts = build_prompts(self.tokenizer, n, cfg.seed, cfg.chat)
        probe = EngineConfig(model=cfg.model, dtype=cfg.dtype)
        self.device, self.dtype = probe.resolved_device(), probe.resolved_dtype()
        size = self.dtype.itemsize
        exit_keys, paper_keys = engine_keys(cfg)
        keys = list(dict.fromkeys(exit_keys + paper_keys))
        self.batch_sizes, self.skipped = fit_batch_sizes(
            cfg, self.folder, self.prompts, self.device, size, len(keys)
        )
        self.frontier_batch = min(cfg.frontier_batch, max(self.batch_sizes))
        n = max(self.batch_sizes)
        kv = kv_bytes(read_config(self.folder), self.prompts[:n], cfg.max_tokens, size)
        engine = partial(
            EngineConfig,
            model=cfg.model,
            dtype=cfg.dtype,
            enable_prefix_caching=False,
            max_num_seqs=n,
            kv_cache_memory=kv,
        )
        # Exits draft on these engines (speculative section); the int8 drafter has its own.
        built = {
            (p, f): LLMEngine(engine(exit_policy=p, kv_fill=f, speculative_draft="exits"))
            for p, f in keys
        }
        self.engines = {k: built[k] for k in exit_keys}  # sections 1-4 and speculative
        self.paper_engines = {p: built[(p, f)] for p, f in paper_keys}  # ``report_paper``
        self.first = next(iter(built.values()))
        spec_int8 = "speculative" in cfg.sections and "int8" in cfg.speculative_drafts
        self.int8_drafter = (
            LLMEngine(engine(exit_policy=cfg.policies[0], speculative_draft="int8"))
            if spec_int8
            else None
        )
        self.exit_config = self.first.exit_config
        self.num_layers = self.first.model_config.num_layers
        self.op = operating_point(cfg, self.exit_config)
        self.settings = frontier_settings(cfg, self.exit_config)
        self.hf = self._load_hf() if cfg.hf and "exit" in cfg.sections else None
        self.pad = int(self.tokenizer.pad_token_id or 0)

    def _load_hf(self) -> Any:
        hf: Any = AutoModelForCausalLM.from_pretrained(self.folder, dtype=self.dtype)
        return hf.to(self.device).eval()

    def engine_job(self, engine: LLMEngine, b: int, params: ExitParams) -> Callable[[], Run]:
        return partial(run_engine, engine, self.prompts[:b], self.cfg.max_tokens, params)

    def _hf_job(self, b: int) -> Callable[[], Run]:
        return partial(
            run_hf, self.hf, self.prompts[:b], self.cfg.max_tokens, self.pad, self.device
        )

    def warm_up(self) -> None:
        measure, threshold, _ = self.op
        prompts = self.prompts[: min(2, max(self.batch_sizes))]  # the KV pool's largest batch
        for engine in self.engines.values():
            run_engine(engine, prompts, 4, ExitParams(enabled=False))
            run_engine(engine, prompts, 4, ExitParams(threshold=threshold, measure=measure))
        if self.hf is not None:
            run_hf(self.hf, prompts, 4, self.pad, self.device)

    def blocks(self) -> list[Block]:
        """One block per batch size (full depth, early exit per engine, HF), then the frontier."""
        measure, threshold, _ = self.op
        full, params = ExitParams(enabled=False), ExitParams(threshold=threshold, measure=measure)
        out = []
        for b in self.batch_sizes:
            jobs: list[Job] = [("full", self.engine_job(self.first, b, full))]
            jobs += [
                (f"{p}/{f}", self.engine_job(e, b, params)) for (p, f), e in self.engines.items()
            ]
            if self.hf is not None:
                jobs.append(("hf", self._hf_job(b)))
            out.append(Block(f"batch {b}", b, jobs))
        b = self.frontier_batch
        jobs = [("full", self.engine_job(self.first, b, full))]
        for m, t, _ in self.settings:
            jobs.append(
                (f"{m}@{t:g}", self.engine_job(self.first, b, ExitParams(threshold=t, measure=m)))
            )
        return [*out, Block(f"frontier, batch {b}", b, jobs)]

    def rows(self, blocks: list[Block]) -> dict[str, list[dict[str, Any]]]:
        """Sections 1-3 from the measured blocks (medians)."""
        measure, threshold, _ = self.op
        out: dict[str, list[dict[str, Any]]] = {"paper": [], "full_depth": [], "hf": []}
        row = partial(_ee_row, tokenizer=self.tokenizer, num_layers=self.num_layers)
        for block in blocks[:-1]:
            med, b = block.median(), block.batch
            full = med["full"]
            out["full_depth"].append(
                {
                    "batch": b,
                    "decode_tok_s": full.decode_tokens_per_s,
                    "tok_s": full.tokens_per_s,
                    "itl_ms": full.mean_itl_ms,
                }
            )
            for p, f in self.engines:
                ee = row(
                    med[f"{p}/{f}"],
                    full,
                    batch=b,
                    policy=p,
                    kv_fill=f,
                    measure=measure,
                    threshold=threshold,
                )
                out["paper"].append(ee)
            if "hf" in med:
                out["hf"].append(_hf_row(med["hf"], full, b))
        med, (policy, kv_fill) = blocks[-1].median(), next(iter(self.engines))
        out["frontier"] = [
            row(
                med[f"{m}@{t:g}"],
                med["full"],
                batch=blocks[-1].batch,
                policy=policy,
                kv_fill=kv_fill,
                measure=m,
                threshold=t,
                source=s,
            )
            for m, t, s in self.settings
        ]
        return out

    def meta(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        measure, threshold, source = self.op
        machine = machine_description() | {
            "os_cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": str(self.device),
        }
        return {
            "command": self.cfg.command,
            "config": asdict(self.cfg),
            "machine": machine,
            "model": self.cfg.model,
            "model_path": str(self.folder),
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_layers": self.num_layers,
            "exit_config": asdict(self.exit_config),
            "prompts": {
                "source": "eeserve.tuning.prompts.prompt_texts",
                "split": "bench",
                "seed": self.cfg.seed,
                "count": len(self.prompts),
                "format": "chat" if self.cfg.chat else "raw",
                "tokens_min": min(lengths),
                "tokens_median": statistics.median(lengths),
                "tokens_max": max(lengths),
            },
            "max_tokens": self.cfg.max_tokens,
            "repeats": self.cfg.repeats,
            "batch_sizes": self.batch_sizes,
            "skipped_batch_sizes": self.skipped,
            "operating_point": {"measure": measure, "threshold": threshold, "source": source},
            "frontier_batch": self.frontier_batch,
        }


# -- rows ------------------------------------------------------------------------------------


def telemetry(run: Run, num_layers: int) -> dict[str, Any]:
    layers = [x for per_request in run.exit_layers for x in per_request]
    decode = [x for per_request in run.exit_layers for x in per_request[1:]]
    hist = Counter(layers)
    mean = statistics.mean(layers) if layers else float(num_layers)
    return {
        "histogram": {str(k): hist[k] for k in sorted(hist)},
        "tokens": len(layers),
        "mean_layers_per_token": mean,
        "mean_exit_layer_decode": statistics.mean(decode) if decode else float(num_layers),
        "layers_saved_fraction": 1 - mean / num_layers,
    }


def _speed(run: Run, full: Run) -> dict[str, float]:
    return {
        "decode_tok_s": run.decode_tokens_per_s,
        "full_decode_tok_s": full.decode_tokens_per_s,
        "ratio": run.decode_tokens_per_s / full.decode_tokens_per_s,
        "itl_ms": run.mean_itl_ms,
        "full_itl_ms": full.mean_itl_ms,
    }


def _ee_row(run: Run, full: Run, *, tokenizer: Any, num_layers: int, **keys: Any) -> dict[str, Any]:
    agree, rouge = quality_vs(full, run, tokenizer)
    return {
        **keys,
        **_speed(run, full),
        "token_agreement": agree,
        "rouge_l": rouge,
        "telemetry": telemetry(run, num_layers),
    }


def _hf_row(h: Run, full: Run, b: int) -> dict[str, Any]:
    return {
        "batch": b,
        "decode_tok_s": h.decode_tokens_per_s,
        "tok_s": h.tokens_per_s,
        "itl_ms": 1000 * b / h.decode_tokens_per_s,  # every step makes one token per row
        "engine_full_decode_tok_s": full.decode_tokens_per_s,
        "engine_vs_hf": full.decode_tokens_per_s / h.decode_tokens_per_s,
        "token_agreement_engine_vs_hf": token_agreement_mean(full.outputs, h.outputs),
    }
