"""The early-exit state of one forward pass: what each row must do, and what it has done.

Contract: ``exit_batch`` builds a pass's ``ExitBatch`` from the scheduled sequences (None when
every row runs to full depth): per sequence its exit plan, per row a forced depth (a replayed
exit) or a ``Passenger`` (an owed position joining at the layer above its exit). During the
pass, ``PassState`` holds the explicit per-row state the exit loop (``engine.exit_loop``) reads
and changes through its methods: the running rows and their hidden states (``Running``), each
sequence's exit (``SeqExit``), the rows that just left under ``fill`` (whose K/V the loop
writes for every layer above at once) and the positions still owed. ``ExitResult`` is what the
pass returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eeserve.engine.attention import AttnMeta
from eeserve.engine.plan import ExitPlan
from eeserve.engine.sequence import Sequence
from eeserve.models.llama import Rotary

Owed = dict[int, tuple[int, torch.Tensor]]  # position -> (layer its K/V reach, hidden [D] there)


@dataclass
class Passenger:
    seq: int  # sequence index in the batch
    position: int
    join_layer: int  # first layer (1-based) it still has to run
    hidden: torch.Tensor  # [D] its hidden state after layer join_layer - 1


@dataclass
class ExitBatch:
    """What the loop needs besides the model: per row and per sequence exit rules."""

    last_rows: list[int]  # per sequence, its sampled row
    last_positions: list[int]  # per sequence, the position of that row
    plans: list[ExitPlan | None]  # per sequence, None = no exit check this step
    forced_depth: dict[int, int]  # row -> layer after which it stops (replayed exits)
    policy: str
    fill: bool = True
    passengers: dict[int, Passenger] = field(default_factory=dict)  # row -> owed position
    speculative: set[int] = field(default_factory=set)  # sequences whose exits are drafts
    # Sequences whose row is a prompt's (first token or a chunk): never checked, and no part of
    # the batch that ``batch_all`` waits for.
    prefill: set[int] = field(default_factory=set)
    argmax_only: bool = False  # only the logits' argmax is read (kernels.screened_head)
    sampled: dict[int, int] = field(init=False)  # sampled row -> its sequence

    def __post_init__(self) -> None:
        self.sampled = {r: s for s, r in enumerate(self.last_rows)}

    def seq_of(self, row: int) -> int:
        """The sequence a row belongs to (its sampled row or one of its passengers); -1 for a
        replayed row (those only exist for sequences that fill)."""
        if row in self.passengers:
            return self.passengers[row].seq
        return self.sampled.get(row, -1)

    def owes(self, row: int) -> bool:
        """Does a row that leaves owe its deep layers (rather than have them filled)?"""
        return not self.fill or self.seq_of(row) in self.speculative


def exit_batch(
    seqs: list[Sequence],
    meta: AttnMeta,
    last_rows: list[int],
    plans: list[ExitPlan | None],
    decoding: list[bool],
    owed_hidden: dict[int, dict[int, torch.Tensor]],
    policy: str,
    fill: bool,
    num_layers: int,
    argmax_only: bool = False,
) -> ExitBatch | None:
    """The exit rules of one pass, or None when every row runs to full depth. ``plans``: per
    sequence, the exit plan of this step (None: no check); ``owed_hidden``: per sequence id, the
    hidden states of its owed positions."""
    forced: dict[int, int] = {}
    passengers: dict[int, Passenger] = {}
    for i, (seq, span) in enumerate(zip(seqs, meta.spans)):
        owed = owed_hidden.get(seq.seq_id, {})
        for row, pos in zip(span.rows[:-1], span.q_positions[:-1]):
            if pos in seq.kv_debt:
                passengers[row] = Passenger(i, pos, seq.kv_debt[pos] + 1, owed[pos])
            elif fill and (depth := seq.kv_exit_layer(pos, num_layers)) < num_layers:
                forced[row] = depth  # replay: this position left early when first computed
    if not forced and not passengers and all(p is None for p in plans):
        return None
    return ExitBatch(
        last_rows,
        [span.q_positions[-1] for span in meta.spans],
        plans,
        forced,
        policy,
        fill,
        passengers,
        {i for i, s in enumerate(seqs) if s.spec is not None},
        {i for i, d in enumerate(decoding) if not d},
        argmax_only,
    )


@dataclass
class ExitResult:
    logits: torch.Tensor  # [S, V] float32
    exit_layers: list[int]
    confidences: list[float]
    layers_run: int
    debts: list[Owed]  # per sequence, positions still owed after this step
    # Speculative sequences whose row reached full depth: logits [k, V] of their passengers, in
    # position order (the drafted positions being verified).
    verify_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_passes: int = 0  # decoder layers the pass ran (with at least one row)


@dataclass
class SeqExit:
    """Where one sequence's sampled row left, and what it produces there."""

    layer: int  # 1-based; L until it leaves
    confidence: float = 1.0
    marked: bool = False  # ``batch_all``: confident at some exit of this pass already
    logits: torch.Tensor | None = None  # [V] the check's logits, when it computed them
    head_input: torch.Tensor | None = None  # [D] normed LM-head input, projected at the end


@dataclass
class Running:
    """The rows still computing: original row ids, in the order of ``h`` [n, D]."""

    rows: list[int]
    h: torch.Tensor

    def take(self, positions: list[int]) -> torch.Tensor:
        return take_rows(self.h, positions)

    def board(self, rows: list[int], h: torch.Tensor) -> None:
        self.rows = self.rows + rows
        self.h = torch.cat([self.h, h])

    def drop(self, positions: set[int]) -> torch.Tensor:
        """Removes the rows at ``positions``; returns the positions kept (to index tensors
        aligned with the old rows)."""
        keep = [i for i in range(len(self.rows)) if i not in positions]
        kept = torch.tensor(keep, dtype=torch.long, device=self.h.device)
        self.rows = [self.rows[i] for i in keep]
        self.h = self.h[kept]
        return kept

    def reindexed(self, rot0: Rotary, meta0: AttnMeta) -> tuple[Rotary, AttnMeta]:
        """The pass's rotary tables and attention metadata for the running rows only."""
        idx = torch.tensor(self.rows, dtype=torch.long, device=self.h.device)
        return rot0.select(idx), meta0.subset(self.rows)


@dataclass
class PassState:
    """Everything the exit loop changes during one pass."""

    running: Running
    exits: list[SeqExit]  # per sequence
    debts: list[Owed]  # per sequence
    # Rows that left under ``fill`` in the last ``leave``: ids and exit hidden states [E, D];
    # the loop writes their K/V for every layer above before running another layer.
    filled: tuple[list[int], torch.Tensor] | None = None
    layers_run: int = 0
    layer_passes: int = 0
    verify_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def start(cls, h0: torch.Tensor, b: ExitBatch, num_layers: int) -> PassState:
        rows = [r for r in range(h0.shape[0]) if r not in b.passengers]
        st = cls(
            Running(rows, h0[rows] if b.passengers else h0),
            [SeqExit(num_layers) for _ in b.last_rows],
            [{} for _ in b.last_rows],
        )
        for p in b.passengers.values():  # owed until carried further below
            st.debts[p.seq][p.position] = (p.join_layer - 1, p.hidden)
        return st

    def sampled_running(self, b: ExitBatch) -> list[int]:
        """Sequences whose sampled row still runs."""
        return [b.sampled[r] for r in self.running.rows if r in b.sampled]

    def board(self, b: ExitBatch, j: int) -> bool:
        """Passengers whose owed layers start at j board if their sequence's row still runs."""
        running = set(self.sampled_running(b))
        rows = [r for r, p in b.passengers.items() if p.join_layer == j and p.seq in running]
        if rows:
            self.running.board(rows, torch.stack([b.passengers[r].hidden for r in rows]))
        return bool(rows)

    def leave(self, b: ExitBatch, j: int, positions: set[int]) -> torch.Tensor:
        """Rows at ``positions`` (of the running rows) stop after layer ``j`` with their current
        hidden state as exit hidden state; their sequences' passengers stop with them. Returns
        the positions kept."""
        rows = self.running.rows
        gone = {b.sampled[rows[i]] for i in positions if rows[i] in b.sampled}
        positions = positions | {
            i for i, r in enumerate(rows) if r in b.passengers and b.passengers[r].seq in gone
        }
        idx = sorted(positions)
        h_left = self.running.take(idx)
        left = [rows[i] for i in idx]
        owe = [k for k, r in enumerate(left) if b.owes(r)]
        filled = [k for k in range(len(idx)) if k not in set(owe)]
        if filled:
            rows_f, h_f = [left[k] for k in filled], take_rows(h_left, filled)
            if self.filled is not None:  # two leaves after one layer (a check, then replays)
                rows_f, h_f = self.filled[0] + rows_f, torch.cat([self.filled[1], h_f])
            self.filled = (rows_f, h_f)
        for k in owe:
            r = left[k]
            if r in b.passengers:
                p = b.passengers[r]
                self.debts[p.seq][p.position] = (j, h_left[k])
            elif r in b.sampled:
                s = b.sampled[r]
                self.debts[s][b.last_positions[s]] = (j, h_left[k])
        return self.running.drop(positions)

    def exit_at(self, s: int, layer: int, confidence: float) -> SeqExit:
        e = self.exits[s]
        e.layer, e.confidence = layer, confidence
        return e

    def verified(self, b: ExitBatch) -> list[tuple[int, int, int]]:
        """Passengers that ran every layer owe nothing any more; those of speculative sequences
        are verified drafts: (position in the running rows, sequence, position)."""
        out = []
        for i, r in enumerate(self.running.rows):
            if r in b.passengers:
                p = b.passengers[r]
                self.debts[p.seq].pop(p.position, None)
                if p.seq in b.speculative:
                    out.append((i, p.seq, p.position))
        return out


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without a copy when ``rows`` is every row in order (the common case: all checked)."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x[torch.tensor(rows, dtype=torch.long, device=x.device)]
