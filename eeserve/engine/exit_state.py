"""The early-exit state of one forward pass: what each row must do, and what it has done.

Contract: ``exit_batch`` builds a pass's ``ExitBatch`` from the scheduled sequences and the
runner's records of them (None when every row runs to full depth): per sequence its exit plan,
per row a forced depth (a replayed exit) or a ``Passenger`` (an owed position joining at the
layer above its exit). During the pass, ``PassState`` holds the explicit per-row state the exit
loop (``engine.exit_loop``) reads and changes through its methods: the running rows and their
hidden states (``Running``), each sequence's exit (``SeqExit``) and the rows that just left under
``fill`` (whose K/V the loop writes for every layer above at once). Positions that stay owed are
written straight into the sequences' records (``ExitBatch.owed``, the runner's
``RequestState.owed``). ``ExitResult`` is what the pass returns.

Four index spaces meet here, each with its own type so that one is never read as another:
``Row`` (a row of the pass: its input and attention metadata), ``Lane`` (a running row's place
in ``Running.h``, which shrinks as rows leave and grows as passengers board), ``SeqIdx`` (a
scheduled sequence's place in the step) and ``Pos`` (a token's position in its sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

import torch

from eeserve.config import ExitPolicy, KVFill
from eeserve.engine.attention import AttnMeta
from eeserve.engine.plan import ExitPlan
from eeserve.engine.request_state import OwedPosition, RequestState
from eeserve.engine.sequence import Sequence
from eeserve.models.llama import Rotary

# A constrained row whose grammar allows at most this many tokens next is judged over them alone
# at its exits: their logits are a gather of that many LM-head rows, far below a layer's cost.
MAX_ALLOWED = 512

Row = NewType("Row", int)  # a row of the pass
Lane = NewType("Lane", int)  # a running row's place in ``Running.h``
SeqIdx = NewType("SeqIdx", int)  # a scheduled sequence's place in the step
Pos = NewType("Pos", int)  # a token's position in its sequence


@dataclass(kw_only=True)
class Passenger:
    """An owed position riding along its sequence's row from the layer above its exit."""

    seq: SeqIdx
    position: Pos
    join_layer: int  # first layer (1-based) it still has to run
    hidden: torch.Tensor  # [D] its hidden state after layer join_layer - 1


@dataclass(kw_only=True)
class ExitBatch:
    """What the loop needs besides the model: per row and per sequence exit rules."""

    last_rows: list[Row]  # per sequence, its sampled row
    last_positions: list[Pos]  # per sequence, the position of that row
    plans: list[ExitPlan | None]  # per sequence, None = no exit check this step
    forced_depth: dict[Row, int]  # replayed exits: the layer after which the row stops
    policy: ExitPolicy
    kv_fill: KVFill
    passengers: dict[Row, Passenger] = field(default_factory=dict)
    # Per sequence, its record's owed positions: the loop updates them in place.
    owed: list[dict[int, OwedPosition]] = field(default_factory=list)
    speculative: set[SeqIdx] = field(default_factory=set)  # sequences whose exits are drafts
    # Sequences whose row is a prompt's (first token or a chunk): never checked, and no part of
    # the batch that ``batch_all`` waits for.
    prefill: set[SeqIdx] = field(default_factory=set)
    # Only the logits' argmax is read (kernels.screened_head); for a constrained sequence, over
    # ``head_masks``: the tokens [V] bool allowed at each position whose token the LM head
    # chooses (drafts being verified, in order, then the next).
    argmax_only: bool = False
    head_masks: dict[SeqIdx, list[torch.Tensor]] = field(default_factory=dict)
    # Constrained sequences whose grammar allows few tokens next: their ids [k]. Their exits are
    # judged over those tokens alone (``ExitChecks.allowed_confidence``).
    allowed: dict[SeqIdx, torch.Tensor] = field(default_factory=dict)
    sampled: dict[Row, SeqIdx] = field(init=False)  # sampled row -> its sequence

    def __post_init__(self) -> None:
        self.sampled = {r: SeqIdx(s) for s, r in enumerate(self.last_rows)}

    def seq_of(self, row: Row) -> SeqIdx | None:
        """The sequence a row belongs to (its sampled row or one of its passengers); None for a
        replayed row (those only exist for sequences that fill)."""
        if row in self.passengers:
            return self.passengers[row].seq
        return self.sampled.get(row)

    def head_allowed(
        self, chosen: list[SeqIdx], verify: list[tuple[Lane, SeqIdx, Pos]], pending: list[SeqIdx]
    ) -> list[torch.Tensor | None] | None:
        """Per LM-head row (the sequences ``chosen`` at full depth, the ``verify`` rows, the
        ``pending`` exits, in that order): the allowed tokens [V] bool, None where unconstrained;
        None when no row is constrained."""
        if not self.head_masks:
            return None
        masks = self.head_masks
        out = [masks[s][-1] if s in masks else None for s in chosen]
        drafted: dict[SeqIdx, list[Pos]] = {}  # a sequence's verified positions
        for _, s, pos in verify:
            drafted.setdefault(s, []).append(pos)
        rank = {(s, p): i for s, ps in drafted.items() for i, p in enumerate(sorted(ps))}
        for _, s, pos in verify:  # the i-th drafted position: the mask after i drafts
            out.append(masks[s][rank[(s, pos)]] if s in masks else None)
        return out + [masks[s][-1] if s in masks else None for s in pending]

    def owes(self, row: Row) -> bool:
        """Does a row that leaves owe its deep layers (rather than have them filled)?"""
        return self.kv_fill is KVFill.RECOMPUTE or self.seq_of(row) in self.speculative


def exit_batch(
    *,
    seqs: list[Sequence],
    states: list[RequestState],
    meta: AttnMeta,
    last_rows: list[int],
    plans: list[ExitPlan | None],
    decoding: list[bool],
    policy: ExitPolicy,
    kv_fill: KVFill,
    num_layers: int,
    argmax_only: bool = False,
    head_masks: dict[SeqIdx, list[torch.Tensor]] | None = None,
) -> ExitBatch | None:
    """The exit rules of one pass, or None when every row runs to full depth. ``plans``: per
    sequence, the exit plan of this step (None: no check); ``states``: the runner's records of
    ``seqs``, whose owed positions are the first rows of their spans."""
    forced: dict[Row, int] = {}
    passengers: dict[Row, Passenger] = {}
    for i, (seq, state, span) in enumerate(zip(seqs, states, meta.spans)):
        for row, pos in zip(span.rows[:-1], span.q_positions[:-1]):
            if (owed := state.owed.get(pos)) is not None:
                passengers[Row(row)] = Passenger(
                    seq=SeqIdx(i), position=Pos(pos), join_layer=owed.layer + 1, hidden=owed.hidden
                )
            elif (
                kv_fill is KVFill.FILL
                and (depth := seq.kv_exit_layer(pos, num_layers)) < num_layers
            ):
                forced[Row(row)] = depth  # replay: this position left early when first computed
    if not forced and not passengers and all(p is None for p in plans):
        return None
    return ExitBatch(
        last_rows=[Row(r) for r in last_rows],
        last_positions=[Pos(span.q_positions[-1]) for span in meta.spans],
        plans=plans,
        forced_depth=forced,
        policy=policy,
        kv_fill=kv_fill,
        passengers=passengers,
        owed=[state.owed for state in states],
        speculative={SeqIdx(i) for i, s in enumerate(states) if s.spec is not None},
        prefill={SeqIdx(i) for i, d in enumerate(decoding) if not d},
        argmax_only=argmax_only,
        head_masks=head_masks or {},
        allowed=_allowed(states, plans),
    )


def _allowed(
    states: list[RequestState], plans: list[ExitPlan | None]
) -> dict[SeqIdx, torch.Tensor]:
    """The allowed tokens of the checked constrained sequences whose grammar leaves at most
    ``MAX_ALLOWED`` of them."""
    out: dict[SeqIdx, torch.Tensor] = {}
    for i, (state, plan) in enumerate(zip(states, plans)):
        if plan is not None and state.matcher is not None:
            ids = state.matcher.allowed_ids(MAX_ALLOWED)
            if ids is not None:
                out[SeqIdx(i)] = ids
    return out


@dataclass(kw_only=True)
class ExitResult:
    logits: torch.Tensor  # [S, V] float32
    exit_layers: list[int]  # per sequence
    confidences: list[float]  # per sequence
    layers_run: int
    # Speculative sequences whose row reached full depth: logits [k, V] of their passengers, in
    # position order (the drafted positions being verified).
    verify_logits: dict[SeqIdx, torch.Tensor] = field(default_factory=dict)
    layer_passes: int = 0  # decoder layers the pass ran (with at least one row)


@dataclass(kw_only=True)
class SeqExit:
    """Where one sequence's sampled row left, and what it produces there."""

    layer: int  # 1-based; L until it leaves
    confidence: float = 1.0
    marked: bool = False  # ``batch_all``: confident at some exit of this pass already
    logits: torch.Tensor | None = None  # [V] the check's logits, when it computed them
    head_input: torch.Tensor | None = None  # [D] normed LM-head input, projected at the end


@dataclass
class Running:
    """The rows still computing: their pass rows, lane by lane, and their hidden states h [n, D]
    in the same order."""

    rows: list[Row]
    h: torch.Tensor

    def take(self, lanes: list[Lane]) -> torch.Tensor:
        return take_rows(self.h, lanes)

    def board(self, rows: list[Row], h: torch.Tensor) -> None:
        self.rows = self.rows + rows
        self.h = torch.cat([self.h, h])

    def drop(self, lanes: set[Lane]) -> torch.Tensor:
        """Removes the rows in ``lanes``; returns the lanes kept (to index tensors aligned with
        the old lanes)."""
        keep = [i for i in range(len(self.rows)) if i not in lanes]
        kept = torch.tensor(keep, dtype=torch.long, device=self.h.device)
        self.rows = [self.rows[i] for i in keep]
        self.h = self.h[kept]
        return kept

    def reindexed(self, rot0: Rotary, meta0: AttnMeta) -> tuple[Rotary, AttnMeta]:
        """The pass's rotary tables and attention metadata for the running rows only."""
        idx = torch.tensor(self.rows, dtype=torch.long, device=self.h.device)
        return rot0.select(idx), meta0.subset(self.rows)


@dataclass(kw_only=True)
class PassState:
    """Everything the exit loop changes during one pass."""

    running: Running
    exits: list[SeqExit]  # per sequence
    # Rows that left under ``fill`` in the last ``leave``: their rows and exit hidden states
    # [E, D]; the loop writes their K/V for every layer above before running another layer.
    filled: tuple[list[Row], torch.Tensor] | None = None
    layers_run: int = 0
    layer_passes: int = 0
    verify_logits: dict[SeqIdx, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def start(cls, h0: torch.Tensor, b: ExitBatch, num_layers: int) -> PassState:
        rows = [Row(r) for r in range(h0.shape[0]) if r not in b.passengers]
        return cls(
            running=Running(rows, h0[rows] if b.passengers else h0),
            exits=[SeqExit(layer=num_layers) for _ in b.last_rows],
        )

    def sampled_running(self, b: ExitBatch) -> list[SeqIdx]:
        """Sequences whose sampled row still runs."""
        return [b.sampled[r] for r in self.running.rows if r in b.sampled]

    def board(self, b: ExitBatch, j: int) -> bool:
        """Passengers whose owed layers start at j board if their sequence's row still runs."""
        running = set(self.sampled_running(b))
        rows = [r for r, p in b.passengers.items() if p.join_layer == j and p.seq in running]
        if rows:
            self.running.board(rows, torch.stack([b.passengers[r].hidden for r in rows]))
        return bool(rows)

    def leave(self, b: ExitBatch, j: int, lanes: set[Lane]) -> torch.Tensor:
        """The rows in ``lanes`` stop after layer ``j`` with their current hidden state as exit
        hidden state; their sequences' passengers stop with them. Returns the lanes kept."""
        rows = self.running.rows
        gone = {b.sampled[rows[i]] for i in lanes if rows[i] in b.sampled}
        lanes = lanes | {
            Lane(i) for i, r in enumerate(rows) if r in b.passengers and b.passengers[r].seq in gone
        }
        order = sorted(lanes)
        h_left = self.running.take(order)
        left = [rows[i] for i in order]
        owe = [k for k, r in enumerate(left) if b.owes(r)]
        filled = [k for k in range(len(order)) if k not in set(owe)]
        if filled:
            rows_f, h_f = [left[k] for k in filled], take_rows(h_left, filled)
            if self.filled is not None:  # two leaves after one layer (a check, then replays)
                rows_f, h_f = self.filled[0] + rows_f, torch.cat([self.filled[1], h_f])
            self.filled = (rows_f, h_f)
        for k in owe:
            r = left[k]
            if r in b.passengers:
                p = b.passengers[r]
                b.owed[p.seq][p.position] = OwedPosition(layer=j, hidden=h_left[k])
            elif r in b.sampled:
                s = b.sampled[r]
                b.owed[s][b.last_positions[s]] = OwedPosition(layer=j, hidden=h_left[k])
        return self.running.drop(lanes)

    def exit_at(self, s: SeqIdx, layer: int, confidence: float) -> SeqExit:
        e = self.exits[s]
        e.layer, e.confidence = layer, confidence
        return e

    def verified(self, b: ExitBatch) -> list[tuple[Lane, SeqIdx, Pos]]:
        """Passengers that ran every layer owe nothing any more; those of speculative sequences
        are verified drafts: (lane, sequence, position)."""
        out = []
        for i, r in enumerate(self.running.rows):
            if r in b.passengers:
                p = b.passengers[r]
                b.owed[p.seq].pop(p.position, None)
                if p.seq in b.speculative:
                    out.append((Lane(i), p.seq, p.position))
        return out


def take_rows(x: torch.Tensor, rows: list[int] | list[Lane]) -> torch.Tensor:
    """x[rows] without a copy when ``rows`` is every row in order (the common case: all checked)."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x[torch.tensor(rows, dtype=torch.long, device=x.device)]
