"""Paged attention over the K/V pool, and the per-step metadata it reads.

Contract: ``PagedKVCache`` owns the K/V pool tensors (``[layers, slots, kv_heads, head_dim]``, slot
= block_id * block_size + offset). ``attend`` first writes the rows' new K/V at their slots, then
computes attention of the rows' queries over each sequence's cached context. On CPU with the
engine's kernels (``native``) attention reads the pool in place: row by row for decode-shaped
spans, per span (one sequence's queries together) for prompts and prompt chunks. Otherwise the
context is gathered and SDPA runs on the copy. ``AttnMeta`` describes one forward pass: which
slot each row writes and, per sequence, which rows are its queries and which slots form its
context. ``subset`` re-targets it to the rows that are still running when some have exited
early; sequences with no row left drop out.
Sliding-window layers (``windows[layer]`` = W, Gemma 3's local layers): a query at position p
sees positions p - W + 1 .. p. While no query of the pass is at position W or beyond, that is
the whole context and the layer takes the paths above unchanged; otherwise row-wise rows read
the last W slots of their context (``RowSet.window``; the same kernels) and longer spans run
SDPA over the span's window with a banded mask. The pool keeps every position for these layers
too (one slot table for all layers), so a local layer's memory is not bounded by its window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from eeserve.kernels.fused import PassAttention
from eeserve.kernels.native import NativeOps


@dataclass
class SeqSpan:
    """One sequence's share of a forward pass."""

    rows: list[int]  # row indices (into the current row set) of this sequence's queries
    q_positions: list[int]  # their positions in the sequence
    context_slots: torch.Tensor  # [ctx_len] slots of positions 0..ctx_len-1
    fresh: bool  # rows are exactly positions 0..ctx_len-1 and nothing was cached before
    # Built on first use and kept for the pass's other layers: [n] int64 q_positions for the
    # native kernel; [1, 1, n, ctx_len] additive causal mask for SDPA over a cached prefix.
    positions: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    # Sliding-window layers: (first context position read, [1, 1, n, T'] banded additive mask).
    window_bias: tuple[int, torch.Tensor] | None = None
    row_slice: slice | None = field(init=False)

    def __post_init__(self) -> None:
        # The rows as a slice when they are consecutive and ascending (a prompt, a decode step);
        # the exit loop's subsets may list them in another order.
        r0, n = self.rows[0], len(self.rows)
        self.row_slice = slice(r0, r0 + n) if self.rows == list(range(r0, r0 + n)) else None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The span's rows of ``x``, in the span's order."""
        return x[self.row_slice] if self.row_slice is not None else x[self.rows]


# Spans of at most this many query rows (decode steps, also with owed ``recompute`` positions or
# speculative drafts to verify) are attended row by row over the paged context; longer or fresh
# ones (prefills, prompt chunks) per span, where the span's queries share each key they read.
# Through SDPA a span pays off from ~64 rows; the native span kernel is faster than row by row
# from ~5 rows (2.7x at 17 rows over 1,300 positions), so with it only short spans go row by row.
ROWWISE_MAX_ROWS = 64
ROWWISE_MAX_ROWS_NATIVE = 8


@dataclass
class RowSet:
    """The row-wise rows of a pass and their slot table, indexed once per pass (not per layer)."""

    idx: torch.Tensor | None  # [R] the rows; None: every row of the pass
    slots: torch.Tensor  # [R, T]
    lens: torch.Tensor  # [R]
    bias: torch.Tensor | None  # [R, 1, 1, T] SDPA fallback mask, as AttnMeta.key_bias

    def window(self, size: int, dtype: torch.dtype) -> RowSet:
        """The same rows reading only the last ``size`` slots of their context (``dtype``: the
        SDPA fallback mask's)."""
        t = self.slots.shape[1]
        if t <= size:
            return self
        width = min(t, size)
        start = (self.lens - size).clamp_(min=0)  # [R]
        cols = start[:, None] + torch.arange(width, device=start.device)[None, :]  # [R, W]
        slots = self.slots.gather(1, cols.clamp_(max=t - 1))
        lens = self.lens - start
        bias = None
        if self.bias is not None or bool((lens < width).any()):
            padded = torch.arange(width, device=lens.device)[None, :] >= lens[:, None]
            bias = torch.zeros(padded.shape, dtype=dtype, device=lens.device)
            bias = bias.masked_fill_(padded, float("-inf"))[:, None, None, :]
        return RowSet(self.idx, slots, lens, bias)


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [N] where each row's K/V goes
    spans: list[SeqSpan]
    # Row-wise path for the rows of short spans: row i attends to the slots
    # row_slots[i, :row_lens[i]], i.e. its sequence's positions up to its own. Row-indexed, so a
    # subset of rows is a plain index; rows of other spans have length 0 and rowwise False.
    row_slots: torch.Tensor | None = None  # [N, T]
    row_lens: torch.Tensor | None = None  # [N]
    rowwise: list[bool] | None = None  # [N]
    # [N, 1, 1, T] additive mask for the SDPA fallback, -inf past row_lens; None when no row is
    # padded. Additive in the cache dtype because CPU SDPA is ~25% slower with a bool mask.
    key_bias: torch.Tensor | None = None
    _row_set: RowSet | None = field(default=None, repr=False)
    # pass_attention's result once built (a 1-tuple: None inside means the kernel cannot run it).
    _pass: tuple[PassAttention | None] | None = field(default=None, repr=False)
    _max_position: int | None = field(default=None, repr=False)
    _window_rows: dict[int, RowSet] = field(default_factory=dict, repr=False)

    def max_position(self) -> int:
        """The last position any query of the pass is at."""
        if self._max_position is None:
            self._max_position = max(max(s.q_positions) for s in self.spans)
        return self._max_position

    def window_rows(self, size: int, dtype: torch.dtype) -> RowSet:
        """``row_set`` reading only the last ``size`` slots of each row's context."""
        if size not in self._window_rows:
            self._window_rows[size] = self.row_set().window(size, dtype)
        return self._window_rows[size]

    def row_set(self) -> RowSet:
        """The row-wise rows (built on first use, then shared by the pass's layers)."""
        if self._row_set is None:
            assert self.rowwise is not None
            assert self.row_slots is not None and self.row_lens is not None
            if all(self.rowwise):
                self._row_set = RowSet(None, self.row_slots, self.row_lens, self.key_bias)
            else:
                rows = [r for r, w in enumerate(self.rowwise) if w]
                idx = torch.tensor(rows, device=self.slot_mapping.device)
                bias = None if self.key_bias is None else self.key_bias[idx]
                self._row_set = RowSet(idx, self.row_slots[idx], self.row_lens[idx], bias)
        return self._row_set

    def pass_attention(self) -> PassAttention | None:
        """The pass for the whole-layer kernel (built on first use, then shared by the pass's
        layers); None when a span's rows are not consecutive (an exit loop's subset may list
        them in another order), which only ``attend`` handles."""
        if self._pass is None:
            self._pass = (self._build_pass_attention(),)
        return self._pass[0]

    def window_pass_attention(self, size: int) -> PassAttention | None:
        """``pass_attention`` for a layer that sees the last ``size`` positions: the same while no
        query is that far in, then windowed slot tables for row-wise rows only (else None)."""
        if self.max_position() < size:
            return self.pass_attention()
        if not self.rowwise or not all(self.rowwise):
            return None
        rs = self.window_rows(size, torch.float32)  # its SDPA mask's dtype: unused by the kernel
        return PassAttention(self.slot_mapping, None, rs.slots, rs.lens)

    def _build_pass_attention(self) -> PassAttention | None:
        rowwise = self.rowwise or [False] * len(self.slot_mapping)
        spans = [s for s in self.spans if not rowwise[s.rows[0]]]
        if any(s.row_slice is None for s in spans):
            return None
        if not spans:
            rs = self.row_set()
            return PassAttention(self.slot_mapping, None, rs.slots, rs.lens)
        dev = self.slot_mapping.device
        if any(rowwise):
            rs = self.row_set()
            idx, slots, lens = rs.idx, rs.slots, rs.lens
        else:
            idx = torch.zeros(0, dtype=torch.long, device=dev)
            slots, lens = torch.zeros(0, 0, dtype=torch.long, device=dev), idx
        positions: list[torch.Tensor] = []
        for s in spans:  # shared with ``attend``'s span path, should a subset fall back to it
            if s.positions is None:
                s.positions = torch.tensor(s.q_positions, device=dev)
            positions.append(s.positions)
        starts = [s.rows[0] for s in spans]
        return PassAttention(
            self.slot_mapping, idx, slots, lens, starts, [s.context_slots for s in spans], positions
        )

    @classmethod
    def build(
        cls,
        spans: list[SeqSpan],
        slot_mapping: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        max_rows: int | None = None,
    ) -> AttnMeta:
        """``max_rows``: the longest span attended row by row (None: ``ROWWISE_MAX_ROWS``)."""
        meta = cls(slot_mapping, spans)
        limit = ROWWISE_MAX_ROWS if max_rows is None else max_rows
        short = [not s.fresh and len(s.rows) <= limit for s in spans]
        if not any(short):
            return meta
        n = len(slot_mapping)
        dev = slot_mapping.device
        per_row: list[torch.Tensor] = [slot_mapping[:0]] * n
        lens = [0] * n
        rowwise = [False] * n
        for s in (s for s, is_short in zip(spans, short) if is_short):
            for r, p in zip(s.rows, s.q_positions):
                per_row[r], lens[r], rowwise[r] = s.context_slots[: p + 1], p + 1, True
        meta.row_slots = pad_sequence(per_row, batch_first=True)  # [N, T], zero-padded
        meta.row_lens = torch.tensor(lens, dtype=torch.long, device=dev)
        meta.rowwise = rowwise
        t = meta.row_slots.shape[1]
        if min(lens) < t:
            padded = torch.arange(t, device=dev)[None, :] >= meta.row_lens[:, None]
            bias = torch.zeros(n, t, dtype=dtype, device=dev)
            meta.key_bias = bias.masked_fill_(padded, float("-inf"))[:, None, None, :]
        return meta

    def subset(self, keep_rows: Sequence[int]) -> AttnMeta:
        """Metadata for the rows ``keep_rows`` (indices into the current row set), renumbered."""
        new_index = {r: i for i, r in enumerate(keep_rows)}
        spans: list[SeqSpan] = []
        for s in self.spans:
            kept = [i for i, r in enumerate(s.rows) if r in new_index]
            if kept:
                rows = [new_index[s.rows[i]] for i in kept]
                span = SeqSpan(rows, [s.q_positions[i] for i in kept], s.context_slots, False)
                if s.key_bias is not None:  # the kept queries' rows of the mask
                    whole = len(kept) == len(s.rows)
                    span.key_bias = s.key_bias if whole else s.key_bias[:, :, kept]
                spans.append(span)
        idx = torch.tensor(keep_rows, dtype=torch.long, device=self.slot_mapping.device)
        meta = AttnMeta(self.slot_mapping[idx], spans)
        if self.row_slots is not None and self.row_lens is not None and self.rowwise is not None:
            meta.row_slots, meta.row_lens = self.row_slots[idx], self.row_lens[idx]
            meta.rowwise = [self.rowwise[r] for r in keep_rows]
            meta.key_bias = None if self.key_bias is None else self.key_bias[idx]
        return meta


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        native: NativeOps | None = None,
        windows: tuple[int | None, ...] = (),
    ) -> None:
        """``windows``: per layer, its sliding window (None or absent: full attention)."""
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = _zero_pool(shape, dtype, device)
        self.v = _zero_pool(shape, dtype, device)
        self.native = native  # attention that reads the pool in place (CPU)
        self.scale = head_dim**-0.5
        self.rowwise_max_rows = ROWWISE_MAX_ROWS if native is None else ROWWISE_MAX_ROWS_NATIVE
        self.windows = windows

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, Hkv, hd] for the slots [N]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta
    ) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, Hkv, hd] for the same rows. Returns [N, H*hd]."""
        self.write(layer, meta.slot_mapping, k, v)
        window = self.windows[layer] if layer < len(self.windows) else None
        if window is not None and meta.max_position() >= window:
            return self._attend_windowed(layer, q, k, v, meta, window)
        n, heads, hd = q.shape
        rowwise = meta.rowwise or []
        if rowwise and all(rowwise):
            return self._attend_rows(layer, q, meta.row_set()).view(n, heads * hd)
        if not rowwise and len(meta.spans) == 1 and meta.spans[0].row_slice == slice(0, n):
            return self._attend_span(layer, q, k, v, meta.spans[0])  # a prompt (chunk) alone
        out = torch.empty(n, heads * hd, dtype=q.dtype, device=q.device)
        if any(rowwise):
            rs = meta.row_set()
            out[rs.idx] = self._attend_rows(layer, q[rs.idx], rs).view(len(rs.lens), heads * hd)
        for s in meta.spans:
            if not rowwise or not rowwise[s.rows[0]]:
                out[s.row_slice if s.row_slice is not None else s.rows] = self._attend_span(
                    layer, q, k, v, s
                )
        return out

    def _attend_windowed(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttnMeta,
        window: int,
    ) -> torch.Tensor:
        """``attend`` (K/V already written) for a layer whose queries see ``window`` positions."""
        n, heads, hd = q.shape
        rowwise = meta.rowwise or [False] * n
        out = torch.empty(n, heads * hd, dtype=q.dtype, device=q.device)
        if any(rowwise):
            rs = meta.window_rows(window, q.dtype)
            rows = q if rs.idx is None else q[rs.idx]
            o = self._attend_rows(layer, rows, rs).view(len(rs.lens), heads * hd)
            if rs.idx is None:
                return o
            out[rs.idx] = o
        for s in meta.spans:
            if rowwise[s.rows[0]]:
                continue
            at = s.row_slice if s.row_slice is not None else s.rows
            if max(s.q_positions) < window:
                out[at] = self._attend_span(layer, q, k, v, s)
            else:
                out[at] = self._attend_span_window(layer, q, s, window)
        return out

    def _attend_span_window(
        self, layer: int, q: torch.Tensor, s: SeqSpan, window: int
    ) -> torch.Tensor:
        """SDPA of a span's queries over the positions their windows cover."""
        n = len(s.rows)
        if s.window_bias is None:
            s.window_bias = _window_bias(s, window, q.dtype)
        lo, bias = s.window_bias
        slots = s.context_slots[lo : lo + bias.shape[-1]]
        kc = self.k[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, T', hd]
        vc = self.v[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        qs = s.take(q).transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=bias, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, -1)

    def _attend_rows(self, layer: int, q: torch.Tensor, rs: RowSet) -> torch.Tensor:
        """q [R, H, hd] of the row-wise rows ``rs`` -> [R, H, hd]."""
        slots, lens, bias = rs.slots, rs.lens, rs.bias
        if self.native is not None:
            return self.native.decode_attention(
                q, self.k[layer], self.v[layer], slots, lens, self.scale
            )
        # index_select on the flat slot axis: ~4x faster on CPU than advanced indexing.
        shape = (*slots.shape, *self.k.shape[2:])  # [R, T, Hkv, hd]
        kc = self.k[layer].index_select(0, slots.view(-1)).view(shape).transpose(1, 2)
        vc = self.v[layer].index_select(0, slots.view(-1)).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc, vc, attn_mask=bias, enable_gqa=True
        )  # [R, H, 1, hd]
        return o.squeeze(2)

    def _attend_span(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: SeqSpan
    ) -> torch.Tensor:
        n = len(s.rows)
        qs = s.take(q)  # [n, H, hd]
        if self.native is not None:
            # The span's own K/V were written above, so the pool holds its whole context.
            if s.positions is None:
                s.positions = torch.tensor(s.q_positions, device=q.device)
            o = self.native.span_attention(
                qs, self.k[layer], self.v[layer], s.context_slots, s.positions, self.scale
            )
            return o.view(n, -1)
        qs = qs.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if s.fresh:
            # Whole sequence in this pass: its own K/V are the context, plain causal attention.
            ks = s.take(k).transpose(0, 1).unsqueeze(0)
            vs = s.take(v).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            slots = s.context_slots
            kc = (
                self.k[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
            )  # [1, Hkv, T, hd]
            vc = self.v[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0)
            if s.key_bias is None:
                s.key_bias = _causal_bias(s, q.dtype)
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=s.key_bias, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(n, -1)


def _zero_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On CPU its pages come from calloc, so memory is committed as blocks are
    first written rather than all at start (torch.zeros writes every byte: ~0.3 s and the
    whole pool's RSS for a 512 MiB pool, however little of it a run uses)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _causal_bias(s: SeqSpan, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, n, T]: 0 where a query may see a context position (its own and earlier), else -inf.
    Additive, in the cache dtype: CPU SDPA is slower with a bool mask."""
    dev = s.context_slots.device
    qpos = torch.tensor(s.q_positions, device=dev)
    hidden = torch.arange(len(s.context_slots), device=dev)[None, :] > qpos[:, None]  # [n, T]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=dev).masked_fill_(hidden, float("-inf"))
    return bias[None, None]


def _window_bias(s: SeqSpan, window: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """(lo, [1, 1, n, T']): the span reads context positions lo .. lo + T' - 1; 0 where query i
    (at position p) may see the position (p - window < position <= p), else -inf."""
    dev = s.context_slots.device
    qpos = torch.tensor(s.q_positions, device=dev)
    lo = max(0, min(s.q_positions) - window + 1)
    kpos = torch.arange(lo, max(s.q_positions) + 1, device=dev)[None, :]  # [1, T']
    seen = (kpos <= qpos[:, None]) & (kpos > qpos[:, None] - window)  # [n, T']
    bias = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill_(~seen, float("-inf"))
    return lo, bias[None, None]
