"""Paged KV cache manager: block ids, reference counts and prefix hashes. Pure Python, no tensors.

Contract:
- A sequence's K/V lives in fixed-size blocks listed in ``seq.block_table``; slot ``p`` of the
  sequence is ``block_table[p // block_size] * block_size + p % block_size`` in the runner's pool.
- ``allocate`` gives a waiting sequence blocks for all its tokens, reusing cached blocks whose
  chained hash matches (prefix caching); ``append_slot`` makes room for one more token;
  ``free`` drops the sequence's references. A block whose count reaches zero goes back to the
  free list but keeps its hash until it is handed out again, so a later request (or the same one
  after preemption) can still hit it.
- ``commit`` hashes the sequence's full blocks once their K/V is written. The key covers the
  tokens and, for generated positions, the layer each was computed to, because an early-exited
  token's deep K/V is filled from a shallow state and must not stand in for a full-depth one.
  The engine does not commit a speculative sequence while it has unverified drafts; ``truncate``
  returns the blocks of rejected drafts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from eeserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = least recently freed first: cached blocks are evicted LRU.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}
        self.prefix_hit_blocks = 0  # counter, for tests and metrics

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------

    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the full blocks before the last token (which is always computed)."""
        if not self.enable_prefix_caching:
            return []
        hashes: list[bytes] = []
        prev = b""
        for i in range((seq.num_tokens - 1) // self.block_size):
            prev = self._hash(seq, i, prev)
            hashes.append(prev)
        return hashes

    def _hash(self, seq: Sequence, index: int, prev: bytes) -> bytes:
        start, end = index * self.block_size, (index + 1) * self.block_size
        h = hashlib.sha256(prev)
        h.update(repr(seq.token_ids[start:end]).encode())
        h.update(repr(seq.kv_depth_key(start, end)).encode())
        return h.digest()

    def _lookup(self, block_hash: bytes) -> Block | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.block_hash == block_hash else None

    def can_allocate(self, seq: Sequence) -> bool:
        needed = self.blocks_needed(seq.num_tokens)
        for h in self._prefix_hashes(seq):
            block = self._lookup(h)
            if block is None:
                break
            if block.ref_count > 0:
                needed -= 1  # shared, costs no free block
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        hashes: list[bytes] = []
        for h in self._prefix_hashes(seq):
            block = self._lookup(h)
            if block is None:
                break
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            hashes.append(h)
        self.prefix_hit_blocks += len(hashes)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hashes) * self.block_size
        self._seq_hashes[seq.seq_id] = hashes
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.ref_count = 1
        return block_id

    # -- decode --------------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of every token not yet computed (one, in decode)."""
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def covers(self, seq: Sequence) -> bool:
        """Does ``seq`` hold blocks for all its tokens?"""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens)

    def append_slot(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full with K/V (call after each forward pass)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        full = seq.num_computed_tokens // self.block_size
        for i in range(len(hashes), full):
            if seq.owed and seq.owed[0] < (i + 1) * self.block_size:
                return  # shallow-only K/V in this block: never reusable as it stands
            h = self._hash(seq, i, hashes[-1] if hashes else b"")
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = h
                self._cached.setdefault(h, block.block_id)

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past what ``seq.num_tokens`` needs (rejected speculative drafts).
        Those blocks were taken for unverified positions, so none of them carries a hash."""
        keep = self.blocks_needed(seq.num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, "truncated a shared block"
            self._free[block_id] = None
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.seq_id, None)
