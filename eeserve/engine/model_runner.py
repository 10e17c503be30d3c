"""Model runner: owns every tensor and device call.

Contract: ``execute(seqs, num_tokens)`` builds the batch for the scheduled sequences (each
computes ``num_tokens`` positions from ``num_computed_tokens``: a whole prompt, a prompt chunk
or one decode position, after any owed ``recompute`` positions), runs the layers one at a time
over the paged KV cache, asks the exit planner after each exit layer which rows leave, pays their
KV debt, projects to the vocabulary only the rows that need a token, samples the sequences whose
positions reach their last token (a prompt chunk that does not samples nothing), and returns
tokens plus per-row exit telemetry. With the int8 drafter (``speculative_draft="int8"``) a
step whose rows all draft runs the int8 copy instead (``_draft``: one draft per sequence, its
position owed from layer 1); any other step is the float model's pass, which verifies owed
drafts. It never changes scheduling state: the engine applies the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.engine.draft_model import Int8Drafter
from eeserve.engine.exit_loop import ExitBatch, ExitLoop, Passenger
from eeserve.engine.layer_stack import LayerStack
from eeserve.engine.sampler import Sampler, token_logprobs
from eeserve.engine.sequence import Sequence
from eeserve.engine.speculative import (
    DRAFT_MAX_BATCH,
    INT8_DRAFT_MAX_BATCH,
    VERIFY_MAX_ROWS,
    SpecDecoder,
    SpecOutput,
)
from eeserve.kernels.fused import FusedDecoder
from eeserve.kernels.native import load as load_native
from eeserve.kernels.packing import (
    PackedLinear,
    can_pack,
    pack_for_cpu,
    pack_linears,
    use_native_ops,
)
from eeserve.kernels.quant import Int8Linear, quantize_linears, quantize_model
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM, Rotary


@dataclass
class StepOutput:
    token_ids: list[int | None]  # per sequence; None: a prompt chunk that samples nothing yet
    exit_layers: list[int]  # 1-based layer each token came from (L = full depth)
    confidences: list[float]
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    layers_run: int = 0  # sum over rows of decoder layers computed (telemetry, tests)
    # ``recompute``: per sequence, the positions owed after this step -> layer reached (None:
    # unchanged).
    kv_debt: list[dict[int, int] | None] = field(default_factory=list)
    # ``speculative`` sequences: a new draft or a verification's tokens (None: other modes).
    spec: list[SpecOutput | None] = field(default_factory=list)


@dataclass
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
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        exit_config: ExitConfig | None = None,
        exit_heads: ExitHeads | None = None,
        exit_policy: str = "per_sequence",
        kv_fill: str = "fill",
        cpu_kernels: bool = True,
        quantization: str | None = None,
        speculative_draft: str = "exits",
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self._block_offsets = torch.arange(block_size)  # [bs]: a block's slots from its first
        self.device = device
        self.dtype = dtype
        native = load_native() if device.type == "cpu" and cpu_kernels else None
        self.native = native
        self.kv = PagedKVCache(
            config.num_layers,
            num_blocks * block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            device,
            native,
        )
        cos, sin = rope_tables(config, max_model_len)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        self.sampler = Sampler()
        self.spec = SpecDecoder(self.sampler)
        self.lm_head: torch.nn.Module = model.lm_head
        # Built from the float weights before they are patched, packed or quantised below.
        self.drafter = (
            Int8Drafter(model, self.kv, native, dtype) if speculative_draft == "int8" else None
        )
        if native is not None:
            use_native_ops(model, native)
        if exit_heads is not None:
            exit_heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
        if quantization == "int8":
            # Every size, tiny test models included: quantisation is asked for, not a speed-up.
            ops = native if device.type == "cpu" else None
            quantize_model(model, ops)
            self.lm_head = Int8Linear(model.lm_head.weight, None, ops)
            if exit_heads is not None:
                quantize_linears(exit_heads, ops)
        elif can_pack(device, dtype, config.hidden_size, native):
            pack_for_cpu(model, native)
            self.lm_head = PackedLinear(model.lm_head.weight, None, native)
            if exit_heads is not None:
                pack_linears(exit_heads, native)
        self._debt_hidden: dict[int, dict[int, torch.Tensor]] = {}
        self.exit_policy = exit_policy
        self.kv_fill = kv_fill
        shared = exit_config is None or exit_config.head == "shared"
        # Whole layers in one kernel call for every pass (None: not every projection is on
        # the engine's kernels, e.g. bfloat16 through oneDNN, or no kernels).
        fused = FusedDecoder.build(model, native) if dtype == torch.float32 else None
        self.stack = LayerStack(model, self.kv, fused)
        self.exit_loop = ExitLoop(model, self.kv, self.lm_head, exit_heads, shared, self.stack)
        if exit_config is not None and 0 < exit_config.draft_vocab < config.vocab_size:
            self.set_draft_vocab(exit_config.draft_vocab)

    def set_draft_vocab(self, n: int) -> None:
        """Speculative drafts over the first ``n`` token ids (0: the whole vocabulary)."""
        weight = self.model.lm_head.weight[:n].detach()
        packable = can_pack(self.device, self.dtype, self.config.hidden_size, self.native)
        dense = partial(F.linear, weight=weight)
        head = PackedLinear(weight, None, self.native) if packable else dense
        self.exit_loop.draft_head = head if 0 < n < self.config.vocab_size else None  # type: ignore[assignment]

    # -- inputs ------------------------------------------------------------------------------

    def _context(self, seq: Sequence, end: int) -> torch.Tensor:
        """[end] the slots of positions 0..end-1 (computed by block, not by position)."""
        bs = self.block_size
        blocks = torch.tensor(seq.block_table[: (end + bs - 1) // bs], dtype=torch.long)
        return (blocks[:, None] * bs + self._block_offsets).view(-1)[:end]

    def prepare(self, seqs: list[Sequence], num_tokens: list[int], owed: bool = True) -> Batch:
        """Rows: each sequence's owed positions (``recompute`` debt; not with ``owed=False``),
        then its new positions."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        spans: list[SeqSpan] = []
        last_rows: list[int] = []
        for seq, n in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            end = start + n
            debt = sorted(seq.kv_debt) if owed else []
            pos = debt + list(range(start, end))
            rows = list(range(len(ids), len(ids) + len(pos)))
            all_ids = seq.token_ids
            ids.extend(all_ids[p] for p in pos)
            positions.extend(pos)
            context = self._context(seq, end)
            slots.extend([context[debt], context[start:end]] if debt else [context[start:end]])
            fresh = start == 0 and not seq.kv_debt
            spans.append(SeqSpan(rows, pos, context.to(self.device), fresh))
            last_rows.append(rows[-1])
        dev = self.device
        slot_t = torch.cat(slots).to(dev)
        meta = AttnMeta.build(spans, slot_t, self.kv.k.dtype, self.kv.rowwise_max_rows)
        return Batch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            last_rows,
        )

    # -- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Full-depth pass. Returns the final normed hidden states of ``last_rows`` [S, D]."""
        h = self.model.embed(batch.input_ids)
        rot = Rotary(self.cos[batch.positions], self.sin[batch.positions])
        h = self.stack.run(h, rot, batch.meta, 0, self.config.num_layers)
        rows = batch.last_rows
        h_last = h[rows[0] :] if rows == list(range(rows[0], h.shape[0])) else h[rows]
        return self.model.final_norm(h_last), h.shape[0] * self.config.num_layers

    def logits(self, normed: torch.Tensor, live: list[bool] | None = None) -> torch.Tensor:
        """[S, D] final-normed hidden -> [S, V] float32 logits. Rows not ``live`` (a prompt chunk
        short of its last token: nothing reads them) stay zero rather than pay a pass over the
        LM head's weights (~4 ms on CPU for a chunk alone)."""
        if live is None or all(live):
            return self.lm_head(normed).float()  # type: ignore[no-any-return]
        out = torch.zeros(len(live), self.config.vocab_size, device=normed.device)
        rows = [i for i, ok in enumerate(live) if ok]
        if rows:
            out[rows] = self.lm_head(normed[rows]).float()
        return out

    def _exit_batch(
        self, seqs: list[Sequence], batch: Batch, sampling: list[bool]
    ) -> ExitBatch | None:
        """Exit rules of this step, or None when every row runs to full depth."""
        if self.exit_policy == "none":
            return None
        # The first token comes from the prefill, which never exits; a prompt chunk that stops
        # short of the last token samples nothing and is no part of ``batch_all``'s batch.
        decoding = [bool(s.output_token_ids) and ok for s, ok in zip(seqs, sampling)]
        plans = [s.step_plan() if d else None for s, d in zip(seqs, decoding)]
        # Too many rows for drafting to pay, or the int8 copy drafts: exits only verify.
        if self.drafter is not None or sum(decoding) > DRAFT_MAX_BATCH:
            plans = [None if s.spec is not None else p for s, p in zip(seqs, plans)]
        forced: dict[int, int] = {}
        passengers: dict[int, Passenger] = {}
        full = self.config.num_layers
        for i, (seq, span) in enumerate(zip(seqs, batch.meta.spans)):
            owed = self._debt_hidden.get(seq.seq_id, {})
            for row, pos in zip(span.rows[:-1], span.q_positions[:-1]):
                if pos in seq.kv_debt:
                    passengers[row] = Passenger(i, pos, seq.kv_debt[pos] + 1, owed[pos])
                elif self.kv_fill == "fill" and (depth := seq.kv_exit_layer(pos, full)) < full:
                    forced[row] = depth  # replay: this position left early when first computed
        if not forced and not passengers and all(p is None for p in plans):
            return None
        last_pos = [span.q_positions[-1] for span in batch.meta.spans]
        fill = self.kv_fill == "fill"
        spec = {i for i, s in enumerate(seqs) if s.spec is not None}
        prefill = {i for i, d in enumerate(decoding) if not d}
        return ExitBatch(
            batch.last_rows,
            last_pos,
            plans,
            forced,
            self.exit_policy,
            fill,
            passengers,
            spec,
            prefill,
        )

    def release(self, seq_id: int) -> None:
        """Forget per-request tensors (sampling generator, owed hidden states)."""
        self.sampler.release(seq_id)
        self.spec.release(seq_id)
        self._debt_hidden.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_tokens: list[int] | None = None) -> StepOutput:
        """One forward pass; ``num_tokens`` per sequence (default: all its new positions)."""
        for seq in seqs:
            if not seq.kv_debt:  # paid, or dropped by preemption (recomputed at full depth)
                self._debt_hidden.pop(seq.seq_id, None)
            if seq.num_draft_tokens == 0:  # verified, or dropped by preemption
                self.spec.release(seq.seq_id)
        counts = num_tokens if num_tokens is not None else [s.num_new_tokens for s in seqs]
        sampling = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, counts)]
        if self._int8_drafts(seqs, counts, sampling):
            return self._draft(seqs)
        return self._run(seqs, counts, sampling)

    def _int8_drafts(self, seqs: list[Sequence], counts: list[int], sampling: list[bool]) -> bool:
        """Does the int8 copy draft every row of this step? All rows or none: a step runs one
        pass. One row that needs the float model (a prompt chunk, a verification, a sequence that
        does not speculate) makes every sequence verify in that pass, which costs about what one
        draft would, and keeps the sequences' rounds in step."""
        if self.drafter is None:
            return False
        rows = len(seqs)
        return rows <= INT8_DRAFT_MAX_BATCH and all(
            sampling[i]
            and counts[i] == 1  # a decode row (not a prompt recomputed after preemption)
            and s.output_token_ids
            and s.spec is not None
            and rows * (s.num_draft_tokens + 2) <= VERIFY_MAX_ROWS
            and s.step_plan() is not None
            for i, s in enumerate(seqs)
        )

    def _draft(self, seqs: list[Sequence]) -> StepOutput:
        """One int8 draft per sequence, from its next position; that position is then owed from
        layer 1 (its K/V so far are the int8 copy's), with its embedding as the owed input."""
        assert self.drafter is not None
        n, full = len(seqs), self.config.num_layers
        batch = self.prepare(seqs, [1] * n, owed=False)
        h0 = self.model.embed(batch.input_ids)
        rot = Rotary(self.cos[batch.positions], self.sin[batch.positions])
        logits = self.drafter.logits(h0, rot, batch.meta)  # [n, V]
        picked = self.sampler.sample(
            logits, [s.sampling_params for s in seqs], [s.seq_id for s in seqs]
        )
        tokens = picked.cpu().tolist()
        # A draft's confidence is not recorded (verified tokens get the verification's).
        out = StepOutput(tokens, [full] * n, [1.0] * n, [None] * n, n * full)
        for i, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            self._debt_hidden.setdefault(seq.seq_id, {})[pos] = h0[i]
            out.kv_debt.append({**seq.kv_debt, pos: 0})
            params = seq.sampling_params
            out.spec.append(self.spec.draft(seq.seq_id, params, logits[i], tokens[i], full))
        return out

    def _run(self, seqs: list[Sequence], counts: list[int], sampling: list[bool]) -> StepOutput:
        """The float model's pass over ``seqs`` (exits, verifications, prompt chunks)."""
        batch = self.prepare(seqs, counts)
        full = self.config.num_layers
        kv_debt: dict[int, dict[int, int]] = {}
        verify_logits: dict[int, torch.Tensor] = {}
        eb = self._exit_batch(seqs, batch, sampling)
        if eb is None:
            normed, layers_run = self.forward(batch)
            logits = self.logits(normed, sampling)
            exit_layers, confs = [full] * len(seqs), [1.0] * len(seqs)
        else:
            h = self.model.embed(batch.input_ids)
            rot = Rotary(self.cos[batch.positions], self.sin[batch.positions])
            res = self.exit_loop.run(h, rot, batch.meta, eb)
            logits, layers_run = res.logits, res.layers_run
            exit_layers, confs = res.exit_layers, res.confidences
            verify_logits = res.verify_logits
            for i, (seq, debt) in enumerate(zip(seqs, res.debts)):
                if not eb.fill or i in eb.speculative:
                    kv_debt[seq.seq_id] = {p: layer for p, (layer, _) in debt.items()}
                    self._debt_hidden[seq.seq_id] = {p: h for p, (_, h) in debt.items()}
        # A speculative row with drafts that reached full depth verifies; its tokens come from
        # ``verify``. Without drafts it is a plain decode row (one batched draw with the rest).
        # A prompt chunk short of its last token samples nothing (its seeded generator waits).
        verifying = [
            ok and s.spec is not None and exit_layers[i] == full and s.num_draft_tokens > 0
            for i, (s, ok) in enumerate(zip(seqs, sampling))
        ]
        rows = [i for i, (v, ok) in enumerate(zip(verifying, sampling)) if ok and not v]
        tokens = torch.zeros(len(seqs), dtype=torch.long)
        if rows:
            picked = self.sampler.sample(
                logits[rows] if len(rows) < len(seqs) else logits,
                [seqs[i].sampling_params for i in rows],
                [seqs[i].seq_id for i in rows],
            )
            tokens[rows] = picked.cpu()
        # Drafts and verifications: their logprobs come with the verified tokens.
        skip = [
            not ok or v or (s.spec is not None and exit_layers[i] < full)
            for i, (s, ok, v) in enumerate(zip(seqs, sampling, verifying))
        ]
        out = StepOutput(
            token_ids=[t if ok else None for t, ok in zip(tokens.tolist(), sampling)],
            exit_layers=exit_layers,
            confidences=confs,
            logprobs=_logprobs(logits, seqs, tokens, skip),
            layers_run=layers_run,
            kv_debt=[kv_debt.get(s.seq_id) for s in seqs],
        )
        out.spec = [
            self._spec_output(seq, i, logits, verify_logits, out) if seq.spec and ok else None
            for i, (seq, ok) in enumerate(zip(seqs, sampling))
        ]
        return out

    def _spec_output(
        self,
        seq: Sequence,
        i: int,
        logits: torch.Tensor,
        verify_logits: dict[int, torch.Tensor],
        out: StepOutput,
    ) -> SpecOutput:
        """Sequence ``i``'s draft (its row left at an exit) or verification (full depth)."""
        params = seq.sampling_params
        if out.exit_layers[i] < self.config.num_layers:
            token = out.token_ids[i]
            assert token is not None, "a draft is sampled"
            return self.spec.draft(seq.seq_id, params, logits[i], token, out.exit_layers[i])
        k = seq.num_draft_tokens
        if k == 0:  # nothing to verify: the step's own draw, as for any decode row
            token = out.token_ids[i]
            assert token is not None, "a decode row is sampled"
            return SpecOutput(False, [token], logprobs=[out.logprobs[i]])
        drafts = seq.output_token_ids[len(seq.output_token_ids) - k :]
        owed = verify_logits.get(i, logits[:0])
        assert owed.shape[0] == k, f"{owed.shape[0]} verified positions for {k} drafts"
        full = torch.cat([owed, logits[i : i + 1]])  # [k+1, V]
        return self.spec.verify(seq.seq_id, params, drafts, full)


def _logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor, skip: list[bool]
) -> list[dict[int, float] | None]:
    """Top-n log-probabilities of the raw model distribution, plus the sampled token's, for rows
    that asked for them (``skip``: speculative rows, whose logprobs come with verified tokens)."""
    out: list[dict[int, float] | None] = []
    for i, seq in enumerate(seqs):
        n = seq.sampling_params.logprobs
        out.append(None if n is None or skip[i] else token_logprobs(logits[i], int(tokens[i]), n))
    return out
