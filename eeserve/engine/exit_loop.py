"""The layer loop with early exits: the model runner's half that decides depth row by row.

Contract: ``ExitLoop.run(h0, rot0, meta0, batch)`` steps the decoder layers over a pass whose rows
may leave early (``ExitBatch``, ``engine.exit_state``). Before the first layer it lays out the
pass's events (``LayerEvents``): the check layers, the layers split by a layer-head check, the
layers where owed positions board, and the checks the layer kernel computes. It then runs the
layers in runs between events: at a layer j where owed positions start, they board; after a check
layer, a sampled row whose plan has an exit there is measured and leaves when the batch policy
says so, taking its token from that exit's head, and a replayed row leaves at its known depth.
Rows that leave owe their deep layers (``recompute``, speculative drafts) or have them filled:
their K/V for every layer above are written at once, before the next layer runs. ``layer`` exit
heads check exit l inside layer l + 1, between its attention and MLP halves. Where
``kernel_route.route_checks`` sends the checks into the layer kernel (decode rows, one shortlist
or classifier measure), the layers and checks run in one call that stops at the first check where
a row may leave; the policy then decides there as it would after a separate check. The step ends
with one LM-head pass for every row that still needs logits. Why each rule is as it is:
docs/design.md ("Exits inside a pass").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from eeserve.config import KVFill
from eeserve.engine.attention import AttnMeta, PagedKVCache
from eeserve.engine.exit_checks import ExitChecks
from eeserve.engine.exit_state import (
    ExitBatch,
    ExitResult,
    Lane,
    PassState,
    Pos,
    SeqIdx,
    take_rows,
)
from eeserve.engine.kernel_route import CheckRoute, route_checks
from eeserve.engine.kv_fill import KVFiller
from eeserve.engine.layer_cost import LayerCost
from eeserve.engine.layer_stack import LayerStack
from eeserve.engine.plan import ExitPlan
from eeserve.engine.policy import decide
from eeserve.exit_params import Measure
from eeserve.kernels.fused import CheckedSpan
from eeserve.kernels.screened_head import head_logits
from eeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, Rotary


@dataclass(frozen=True, kw_only=True)
class LayerEvents:
    """Where a pass's run of layers stops, laid out before its first layer (1-based layers)."""

    check_layers: frozenset[int]  # a check or a replayed exit after the layer, outside kernels
    split_layers: frozenset[int]  # a layer-head check between the layer's halves
    check_route: CheckRoute  # the checks the layer kernel computes between layers
    run_ends: frozenset[int]  # layers after which a run of layers stops

    def run_end(self, j: int) -> int:
        """The last layer of the run that starts at layer j."""
        return min(e for e in self.run_ends if e >= j)

    def checked_inside(self, j: int, end: int) -> list[int]:
        """The kernel's check layers within layers j..end."""
        return [c for c in self.check_route.kernel_checks if j <= c <= end]


class ExitLoop:
    def __init__(
        self,
        *,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        stack: LayerStack,
        lm_head: torch.nn.Module,
        checks: ExitChecks,
        layer_heads: bool,
        filler: KVFiller | None,
        cost: LayerCost | None,
        draft_head: torch.nn.Module | None,
    ) -> None:
        """``checks``: the exit heads' inputs, logits and confidence measures; ``layer_heads``:
        the heads check exit l inside layer l + 1; ``filler``: ``fill`` for every layer above an
        exit in one projection (None: layer by layer); ``cost``: the ``auto`` policy's layer
        cost model; ``draft_head``: a cheaper LM head for speculative drafts, [N, D] -> [N, V]
        logits, -inf outside the draft vocabulary (``draft_vocab.SubsetHead``; None: the LM
        head)."""
        self.model, self.kv, self.stack, self.lm_head = model, kv, stack, lm_head
        self.checks, self.layer_heads = checks, layer_heads
        self.filler, self.cost, self.draft_head = filler, cost, draft_head

    @torch.inference_mode()
    def run(self, h0: torch.Tensor, rot0: Rotary, meta0: AttnMeta, b: ExitBatch) -> ExitResult:
        num_layers = len(self.model.layers)
        st = PassState.start(h0, b, num_layers)
        rot, meta = st.running.reindexed(rot0, meta0) if b.passengers else (rot0, meta0)
        ev = self._events(b, meta)
        j = 1
        while j <= num_layers:
            if st.board(b, j):
                rot, meta = st.running.reindexed(rot0, meta0)
            if not st.running.rows:  # nobody boards later: passengers follow a running row
                break
            h_prev: torch.Tensor | None = None
            if j in ev.split_layers:
                end = j
                moved = self._split_layer(j, self.model.layers[j - 1], rot, meta, st, b)
            elif inner := ev.checked_inside(j, ev.run_end(j)):
                end, moved = self._run_checked(j, ev.run_end(j), inner, ev, rot, meta, st, b)
            else:  # the layers up to the next event in one call (one kernel call per layer)
                end, h_prev, moved = ev.run_end(j), st.running.h, False
                st.running.h = self.stack.run(st.running.h, rot, meta, j - 1, end)
                st.layers_run += len(st.running.rows) * (end - j + 1)
            st.layer_passes += end - j + 1
            if end in ev.check_layers and end < num_layers and st.running.rows:
                moved |= self._stop(end, h_prev, st, b)
            self._pay_fill(st, end + 1, rot0, meta0)
            if moved and st.running.rows:
                rot, meta = st.running.reindexed(rot0, meta0)
            j = end + 1
        return ExitResult(
            logits=self._finish(st, b),
            exit_layers=[e.layer for e in st.exits],
            confidences=[e.confidence for e in st.exits],
            layers_run=st.layers_run,
            verify_logits=st.verify_logits,
            layer_passes=st.layer_passes,
        )

    def _events(self, b: ExitBatch, meta: AttnMeta) -> LayerEvents:
        """The pass's events. A run of layers stops after a check layer (unless the kernel
        checks it), before a split layer or a boarding, and (``hidden_cosine``, which compares a
        check layer's input with its output) before a check."""
        num_layers = len(self.model.layers)
        plan_layers = {lay for p in b.plans if p is not None for lay in p.thresholds}
        forced = set(b.forced_depth.values())
        split = {lay + 1 for lay in plan_layers} if self.layer_heads else set()
        route = route_checks(
            route=self.stack.route(meta),
            batch=b,
            exit_checks=self.checks,
            layer_heads=self.layer_heads,
            num_layers=num_layers,
        )
        checks = (forced if self.layer_heads else plan_layers | forced) - set(route.kernel_checks)
        ends = {num_layers, *checks, *(j - 1 for j in split)}
        ends |= {p.join_layer - 1 for p in b.passengers.values()}
        if any(p is not None and p.measure == Measure.HIDDEN_COSINE for p in b.plans):
            ends |= {c - 1 for c in checks}
        return LayerEvents(
            check_layers=frozenset(checks),
            split_layers=frozenset(split),
            check_route=route,
            run_ends=frozenset(e for e in ends if e >= 1),
        )

    def _run_checked(
        self,
        j: int,
        end: int,
        inner: list[int],
        ev: LayerEvents,
        rot: Rotary,
        meta: AttnMeta,
        st: PassState,
        b: ExitBatch,
    ) -> tuple[int, bool]:
        """Layers j..end with the kernel's checks after ``inner`` in one call, which stops at
        the first check where a running row is confident or marked; the policy decides there
        (``_stop``). Returns the last layer run and whether rows left."""
        route = ev.check_route
        assert route.measure is not None
        span = CheckedSpan(
            layers=inner,
            checks=[route.kernel_checks[c] for c in inner],
            measure=route.measure,
            shortlist_rows=self.checks.shortlist_rows,
            thresholds=self._thresholds(inner, st, b),
        )
        h, conf, stopped = self.stack.run_checked(
            st.running.h, rot, self.stack.route(meta), j - 1, end, span
        )
        last = end if stopped < 0 else inner[stopped]
        st.running.h = h
        st.layers_run += len(st.running.rows) * (last - j + 1)
        if stopped < 0:
            return last, False
        return last, self._stop(last, None, st, b, conf[stopped].tolist())

    @staticmethod
    def _thresholds(layers: list[int], st: PassState, b: ExitBatch) -> torch.Tensor:
        """[C, R] each running row's threshold at each check layer: its plan's; -inf where it
        is marked (its policy decides at every check); +inf where it is not checked."""
        out = [[math.inf] * len(st.running.rows) for _ in layers]
        for i, r in enumerate(st.running.rows):
            s = b.sampled.get(r)
            plan = None if s is None else b.plans[s]
            if s is None or plan is None:
                continue
            for c, lay in enumerate(layers):
                if lay in plan.thresholds:
                    out[c][i] = -math.inf if st.exits[s].marked else plan.thresholds[lay]
        return torch.tensor(out, dtype=torch.float32)

    def _pay_fill(self, st: PassState, first: int, rot0: Rotary, meta0: AttnMeta) -> None:
        """``fill``: the K/V of layers ``first``.. of the rows that just left, written before
        any layer above runs (so before anything reads them)."""
        if st.filled is None:
            return
        rows_list, h = st.filled
        st.filled = None
        rows = torch.tensor(rows_list, dtype=torch.long, device=h.device)
        rot, slots = rot0.select(rows), meta0.slot_mapping[rows]
        if self.filler is not None:
            self.filler.pay(h, rot, first, self.kv, slots)
            return
        for j, layer in enumerate(self.model.layers[first - 1 :], start=first):
            k, v = layer.kv_from_hidden(h, rot)
            self.kv.write(j - 1, slots, k, v)

    def _split_layer(
        self,
        j: int,
        layer: LlamaDecoderLayer,
        rot: Rotary,
        meta: AttnMeta,
        st: PassState,
        b: ExitBatch,
    ) -> bool:
        """Layer ``j`` with the layer-head check of exit ``j - 1`` between its halves; True when
        rows left (they leave with h_l, the layer's input, as their exit hidden state)."""
        h_in = st.running.h
        h_mid = layer.attn_block(h_in, rot, partial(self.kv.attend, meta=meta))
        st.layers_run += len(st.running.rows)
        leave = self._check(j - 1, h_mid, h_in, st, b)
        if leave:
            h_mid = h_mid[st.leave(b, j - 1, leave)]
        if st.running.rows:
            st.running.h = layer.mlp_block(h_mid)
        return bool(leave)

    def _stop(
        self,
        j: int,
        h_prev: torch.Tensor | None,
        st: PassState,
        b: ExitBatch,
        conf: list[float] | None = None,
    ) -> bool:
        """After layer ``j``: replayed rows at their depth and (without layer heads) the rows
        whose check lets them go leave. True when any did. ``h_prev``: the input of the layers
        run last (layer j's own where ``hidden_cosine`` checks); ``conf``: the running rows'
        confidences where the layer kernel computed them."""
        leave = {Lane(i) for i, r in enumerate(st.running.rows) if b.forced_depth.get(r) == j}
        if not self.layer_heads:
            h_cmp = h_prev if h_prev is not None else st.running.h
            assert h_prev is not None or conf is not None
            leave |= self._check(j, st.running.h, h_cmp, st, b, conf)
        if leave:
            st.leave(b, j, leave)
        return bool(leave)

    def _check(
        self,
        j: int,
        h: torch.Tensor,
        h_prev: torch.Tensor,
        st: PassState,
        b: ExitBatch,
        computed: list[float] | None = None,
    ) -> set[Lane]:
        """The lanes of rows whose plan makes them leave at exit layer ``j``; records their
        exits. h: [n, D] the heads' input (h_j; h_mid of layer j + 1 for layer heads), h_prev:
        the state it is compared with (``hidden_cosine``); ``computed``: the running rows'
        confidences, already measured."""
        rows = st.running.rows
        lanes = [
            Lane(i)
            for i, r in enumerate(rows)
            if r in b.sampled and (p := b.plans[b.sampled[r]]) is not None and j in p.thresholds
        ]
        if not lanes:
            return set()
        seqs = [b.sampled[rows[i]] for i in lanes]
        plans: list[ExitPlan] = [b.plans[s] for s in seqs]  # type: ignore[misc]
        hc = take_rows(h, lanes)
        if computed is None:
            conf, logits = self._measure(j, hc, take_rows(h_prev, lanes), plans)
        else:
            conf, logits = [computed[i] for i in lanes], None
        self._allowed_confidence(j, hc, seqs, plans, b, conf)
        go = self._decide(j, conf, plans, seqs, st, b)
        leaving = [k for k, g in enumerate(go) if g]
        if not leaving:
            return set()
        normed = self.checks.head_normed(j, take_rows(hc, leaving)) if logits is None else None
        for n, k in enumerate(leaving):
            e = st.exit_at(seqs[k], j, conf[k])
            if logits is not None:
                e.logits = logits[k]
            else:
                assert normed is not None
                e.head_input = normed[n]
        return {lanes[k] for k in leaving}

    def _allowed_confidence(
        self,
        j: int,
        hc: torch.Tensor,
        seqs: list[SeqIdx],
        plans: list[ExitPlan],
        b: ExitBatch,
        conf: list[float],
    ) -> None:
        """Constrained rows whose grammar allows few tokens: their confidence at exit ``j``, in
        ``conf`` in place, is over those tokens alone (hc [n, D]: the checked rows' head input)."""
        ks = [k for k, s in enumerate(seqs) if s in b.allowed]
        if not ks:
            return
        for measure in {plans[k].measure for k in ks}:
            mine = [k for k in ks if plans[k].measure == measure]
            ids = [b.allowed[seqs[k]] for k in mine]
            got = self.checks.allowed_confidence(measure, j, take_rows(hc, mine), ids)
            for k, c in zip(mine, got):
                conf[k] = c

    def _decide(
        self,
        j: int,
        conf: list[float],
        plans: list[ExitPlan],
        seqs: list[SeqIdx],
        st: PassState,
        b: ExitBatch,
    ) -> list[bool]:
        """Which of the sequences ``seqs``, checked at exit ``j`` with confidences ``conf``,
        leave now under the batch policy; keeps their ``batch_all`` marks."""
        marked = [st.exits[s].marked for s in seqs]
        ok = [c >= p.thresholds[j] for c, p in zip(conf, plans)]
        running = len(st.running.rows)
        sampled = sum(
            1 for r in st.running.rows if r in b.sampled and b.sampled[r] not in b.prefill
        )
        # ``recompute`` pays a leaving row's layers in a later pass: leaving early saves nothing.
        cost = self.cost
        shrink = None
        if cost is not None and b.kv_fill is KVFill.FILL:
            shrink = partial(cost.shrink_pays, running)
        eager = [s in b.speculative or p.eager for s, p in zip(seqs, plans)]
        go = decide(b.policy, ok, marked, len(seqs) == sampled, shrink, eager)
        for s, m in zip(seqs, marked):
            st.exits[s].marked = m
        return go

    def _measure(
        self, j: int, h: torch.Tensor, h_prev: torch.Tensor, plans: list[ExitPlan]
    ) -> tuple[list[float], torch.Tensor | None]:
        """Confidence of each checked row at exit ``j`` under its plan's measure, and the exit
        logits [n, V] when one logit measure covered every row (reused for their tokens)."""
        conf = [0.0] * len(plans)
        logits: torch.Tensor | None = None
        for measure in {p.measure for p in plans}:
            rows = [k for k, p in enumerate(plans) if p.measure == measure]
            hm = take_rows(h, rows)
            hp = take_rows(h_prev, rows) if measure == Measure.HIDDEN_COSINE else h_prev
            c, lg = self.checks.confidence(measure, j, hm, hp)
            for k, v in zip(rows, c.tolist()):
                conf[k] = float(v)
            if lg is not None and len(rows) == len(plans):
                logits = lg  # the whole vocabulary's: the leaving rows' tokens come from it
        return conf, logits

    def _finish(self, st: PassState, b: ExitBatch) -> torch.Tensor:
        """The step's one LM-head pass (full-depth rows, verified passengers, and rows that left
        without logits); returns every sequence's logits [S, V] in sequence order."""
        verify = st.verified(b)
        self._draft_logits(st, b)
        rows = st.running.rows
        lanes = [Lane(i) for i, r in enumerate(rows) if r in b.sampled]
        pending = [SeqIdx(s) for s, e in enumerate(st.exits) if e.head_input is not None]
        owners = [b.sampled[rows[i]] for i in lanes] + pending
        if not owners:
            return torch.stack([e.logits for e in st.exits])  # type: ignore[misc]
        parts: list[torch.Tensor] = []  # LM-head inputs, in ``owners`` order, then ``verify``
        if lanes or verify:
            parts.append(self.model.final_norm(st.running.take(lanes + [v[0] for v in verify])))
        if pending:
            inputs = [st.exits[s].head_input for s in pending]
            parts.append(torch.stack(inputs))  # type: ignore[arg-type]
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        allowed = b.head_allowed([b.sampled[rows[i]] for i in lanes], verify, pending)
        logits = head_logits(self.lm_head, x, b.argmax_only, allowed)
        if verify:
            logits = self._split_verify(logits, len(lanes), verify, st)
        if len(owners) == len(st.exits):  # no logits came from a check: at most a reorder
            where = {s: k for k, s in enumerate(owners)}
            return take_rows(logits, [where[SeqIdx(s)] for s in range(len(owners))])
        for k, s in enumerate(owners):
            st.exits[s].logits = logits[k]
        return torch.stack([e.logits for e in st.exits])  # type: ignore[misc]

    def _draft_logits(self, st: PassState, b: ExitBatch) -> None:
        """Speculative drafts waiting for logits go through the draft head (when there is one):
        logits outside its vocabulary are -inf, so the draft is its argmax over that part."""
        drafts = [s for s, e in enumerate(st.exits) if e.head_input is not None]
        drafts = [s for s in drafts if s in b.speculative]
        if self.draft_head is None or not drafts:
            return
        inputs = torch.stack([st.exits[s].head_input for s in drafts])  # type: ignore[misc]
        logits = self.draft_head(inputs)  # [n, V]
        for k, s in enumerate(drafts):
            st.exits[s].logits, st.exits[s].head_input = logits[k], None

    @staticmethod
    def _split_verify(
        logits: torch.Tensor, n_full: int, verify: list[tuple[Lane, SeqIdx, Pos]], st: PassState
    ) -> torch.Tensor:
        """Takes the passenger rows' logits out of ``logits`` (rows n_full .. n_full +
        len(verify), between the full-depth rows and the pending ones) into
        ``st.verify_logits``."""
        vl = logits[n_full : n_full + len(verify)]
        for s in {v[1] for v in verify}:
            mine = sorted((v[2], k) for k, v in enumerate(verify) if v[1] == s)
            st.verify_logits[s] = vl[[k for _, k in mine]]
        return torch.cat([logits[:n_full], logits[n_full + len(verify) :]])
