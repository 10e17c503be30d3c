"""Model runner: owns every tensor and device call, and runs one forward pass per step.

Contract: ``execute(sched)`` takes the scheduler's output: it first drops its record of the
requests that finished and resets those preempted (``SchedulerOutput.finished_ids`` /
``preempted_ids``), then builds the batch for the scheduled sequences (each computes
``num_tokens`` positions from ``num_computed_tokens``: a whole prompt, a prompt chunk or one
decode position, after any owed positions), runs one pass and returns a ``RunnerOutput``: one
``SeqStep`` per sequence. The pass is the float model's (``ExitLoop`` when any row may leave
early, else every layer), or, when the ``Speculator`` says the int8 copy drafts every row, the
int8 copy's. Only rows that need a token reach the LM head; a prompt chunk short of its last
token samples nothing. What the runner keeps for a request between steps (owed K/V and their
hidden states, pending drafts, the draft limit) is its ``RequestState`` (``requests``); it never
changes scheduling state: the engine applies the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from eeserve.config import ExitPolicy, KVFill, Quantization
from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.engine.draft_model import Int8Drafter
from eeserve.engine.draft_vocab import SubsetHead
from eeserve.engine.exit_checks import ExitChecks, Shortlist, shortlist_rows
from eeserve.engine.exit_loop import ExitLoop
from eeserve.engine.exit_state import ExitBatch, ExitResult, SeqIdx, exit_batch
from eeserve.engine.grammar import constrain, draft_masks
from eeserve.engine.kv_fill import KVFiller
from eeserve.engine.layer_cost import layer_cost, measure_model_layers
from eeserve.engine.layer_stack import LayerStack
from eeserve.engine.request_state import RequestState, SpecControl
from eeserve.engine.runner_output import RunnerOutput, SeqStep
from eeserve.engine.sampler import Sampler, token_logprobs
from eeserve.engine.scheduler import SchedulerOutput
from eeserve.engine.sequence import Sequence
from eeserve.engine.speculator import Speculator
from eeserve.engine.weights import WeightFormat, WeightKernels, place_weights
from eeserve.exit_params import DraftSource
from eeserve.kernels.fused import FusedDecoder
from eeserve.kernels.gguf_linear import GGUFLinear
from eeserve.kernels.native import load as load_native
from eeserve.kernels.screened_head import head_logits
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM, Rotary


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """How the runner lays out the cache and the weights (from ``EngineConfig``, resolved)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    exit_policy: ExitPolicy = ExitPolicy.AUTO
    kv_fill: KVFill = KVFill.FILL
    cpu_kernels: bool = True  # the engine's own CPU kernels (else PyTorch ops only)
    quantization: Quantization | None = None
    draft: DraftSource = DraftSource.EXITS  # what drafts for speculative requests (resolved)
    screen_head: bool = True  # greedy steps: int8 screen + exact float rows (kernels.screened_head)
    jump_forward: bool = True  # constrained requests: forced tokens skip their own pass


@dataclass(frozen=True, kw_only=True)
class Batch:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttnMeta
    last_rows: list[int]  # per sequence, the row whose output is sampled


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        opts: RunnerOptions,
        exit_config: ExitConfig | None = None,
        exit_heads: ExitHeads | None = None,
    ) -> None:
        self.model, self.config, self.opts = model, config, opts
        self.device, self.dtype = opts.device, opts.dtype
        self._block_offsets = torch.arange(opts.block_size)  # [bs]: a block's slots
        native = load_native() if opts.device.type == "cpu" and opts.cpu_kernels else None
        self.native = native
        self.kernels = WeightKernels(
            device=opts.device, dtype=opts.dtype, hidden_size=config.hidden_size, native=native
        )
        self.kv = PagedKVCache(
            config.num_layers,
            opts.num_blocks * opts.block_size,
            config.num_kv_heads,
            config.head_dim,
            opts.dtype,
            opts.device,
            native,
            windows=config.layer_windows(),  # Gemma 3's local layers; None for Llama's
        )
        cos, sin = rope_tables(config, opts.max_model_len)
        self.cos, self.sin = cos.to(opts.device, opts.dtype), sin.to(opts.device, opts.dtype)
        self.sampler = Sampler()
        self.speculator = Speculator(
            sampler=self.sampler, num_layers=config.num_layers, draft=opts.draft
        )
        self.requests: dict[int, RequestState] = {}  # per Sequence.seq_id
        # The drafter and the filler copy the float weights as loaded: before they are packed.
        self.drafter = self._drafter(exit_config)
        fills = opts.kv_fill is KVFill.FILL and opts.quantization is None
        filler = (
            KVFiller.build(model) if fills and opts.exit_policy is not ExitPolicy.NONE else None
        )
        self.lm_head = place_weights(
            model,
            exit_heads,
            kernels=self.kernels,
            quantization=opts.quantization,
            screen_head=opts.screen_head,
            drafter_head=self.drafter.lm_head if self.drafter is not None else None,
        )
        # Whole layers in one kernel call for every pass (None: not every projection is on
        # the engine's kernels, e.g. bfloat16 through oneDNN, or no kernels).
        fused = FusedDecoder.build(model, native) if opts.dtype == torch.float32 else None
        self.stack = LayerStack(model, self.kv, fused)
        self.exit_loop = self._exit_loop(exit_config, exit_heads, filler)

    def _drafter(self, exit_config: ExitConfig | None) -> Int8Drafter | None:
        """The int8 copy that drafts for speculative requests (``draft`` int8), else None."""
        if self.opts.draft is not DraftSource.INT8:
            return None
        vocab = (
            exit_config.draft_ids(self.config.vocab_size, DraftSource.INT8) if exit_config else None
        )
        return Int8Drafter(self.model, self.kv, self.native, self.dtype, vocab)

    def _exit_loop(
        self, exit_config: ExitConfig | None, heads: ExitHeads | None, filler: KVFiller | None
    ) -> ExitLoop:
        """The exit loop, with its checks (shortlist included), cost model and draft head."""
        shared = exit_config is None or exit_config.head == "shared"
        checks = ExitChecks(
            model=self.model,
            lm_head=self.lm_head,
            heads=heads,
            shared_head=shared,
            shortlist=self._shortlist(exit_config, heads),
        )
        cost = None
        if self.opts.exit_policy is ExitPolicy.AUTO:
            d = self.config.hidden_size
            measure = partial(measure_model_layers, self.model.layers, d, self.cos, self.sin)
            cost = layer_cost(self._cost_key(), measure)
        vocab = (
            exit_config.draft_ids(self.config.vocab_size, DraftSource.EXITS)
            if exit_config
            else None
        )
        return ExitLoop(
            model=self.model,
            kv=self.kv,
            stack=self.stack,
            lm_head=self.lm_head,
            checks=checks,
            layer_heads=not shared and heads is not None and heads.layer_heads,
            filler=filler,
            cost=cost,
            draft_head=self._draft_head(vocab),
        )

    def _shortlist(
        self, exit_config: ExitConfig | None, heads: ExitHeads | None
    ) -> Shortlist | None:
        """The shortlist checks' LM-head rows, in the runner's weight format (None: no
        shortlist in the exit config)."""
        if exit_config is None or not exit_config.shortlist:
            return None
        rows = shortlist_rows(exit_config, self.config, heads)
        ids = torch.tensor(exit_config.shortlist[:rows], dtype=torch.long, device=self.device)
        quantized = self.opts.quantization is not None
        fmt = WeightFormat.INT8 if quantized else WeightFormat.FLOAT
        return Shortlist(
            weight=self.model.lm_head.weight[ids].detach(),
            linear=partial(self.kernels.linear, fmt=fmt),
            norm=self.kernels.norm,
            fold_adapter=not quantized,
        )

    def _draft_head(self, ids: list[int] | None) -> torch.nn.Module | None:
        """Exit-head drafts over the token ids ``ids`` (None: all of them, the LM head)."""
        if ids is None:
            return None
        rows = self.kernels.linear(self.model.lm_head.weight[ids], None, WeightFormat.FLOAT)
        return SubsetHead(rows, ids, self.config.vocab_size, self.device)

    def set_draft_vocab(self, ids: list[int] | None) -> None:
        """Exit-head drafts over the token ids ``ids`` from now on (None: all of them)."""
        self.exit_loop.draft_head = self._draft_head(ids)

    def _cost_key(self) -> str:
        """What a layer's cost depends on: the model's shape, the weights' format, the device
        and the threads."""
        c, o = self.config, self.opts
        kernels = "native" if self.native is not None else "torch"
        blocks = isinstance(self.model.lm_head, GGUFLinear)  # native weights: GGUF blocks
        fmt = o.quantization or ("gguf" if blocks else "float")
        return (
            f"{type(self.model).__name__}-d{c.hidden_size}-i{c.intermediate_size}-h{c.num_heads}"
            f"-kv{c.num_kv_heads}-hd{c.head_dim}-{str(o.dtype).removeprefix('torch.')}"
            f"-{fmt}-{kernels}-{o.device.type}-t{torch.get_num_threads()}"
            f"-l{c.num_layers}"
        )

    # -- requests ----------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> list[RequestState]:
        """Drops the records of finished requests, resets the preempted ones, and returns the
        scheduled sequences' records (a request's is made the first time it is scheduled)."""
        for seq_id in sched.finished_ids:
            self.requests.pop(seq_id, None)
            self.sampler.release(seq_id)
        for seq_id in sched.preempted_ids:
            if (state := self.requests.get(seq_id)) is not None:
                state.preempted()
        return [self._state(seq) for seq in sched.seqs]

    def _state(self, seq: Sequence) -> RequestState:
        state = self.requests.get(seq.seq_id)
        if state is None:
            plan = seq.exit_plan
            spec = (
                SpecControl(max_drafts=plan.num_draft_tokens) if seq.speculative and plan else None
            )
            matcher = seq.grammar.matcher() if seq.grammar is not None else None
            state = self.requests[seq.seq_id] = RequestState(spec=spec, matcher=matcher)
        return state

    # -- inputs ------------------------------------------------------------------------------

    def _context(self, seq: Sequence, end: int) -> torch.Tensor:
        """[end] the slots of positions 0..end-1 (computed by block, not by position)."""
        bs = self.opts.block_size
        blocks = torch.tensor(seq.block_table[: (end + bs - 1) // bs], dtype=torch.long)
        return (blocks[:, None] * bs + self._block_offsets).view(-1)[:end]

    def prepare(
        self, seqs: list[Sequence], num_tokens: list[int], owed: list[tuple[int, ...]]
    ) -> Batch:
        """Rows: each sequence's ``owed`` positions (ascending), then its ``num_tokens`` new
        ones."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        spans: list[SeqSpan] = []
        last_rows: list[int] = []
        for seq, n, debt in zip(seqs, num_tokens, owed):
            start = seq.num_computed_tokens
            end = start + n
            pos = [*debt, *range(start, end)]
            rows = list(range(len(ids), len(ids) + len(pos)))
            all_ids = seq.token_ids
            ids.extend(all_ids[p] for p in pos)
            positions.extend(pos)
            context = self._context(seq, end)
            slots.extend(
                [context[list(debt)], context[start:end]] if debt else [context[start:end]]
            )
            fresh = start == 0 and not debt
            spans.append(SeqSpan(rows, pos, context.to(self.device), fresh))
            last_rows.append(rows[-1])
        dev = self.device
        slot_t = torch.cat(slots).to(dev)
        meta = AttnMeta.build(spans, slot_t, self.kv.k.dtype, self.kv.rowwise_max_rows)
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            last_rows=last_rows,
        )

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, Rotary]:
        """The pass's embeddings [N, D] and rotary tables."""
        rot = Rotary(self.cos[batch.positions], self.sin[batch.positions])
        return self.model.embed(batch.input_ids), rot

    # -- passes ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Full-depth pass. Returns the final normed hidden states of ``last_rows`` [S, D] and
        the decoder layers computed."""
        h, rot = self._inputs(batch)
        h = self.stack.run(h, rot, batch.meta, 0, self.config.num_layers)
        rows = batch.last_rows
        h_last = h[rows[0] :] if rows == list(range(rows[0], h.shape[0])) else h[rows]
        return self.model.final_norm(h_last), h.shape[0] * self.config.num_layers

    def logits(
        self,
        normed: torch.Tensor,
        live: list[bool] | None = None,
        argmax_only: bool = False,
        allowed: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """[S, D] final-normed hidden -> [S, V] float32 logits (``argmax_only``: exact only where
        a row's maximum, over its ``allowed`` [V] bool ids where given, can be:
        ``kernels.screened_head``). Rows not ``live`` (a prompt chunk short of its last token:
        nothing reads them) stay zero rather than pay a pass over the LM head's weights (~4 ms
        on CPU for a chunk alone)."""
        if live is None or all(live):
            return head_logits(self.lm_head, normed, argmax_only, allowed)
        out = torch.zeros(len(live), self.config.vocab_size, device=normed.device)
        rows = [i for i, ok in enumerate(live) if ok]
        if rows:
            sub = None if allowed is None else [allowed[i] for i in rows]
            out[rows] = head_logits(self.lm_head, normed[rows], argmax_only, sub)
        return out

    def _head_masks(
        self, seqs: list[Sequence], states: list[RequestState], sampling: list[bool]
    ) -> dict[SeqIdx, list[torch.Tensor]]:
        """Per constrained sequence that samples: the tokens [V] bool its grammar allows at each
        position whose token the LM head chooses (drafts being verified, then the next), so the
        screened head can serve it (``kernels.screened_head``)."""
        out: dict[SeqIdx, list[torch.Tensor]] = {}
        for i, (seq, state, ok) in enumerate(zip(seqs, states, sampling)):
            if ok and state.matcher is not None:
                k = len(state.drafts)
                drafts = seq.output_token_ids[len(seq.output_token_ids) - k :] if k else []
                out[SeqIdx(i)] = draft_masks(state.matcher, drafts)
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One forward pass over ``sched``'s sequences (none: only the records are updated)."""
        states = self._update_states(sched)
        seqs, counts = sched.seqs, sched.num_tokens
        if not seqs:
            return RunnerOutput(seqs=[])
        sampling = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts)]
        if self.speculator.int8_step(seqs, states, counts, sampling):
            return self._int8_pass(seqs, states)
        return self._float_pass(seqs, states, counts, sampling)

    def _int8_pass(self, seqs: list[Sequence], states: list[RequestState]) -> RunnerOutput:
        """The int8 copy drafts one token per sequence from its next position, whose embedding
        is then the owed input of its layers (all of them: verification recomputes them)."""
        assert self.drafter is not None
        batch = self.prepare(seqs, [1] * len(seqs), [()] * len(seqs))
        h0, rot = self._inputs(batch)
        logits = self.drafter.logits(h0, rot, batch.meta)  # [n, V]
        steps = self.speculator.int8_drafts(seqs, states, logits, h0)
        full = self.config.num_layers
        return RunnerOutput(seqs=steps, layers_run=len(seqs) * full, layer_passes=full)

    def _float_pass(
        self,
        seqs: list[Sequence],
        states: list[RequestState],
        counts: list[int],
        sampling: list[bool],
    ) -> RunnerOutput:
        """The float model's pass over ``seqs`` (exits, verifications, prompt chunks)."""
        batch = self.prepare(seqs, counts, [s.owed_positions for s in states])
        full = self.config.num_layers
        argmax_only = all(s.sampling_params.argmax_only for s in seqs)
        masks = self._head_masks(seqs, states, sampling) if argmax_only else {}
        eb = self._exit_batch(seqs, states, batch, sampling, argmax_only, masks)
        res: ExitResult | None = None
        layer_passes = full
        if eb is None:
            normed, layers_run = self.forward(batch)
            allowed = (
                [m[-1] if (m := masks.get(SeqIdx(i))) else None for i in range(len(seqs))]
                if masks
                else None
            )
            logits = self.logits(normed, sampling, argmax_only, allowed)
            steps = [SeqStep(exit_layer=full) for _ in seqs]
        else:
            h0, rot = self._inputs(batch)
            res = self.exit_loop.run(h0, rot, batch.meta, eb)
            logits, layers_run, layer_passes = res.logits, res.layers_run, res.layer_passes
            steps = [
                SeqStep(exit_layer=e, confidence=c)
                for e, c in zip(res.exit_layers, res.confidences)
            ]
        self._sample(seqs, states, sampling, logits, steps)
        for i, (seq, state, step) in enumerate(zip(seqs, states, steps)):
            if state.spec is not None and sampling[i]:
                owed = res.verify_logits.get(SeqIdx(i)) if res is not None else None
                step.spec = self.speculator.result(seq, state, step, logits[i], owed)
            step.owed = state.owed_positions
            if sampling[i]:
                step.forced = self._forced(seq, state, step)
        return RunnerOutput(seqs=steps, layers_run=layers_run, layer_passes=layer_passes)

    def _exit_batch(
        self,
        seqs: list[Sequence],
        states: list[RequestState],
        batch: Batch,
        sampling: list[bool],
        argmax_only: bool,
        masks: dict[SeqIdx, list[torch.Tensor]],
    ) -> ExitBatch | None:
        """Exit rules of this step, or None when every row runs to full depth."""
        if self.opts.exit_policy is ExitPolicy.NONE:
            return None
        # The first token comes from the prefill, which never exits; a prompt chunk that stops
        # short of the last token samples nothing and is no part of ``batch_all``'s batch.
        decoding = [bool(s.output_token_ids) and ok for s, ok in zip(seqs, sampling)]
        plans = [
            self.speculator.step_plan(s, st) if d else None
            for s, st, d in zip(seqs, states, decoding)
        ]
        self.speculator.exit_plans(states, plans, sum(decoding))
        return exit_batch(
            seqs=seqs,
            states=states,
            meta=batch.meta,
            last_rows=batch.last_rows,
            plans=plans,
            decoding=decoding,
            policy=self.opts.exit_policy,
            kv_fill=self.opts.kv_fill,
            num_layers=self.config.num_layers,
            argmax_only=argmax_only,
            head_masks=masks,
        )

    def _sample(
        self,
        seqs: list[Sequence],
        states: list[RequestState],
        sampling: list[bool],
        logits: torch.Tensor,
        steps: list[SeqStep],
    ) -> None:
        """One batched draw for every row that samples, except verifications (their tokens come
        from the speculator); logprobs for rows that asked, except drafts (theirs come with the
        verified tokens). A constrained row draws among the tokens its grammar allows, which then
        accepts the token. A prompt chunk short of its last token samples nothing (its seeded
        generator waits)."""
        full = self.config.num_layers
        verifying = [self.speculator.verifies(st, s.exit_layer) for st, s in zip(states, steps)]
        rows = [i for i, (v, ok) in enumerate(zip(verifying, sampling)) if ok and not v]
        if not rows:
            return
        fallback = {i: m for i in rows if (m := states[i].matcher) and not constrain(m, logits[i])}
        picked = self.sampler.sample(
            logits[rows] if len(rows) < len(seqs) else logits,
            [seqs[i].sampling_params for i in rows],
            [seqs[i].seq_id for i in rows],
        )
        for i, token in zip(rows, picked.cpu().tolist()):
            seq, step, matcher = seqs[i], steps[i], states[i].matcher
            if i in fallback:  # a draft head that covers none of the allowed tokens
                token = fallback[i].first_allowed()
                logits[i, token] = 0.0  # the draft's distribution: that token alone
            step.token_id = token
            if matcher is not None:
                matcher.accept([token])
            n = seq.sampling_params.logprobs
            if n is not None and not (states[i].spec is not None and step.exit_layer < full):
                step.logprobs = token_logprobs(logits[i], token, n)

    def _forced(self, seq: Sequence, state: RequestState, step: SeqStep) -> list[int]:
        """The tokens the grammar forces after this step's verified tokens (none after a draft:
        the next draft is forced by the mask alone), within ``max_tokens`` and the context."""
        if state.matcher is None or not self.opts.jump_forward:
            return []
        if step.spec is not None and step.spec.drafted:
            return []
        made = len(step.spec.token_ids) if step.spec is not None else 1
        room = min(
            seq.sampling_params.max_tokens - seq.num_verified_output,
            self.opts.max_model_len - (seq.num_tokens - seq.num_drafts),
        )
        return state.matcher.forced(room - made)
