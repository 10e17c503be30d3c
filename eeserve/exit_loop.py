"""The layer loop with early exits: the model runner's half that decides depth row by row.

Contract: ``run_exit_loop`` steps the decoder layers over a batch whose rows may leave early:
- a row that must stop at a known depth (replaying an exited token after preemption) leaves
  after that layer without producing a token;
- the sampled row of a sequence with an ``ExitPlan`` is checked at its exit layers; the policy
  (``per_sequence`` or ``batch_all``) says which rows leave, and those take their token from the
  exit head of that layer;
- ``fill``: before each layer j, the K/V of every row that left below j are computed from the
  row's exit hidden state (that layer's input norm, K/V projection, rotary) and written to the
  cache, all such rows in one batched projection: the debt is paid before anything reads it.
The result gives, per sequence, the logits of its token, its exit layer and confidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from eeserve.attention import AttnMeta, PagedKVCache
from eeserve.exits import LOGIT_MEASURES, ExitPlan, confidence, decide
from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM, Rotary


@dataclass
class ExitBatch:
    """What the loop needs besides the model: per row and per sequence exit rules."""

    last_rows: list[int]  # per sequence, its sampled row
    plans: list[ExitPlan | None]  # per sequence, None = no exit check this step
    forced_depth: dict[int, int]  # row -> layer after which it stops (replayed exits)
    policy: str


@dataclass
class ExitResult:
    logits: torch.Tensor  # [S, V] float32
    exit_layers: list[int]
    confidences: list[float]
    layers_run: int


@dataclass
class _Exited:
    """Rows that left, kept for paying their KV debt in the layers above."""

    h: list[torch.Tensor] = field(default_factory=list)
    cos: list[torch.Tensor] = field(default_factory=list)
    sin: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)

    def add(self, h: torch.Tensor, rot: Rotary, slots: torch.Tensor) -> None:
        self.h.append(h)
        self.cos.append(rot.cos)
        self.sin.append(rot.sin)
        self.slots.append(slots)
        if len(self.h) > 1:  # keep one tensor each, so every layer projects them in one call
            self.h, self.cos, self.sin, self.slots = (
                [torch.cat(x)] for x in (self.h, self.cos, self.sin, self.slots)
            )


class ExitLoop:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        lm_head: torch.nn.Module,
        heads: ExitHeads | None,
        shared_head: bool,
    ) -> None:
        self.model = model
        self.kv = kv
        self.lm_head = lm_head
        self.heads = heads
        self.shared_head = shared_head

    def head_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Exit logits [n, V] (float32) from hidden states [n, D] after ``layer`` (1-based)."""
        if self.shared_head or self.heads is None:
            normed = self.model.final_norm(h)
        else:
            normed = self.heads.normed(layer, h)
        return self.lm_head(normed).float()  # type: ignore[no-any-return]

    @torch.inference_mode()
    def run(self, h: torch.Tensor, rot: Rotary, meta: AttnMeta, batch: ExitBatch) -> ExitResult:
        num_layers = len(self.model.layers)
        n_seq = len(batch.last_rows)
        seq_of_row = {r: s for s, r in enumerate(batch.last_rows)}
        active = list(range(h.shape[0]))  # original row ids, in the order of ``h``
        out_logits: list[torch.Tensor | None] = [None] * n_seq
        exit_layer = [num_layers] * n_seq
        conf = [1.0] * n_seq
        marked = dict.fromkeys(range(n_seq), False)
        exited = _Exited()
        layers_run = 0
        check_layers = {lay for p in batch.plans if p is not None for lay in p.thresholds}
        check_layers |= set(batch.forced_depth.values())

        for j, layer in enumerate(self.model.layers, start=1):
            if exited.h:
                k, v = layer.kv_from_hidden(exited.h[0], Rotary(exited.cos[0], exited.sin[0]))
                self.kv.write(j - 1, exited.slots[0], k, v)
            if not active:
                continue
            h_prev = h
            h = layer(h, rot, partial(self.kv.attend, meta=meta))
            layers_run += len(active)
            if j not in check_layers or j == num_layers:
                continue
            leave = self._check(
                j, h, h_prev, active, batch, seq_of_row, marked, out_logits, exit_layer, conf
            )
            if leave:
                keep = [i for i in range(len(active)) if i not in leave]
                idx = torch.tensor(sorted(leave), dtype=torch.long, device=h.device)
                exited.add(h[idx], rot.select(idx), meta.slot_mapping[idx])
                active = [active[i] for i in keep]
                if active:
                    keep_t = torch.tensor(keep, dtype=torch.long, device=h.device)
                    h, rot, meta = h[keep_t], rot.select(keep_t), meta.subset(keep)

        if active:
            pos = [i for i, r in enumerate(active) if r in seq_of_row]
            if pos:
                idx = torch.tensor(pos, dtype=torch.long, device=h.device)
                final = self.lm_head(self.model.final_norm(h[idx])).float()
                for k_, i in enumerate(pos):
                    out_logits[seq_of_row[active[i]]] = final[k_]
        assert all(x is not None for x in out_logits), "a sequence produced no logits"
        return ExitResult(torch.stack(out_logits), exit_layer, conf, layers_run)  # type: ignore[arg-type]

    def _check(
        self,
        j: int,
        h: torch.Tensor,
        h_prev: torch.Tensor,
        active: list[int],
        batch: ExitBatch,
        seq_of_row: dict[int, int],
        marked: dict[int, bool],
        out_logits: list[torch.Tensor | None],
        exit_layer: list[int],
        conf: list[float],
    ) -> set[int]:
        """Positions (in ``active``) of rows that leave after layer ``j``; records their exits."""
        leave = {i for i, r in enumerate(active) if batch.forced_depth.get(r) == j}
        checked: list[int] = []  # positions in ``active``
        for i, r in enumerate(active):
            s = seq_of_row.get(r)
            plan = batch.plans[s] if s is not None else None
            if plan is not None and j in plan.thresholds:
                checked.append(i)
        if not checked:
            return leave
        plans = [batch.plans[seq_of_row[active[i]]] for i in checked]
        idx = torch.tensor(checked, dtype=torch.long, device=h.device)
        hc = h[idx]
        c = [0.0] * len(checked)
        logits: torch.Tensor | None = None
        for measure in {p.measure for p in plans}:  # type: ignore[union-attr]
            rows = [k for k, p in enumerate(plans) if p.measure == measure]  # type: ignore[union-attr]
            sel = torch.tensor(rows, dtype=torch.long, device=h.device)
            lg = self.head_logits(j, hc[sel]) if measure in LOGIT_MEASURES else None
            probe = self.heads.probe(j, hc[sel]) if measure == "classifier" and self.heads else None
            vals = confidence(measure, lg, hc[sel], h_prev[idx][sel], probe).tolist()
            for k, v in zip(rows, vals):
                c[k] = v
            if lg is not None and len(rows) == len(checked):
                logits = lg  # rows in ``checked`` order: reusable for the tokens
        ok = [ci >= p.thresholds[j] for ci, p in zip(c, plans)]  # type: ignore[union-attr]
        seqs = [seq_of_row[active[i]] for i in checked]
        sticky = [marked[s] for s in seqs]
        all_checked = len(checked) == len(active)
        go = decide(batch.policy, ok, sticky, all_checked)
        for s, m in zip(seqs, sticky):
            marked[s] = m
        leaving = [k for k, g in enumerate(go) if g]
        if leaving and logits is None:
            sel = torch.tensor(leaving, dtype=torch.long, device=h.device)
            part = self.head_logits(j, hc[sel])
            for n, k in enumerate(leaving):
                out_logits[seqs[k]] = part[n]
        for k in leaving:
            if logits is not None:
                out_logits[seqs[k]] = logits[k]
            exit_layer[seqs[k]] = j
            conf[seqs[k]] = float(c[k])
            leave.add(checked[k])
        return leave
