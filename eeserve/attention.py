"""Paged attention on top of PyTorch SDPA, and the per-step metadata it reads.

Contract: ``PagedKVCache`` owns the K/V pool tensors (``[layers, slots, kv_heads, head_dim]``, slot
= block_id * block_size + offset). ``attend`` first writes the rows' new K/V at their slots, then
computes attention of the rows' queries over each sequence's cached context. On CPU with the
engine's kernels (``native.py``) decode attention reads the pool in place; otherwise the context is
gathered and SDPA runs on the copy. ``AttnMeta`` describes one forward pass: which slot each row
writes and, per sequence, which rows are its queries and which slots form its context. ``subset``
re-targets it to the rows that are still running when some have exited early; sequences with no row
left drop out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eeserve.native import NativeOps


@dataclass
class SeqSpan:
    """One sequence's share of a forward pass."""

    rows: list[int]  # row indices (into the current row set) of this sequence's queries
    q_positions: list[int]  # their positions in the sequence
    context_slots: torch.Tensor  # [ctx_len] slots of positions 0..ctx_len-1
    fresh: bool  # rows are exactly positions 0..ctx_len-1 and nothing was cached before


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [N] where each row's K/V goes
    spans: list[SeqSpan]
    # Decode fast path (every span has exactly one row, rows in span order): padded gather.
    gather_slots: torch.Tensor | None = None  # [S, T]
    context_lens: torch.Tensor | None = None  # [S] valid positions of each gather_slots row
    # [S, 1, 1, T] additive mask, -inf where a shorter context is padded; None when no context
    # is padded. Additive in the cache dtype because CPU SDPA is ~25% slower with a bool mask.
    key_bias: torch.Tensor | None = None

    @classmethod
    def build(
        cls, spans: list[SeqSpan], slot_mapping: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> AttnMeta:
        meta = cls(slot_mapping, spans)
        if spans and all(len(s.rows) == 1 for s in spans):
            lens = [len(s.context_slots) for s in spans]
            t = max(lens)
            dev = slot_mapping.device
            gather = torch.zeros(len(spans), t, dtype=torch.long, device=dev)
            for i, s in enumerate(spans):
                gather[i, : lens[i]] = s.context_slots
            meta.gather_slots = gather
            meta.context_lens = torch.tensor(lens, dtype=torch.long, device=dev)
            if min(lens) < t:
                lens_t = torch.tensor(lens, device=dev)
                padded = torch.arange(t, device=dev)[None, :] >= lens_t[:, None]
                bias = torch.zeros(len(spans), t, dtype=dtype, device=dev)
                meta.key_bias = bias.masked_fill_(padded, float("-inf"))[:, None, None, :]
        return meta

    def subset(self, keep_rows: list[int]) -> AttnMeta:
        """Metadata for the rows ``keep_rows`` (indices into the current row set), renumbered."""
        new_index = {r: i for i, r in enumerate(keep_rows)}
        spans: list[SeqSpan] = []
        kept_seq: list[int] = []
        for si, s in enumerate(self.spans):
            pairs = [(new_index[r], p) for r, p in zip(s.rows, s.q_positions) if r in new_index]
            if pairs:
                spans.append(
                    SeqSpan([r for r, _ in pairs], [p for _, p in pairs], s.context_slots, False)
                )
                kept_seq.append(si)
        idx = torch.tensor(keep_rows, dtype=torch.long, device=self.slot_mapping.device)
        meta = AttnMeta(self.slot_mapping[idx], spans)
        if self.gather_slots is not None and keep_rows == sorted(keep_rows):
            sel = torch.tensor(kept_seq, dtype=torch.long, device=idx.device)
            meta.gather_slots = self.gather_slots[sel]
            meta.context_lens = None if self.context_lens is None else self.context_lens[sel]
            meta.key_bias = None if self.key_bias is None else self.key_bias[sel]
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
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.native = native  # decode attention that reads the pool in place (CPU)
        self.scale = head_dim**-0.5

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, Hkv, hd] for the slots [N]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta
    ) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, Hkv, hd] for the same rows. Returns [N, H*hd]."""
        self.write(layer, meta.slot_mapping, k, v)
        n, heads, hd = q.shape
        if self.native is not None and meta.context_lens is not None:
            assert meta.gather_slots is not None
            o = self.native.decode_attention(
                q, self.k[layer], self.v[layer], meta.gather_slots, meta.context_lens, self.scale
            )  # [S, H, hd]
            return o.view(n, heads * hd)
        if meta.gather_slots is not None:
            # index_select on the flat slot axis: ~4x faster on CPU than advanced indexing.
            flat = meta.gather_slots.view(-1)
            shape = (*meta.gather_slots.shape, *self.k.shape[2:])  # [S, T, Hkv, hd]
            kc = self.k[layer].index_select(0, flat).view(shape).transpose(1, 2)  # [S, Hkv, T, hd]
            vc = self.v[layer].index_select(0, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), kc, vc, attn_mask=meta.key_bias, enable_gqa=True
            )  # [S, H, 1, hd]
            return o.reshape(n, heads * hd)
        out = torch.empty(n, heads * hd, dtype=q.dtype, device=q.device)
        for s in meta.spans:
            out[s.rows] = self._attend_span(layer, q, k, v, s)
        return out

    def _attend_span(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: SeqSpan
    ) -> torch.Tensor:
        rows = s.rows
        qs = q[rows[0] : rows[-1] + 1] if _contiguous(rows) else q[rows]
        qs = qs.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if s.fresh:
            # Whole sequence in this pass: its own K/V are the context, plain causal attention.
            ks = k[rows[0] : rows[-1] + 1].transpose(0, 1).unsqueeze(0)
            vs = v[rows[0] : rows[-1] + 1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            kc = self.k[layer][s.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, hd]
            vc = self.v[layer][s.context_slots].transpose(0, 1).unsqueeze(0)
            t = len(s.context_slots)
            qpos = torch.tensor(s.q_positions, device=q.device)
            mask = torch.arange(t, device=q.device)[None, :] <= qpos[:, None]  # [n, T]
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1).reshape(len(rows), -1)


def _contiguous(rows: list[int]) -> bool:
    return rows[-1] - rows[0] + 1 == len(rows)
