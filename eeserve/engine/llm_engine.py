"""The engine loop: requests in, one scheduled forward pass per ``step()``, outputs out.

Contract: ``add_request`` validates and queues (raising ``ValueError`` naming the limits for a
request that could never fit); ``step`` schedules, runs the model, appends tokens, detokenizes,
applies stop conditions and frees finished requests, returning a ``RequestOutput`` for every
request that progressed; ``abort_request`` frees a request's blocks at once. No HTTP, no threads:
the server drives this from its own loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from eeserve.config import EngineConfig, ExitPolicy, KVFill, Quantization, Weights
from eeserve.engine.block_manager import BlockManager
from eeserve.engine.detokenizer import Detokenizer
from eeserve.engine.grammar import GrammarCompiler
from eeserve.engine.model_runner import ModelRunner, RunnerOptions
from eeserve.engine.plan import ExitPlan, resolve_exit_plan
from eeserve.engine.runner_output import SeqStep
from eeserve.engine.scheduler import Scheduler, SchedulerConfig
from eeserve.engine.sequence import Sequence
from eeserve.engine.speculative import SpecOutput
from eeserve.exit_params import DraftSource, ExitParams
from eeserve.kernels.gguf_linear import use_gguf_weights
from eeserve.kernels.native import load as load_native
from eeserve.models.config import ModelConfig
from eeserve.models.cost import CostModel
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import load_exit_setup
from eeserve.models.gguf_weights import read_block_weights
from eeserve.models.llama import LlamaForCausalLM
from eeserve.models.loader import (
    VARIANT_MODEL,
    load_model,
    model_gguf,
    resolve_model,
    sidecar_folders,
)
from eeserve.outputs import CompletionOutput, ExitStats, RequestOutput
from eeserve.sampling_params import SamplingParams, check_text

log = logging.getLogger(__name__)


def _attention_efficiency(device: torch.device, native: bool) -> float:
    """Attention's FLOP rate relative to the projections' when a prompt chunk attends to its
    context (``EngineConfig.attention_context``). CPU with the engine's kernels: the span kernel
    runs at ~0.6 of the float32 linear kernel's rate on the default model (264 against 430
    GFLOP/s on two cores); CPU SDPA at 0.25-0.4, where 0.4 gave passes of near equal cost
    (docs/benchmarks.md, "Attention-weighted chunks"). Elsewhere assumed equal (not measured)."""
    if device.type != "cpu":
        return 1.0
    return 0.6 if native else 0.4


def _speculative_draft(
    config: EngineConfig, exit_config: ExitConfig, device: torch.device, dtype: torch.dtype
) -> DraftSource:
    """``config.speculative_draft`` with "auto" resolved to the exit config's ``default_draft``
    where the int8 copy pays: on the engine's CPU kernels with float32 activations (elsewhere
    its projections dequantise per call, and the fused layers are float32 only). An int8 copy of
    int8 weights, or for no exits at all, is no use: "exits" then."""
    if config.speculative_draft != "auto":
        return DraftSource(config.speculative_draft)
    cpu = device.type == "cpu" and dtype == torch.float32 and config.cpu_kernels
    usable = cpu and config.quantization is None and config.exit_policy != ExitPolicy.NONE
    usable = usable and config.weights is Weights.FLOAT32  # the int8 copy is of float weights
    if usable and load_native() is not None:
        return DraftSource(exit_config.default_draft)
    return DraftSource.EXITS


def _gguf_blocks(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> Callable[[LlamaForCausalLM], None] | None:
    """With native weights, what puts the GGUF's blocks into the model at load; else None."""
    if config.weights is not Weights.NATIVE:
        return None
    native = load_native() if config.cpu_kernels else None
    if native is None or device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            "weights='native' runs on the engine's CPU kernels with float32 activations "
            "(cpu_kernels on, device cpu, dtype float32)"
        )
    if config.model == VARIANT_MODEL:
        raise ValueError(f"{VARIANT_MODEL!r} merges a base delta into float weights: use float32")
    path = model_gguf(config.model)
    return lambda model: use_gguf_weights(model, read_block_weights(path, model.config), native)


@dataclass
class EngineStats:
    """Cumulative counters of the forward passes run: what the hardware paid."""

    passes: int = 0
    layer_passes: int = 0  # decoder layers run, counted once per pass that ran them with a row
    row_layers: int = 0  # decoder layers run, summed over rows


def _num_blocks(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV blocks that ``kv_cache_memory`` holds for this model and dtype."""
    bytes_per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
    num_blocks = config.kv_cache_bytes() // (bytes_per_token * config.block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no KV block")
    return num_blocks


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device, dtype = config.resolved_device(), config.resolved_dtype()
        folder = resolve_model(config.model)
        self.model_path = folder
        model, mcfg = load_model(folder, dtype, device, blocks=_gguf_blocks(config, device, dtype))
        self.model_config = mcfg
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
        self.eos_token_ids = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        num_blocks = _num_blocks(config, mcfg, dtype)
        pool_tokens = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, pool_tokens)
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens; max_model_len %d; "
            "%d sequences of max_model_len fit",
            num_blocks,
            config.block_size,
            pool_tokens,
            self.max_model_len,
            pool_tokens // self.max_model_len,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        # A sidecar with a base delta (a model trained to exit) is merged into ``model`` here,
        # before the runner packs the weights: full depth then runs at the original's speed.
        self.exit_config, heads = load_exit_setup(
            sidecar_folders(config.model, folder),
            mcfg.num_layers,
            mcfg.hidden_size,
            mcfg.rms_norm_eps,
            model=model,
            base=folder,
        )
        self.speculative_draft = _speculative_draft(config, self.exit_config, device, dtype)
        opts = RunnerOptions(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            device=device,
            dtype=dtype,
            exit_policy=ExitPolicy(config.exit_policy),
            kv_fill=KVFill(config.kv_fill),
            cpu_kernels=config.cpu_kernels,
            quantization=Quantization(config.quantization) if config.quantization else None,
            draft=self.speculative_draft,
            screen_head=config.screen_head,
            jump_forward=config.jump_forward,
        )
        self.runner = ModelRunner(model, mcfg, opts, self.exit_config, heads)
        eos = self.tokenizer.eos_token_id
        end = int(eos) if eos is not None else min(self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size=mcfg.vocab_size, eos=end)
        self.scheduler = Scheduler(self._scheduler_config(), self.block_manager)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._counter = 0
        self.stats = EngineStats()

    def _scheduler_config(self) -> SchedulerConfig:
        config = self.config
        budget = config.batched_tokens()
        if not config.enable_chunked_prefill:  # a whole prompt must fit in one pass
            budget = max(budget, self.max_model_len)
        context = config.attention_context
        if context is None:
            device = self.runner.device
            efficiency = _attention_efficiency(device, self.runner.kv.native is not None)
            context = CostModel.of(self.model_config).attention_context(
                self.model_config, efficiency
            )
        return SchedulerConfig(config.max_num_seqs, budget, config.enable_chunked_prefill, context)

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return list(self.tokenizer(prompt).input_ids)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt token ids must be a non-empty list of ints")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        exit_params: ExitParams | None = None,
    ) -> str:
        ids = self.tokenize(prompt_token_ids if prompt_token_ids is not None else prompt)
        if not ids:
            raise ValueError("prompt is empty")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the maximum model length {self.max_model_len} (context "
                f"{self.model_config.max_position_embeddings}, KV pool "
                f"{self.block_manager.num_blocks * self.block_manager.block_size} tokens)"
            )
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        constraint = params.structured_outputs
        seq = Sequence(
            request_id,
            ids,
            params,
            exit_plan=self.exit_plan(exit_params, constrained=constraint is not None),
            grammar=self.grammars.compile(constraint) if constraint is not None else None,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self._seqs[request_id] = seq
        self._detok[request_id] = Detokenizer(self.tokenizer)
        self.scheduler.add(seq)
        return request_id

    def exit_plan(
        self, exit_params: ExitParams | None, *, constrained: bool = False
    ) -> ExitPlan | None:
        """A request's resolved exit rule (None: full depth); ``ValueError`` when it cannot be.
        ``constrained``: the request has structured outputs (their calibrated thresholds)."""
        if self.config.exit_policy == ExitPolicy.NONE:
            return None
        return resolve_exit_plan(
            exit_params,
            self.exit_config,
            ExitPolicy(self.config.exit_policy),
            self.speculative_draft,
            constrained,
        )

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")
            self._detok.pop(request_id, None)  # no final output to hand it to

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        out = self.runner.execute(sched)  # also when empty: it hears of finished requests
        if not sched.seqs:
            return []
        self.stats.passes += 1
        self.stats.layer_passes += out.layer_passes
        self.stats.row_layers += out.layers_run
        outputs = []
        for seq, n, result in zip(sched.seqs, sched.num_tokens, out.seqs):
            seq.owed = result.owed
            if result.token_id is None and result.spec is None:  # a prompt chunk: K/V only
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
            else:
                outputs.append(self._apply(seq, result))
        return outputs

    def _apply(self, seq: Sequence, r: SeqStep) -> RequestOutput:
        if r.spec is not None:
            self._apply_spec(seq, r.spec, r.confidence, r.forced)
            return self._output(seq)
        seq.num_computed_tokens = seq.num_tokens
        # The exit layer of this pass is the depth of the last position just computed: record it
        # before ``commit`` hashes that position's block, or the key lacks it and never matches
        # the key ``allocate`` computes later (a resumed sequence would miss its own blocks).
        seq.exit_layers.append(r.exit_layer)
        self.block_manager.commit(seq)
        assert r.token_id is not None
        seq.output_token_ids.append(r.token_id)
        seq.exit_confidences.append(r.confidence)
        seq.forced.append(False)
        if r.logprobs is not None:
            seq.logprobs.append(r.logprobs)
        reason = self._check_stop(seq, r.token_id)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._append_forced(seq, r.forced)
        return self._output(seq)

    def _append_forced(self, seq: Sequence, forced: list[int]) -> None:
        """Tokens the grammar forces: output without a pass of their own; their positions are
        computed (at full depth) with the next pass's row, as one chunk."""
        full = self.model_config.num_layers
        for t in forced:
            seq.output_token_ids.append(t)
            seq.exit_layers.append(full)
            seq.exit_confidences.append(1.0)
            seq.forced.append(True)
            if seq.sampling_params.logprobs is not None:
                seq.logprobs.append({t: 0.0})  # the only token the grammar allows
            if seq.spec_stats is not None:
                seq.spec_stats.record([], 0, 1)
            reason = self._check_stop(seq, t)
            if reason is not None:
                self._finish(seq, reason)
                return

    def _apply_spec(
        self, seq: Sequence, r: SpecOutput, confidence: float, forced: list[int]
    ) -> None:
        """A speculative step: keep a new draft (nothing is output, stop-checked or hashed), or
        roll the drafts back to the verified tokens and apply those one by one."""
        stats = seq.spec_stats
        assert stats is not None
        seq.num_computed_tokens = seq.num_tokens
        if r.drafted:
            seq.output_token_ids.append(r.token_ids[0])
            seq.num_drafts += 1
            return
        # Every drafted position now has full-depth K/V; positions after the first rejected
        # draft hold K/V of rejected tokens and are recomputed (overwritten) when reached.
        del seq.output_token_ids[seq.num_verified_output :]
        seq.num_drafts = 0
        kept = 0
        for t, lp in zip(r.token_ids, r.logprobs):
            kept += 1
            seq.exit_layers.append(self.model_config.num_layers)
            seq.output_token_ids.append(t)
            seq.exit_confidences.append(confidence)
            seq.forced.append(False)
            if lp is not None:
                seq.logprobs.append(lp)
            reason = self._check_stop(seq, t)
            if reason is not None:
                self._finish(seq, reason)
                break
        stats.record(r.draft_layers, r.num_accepted, kept)
        if not seq.is_finished:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.truncate(seq)
            self.block_manager.commit(seq)
            self._append_forced(seq, forced)

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling_params
        det = self._detok[seq.request_id]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            # As in vLLM: the stop token ends the token ids but is left out of the text.
            det.finish(seq.output_token_ids[:-1])
            return "stop"
        det.update(seq.output_token_ids)
        if p.stop:
            longest = max(len(s) for s in p.stop)
            start = max(0, det.checked - longest + 1)
            found = [i for i in (det.text.find(s, start) for s in p.stop) if i >= 0]
            if found:
                det.text = det.text[: min(found)]
                return "stop"
            det.checked = len(det.text)
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            det.finish(seq.output_token_ids)
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # the runner hears of it in the next step
        self._seqs.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        det = self._detok.get(seq.request_id)
        if seq.is_finished:
            self._detok.pop(seq.request_id, None)
        text = det.text if det is not None else ""
        num_layers = self.model_config.num_layers
        # Forced tokens ran no layer to be chosen: counted apart, not as full-depth tokens.
        chosen = [e for e, f in zip(seq.exit_layers, seq.forced) if not f]
        n = len(chosen)
        stats = ExitStats(
            mean_exit_layer=sum(chosen) / n if n else float(num_layers),
            layers_saved_fraction=1 - sum(chosen) / (n * num_layers) if n else 0.0,
            num_layers=num_layers,
            num_forced=len(seq.exit_layers) - n,
        )
        spec = seq.spec_stats
        if spec is not None:
            stats.acceptance_rate = (
                spec.num_accepted / spec.num_drafted if spec.num_drafted else 0.0
            )
            stats.mean_draft_length = spec.num_drafted / max(1, spec.num_verifications)
            stats.num_drafted, stats.num_accepted = spec.num_drafted, spec.num_accepted
            drafted = [x for x in spec.draft_layers if x is not None]
            stats.mean_draft_layer = sum(drafted) / len(drafted) if drafted else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=seq.output_token_ids[: seq.num_verified_output],
            finish_reason=seq.finish_reason,
            exit_layers=list(seq.exit_layers),
            exit_confidences=list(seq.exit_confidences),
            forced=list(seq.forced),
            exit_stats=stats,
            logprobs=list(seq.logprobs) if seq.sampling_params.logprobs is not None else None,
            draft_layers=list(spec.draft_layers) if spec is not None else None,
            draft_accepted=list(spec.accepted) if spec is not None else None,
        )
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            list(seq.prompt_token_ids),
            [completion],
            seq.is_finished,
            seq.num_cached_tokens,
        )
