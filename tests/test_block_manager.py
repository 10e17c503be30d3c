"""BlockManager on its own: allocation, growth, freeing, shared prefix blocks, LRU reuse, leaks.

The helpers below do to a ``Sequence`` exactly what the engine does around a forward pass:
``run_pass`` marks every token as computed, records the pass's exit layer (full depth unless told
otherwise), commits the full blocks and appends the sampled token.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from eeserve.engine.block_manager import BlockManager
from eeserve.engine.sequence import Sequence
from eeserve.sampling_params import SamplingParams

L = 4  # layers of the imaginary model: full depth


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def run_pass(bm: BlockManager, seq: Sequence, token: int = 7, exit_layer: int = L) -> None:
    seq.num_computed_tokens = seq.num_tokens
    seq.exit_layers.append(exit_layer)  # depth of this pass = depth of the positions it computed
    bm.commit(seq)
    seq.output_token_ids.append(token)


def clone(seq: Sequence, rid: str) -> Sequence:
    """A waiting copy of ``seq``'s tokens and exit record (as after a preemption)."""
    c = make_seq(seq.prompt_token_ids, rid)
    c.output_token_ids = list(seq.output_token_ids)
    c.exit_layers = list(seq.exit_layers)
    return c


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Ref counts equal table occurrences; the free list is exactly the unreferenced blocks."""
    holders: Counter[int] = Counter()
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
        holders.update(s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], block
    unreferenced = {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert bm.num_free_blocks == len(unreferenced)
    for s in seqs:
        assert len(s.block_table) >= bm.blocks_needed(s.num_tokens), "too few blocks"


def slots(seq: Sequence, block_size: int) -> list[int]:
    return [
        seq.block_table[p // block_size] * block_size + p % block_size
        for p in range(seq.num_tokens)
    ]


PREFIX = list(range(100, 112))  # 12 tokens = 3 full blocks of 4


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_gives_distinct_blocks_for_every_token() -> None:
    bm = BlockManager(10, 4)
    a, b = make_seq(list(range(9)), "a"), make_seq(list(range(50, 55)), "b")
    assert bm.can_allocate(a)
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 10 - 5
    assert a.num_computed_tokens == 0 and a.num_cached_tokens == 0  # nothing committed yet
    all_slots = slots(a, 4) + slots(b, 4)
    assert len(set(all_slots)) == len(all_slots), "two tokens share a KV slot"
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10
    assert a.block_table == [] and a.num_computed_tokens == 0
    check_invariants(bm, [])


def test_append_slot_adds_a_block_only_at_a_block_boundary() -> None:
    bm = BlockManager(10, 4)
    s = make_seq(list(range(8)))  # exactly 2 blocks
    bm.allocate(s)
    assert len(s.block_table) == 2
    sizes = []
    for token in range(9):
        run_pass(bm, s, token)  # now num_tokens = 9, 10, ...
        assert bm.can_append(s)
        bm.append_slot(s)
        sizes.append(len(s.block_table))
        check_invariants(bm, [s])
    # tokens 9..12 live in block 3, 13..16 in block 4, 17 in block 5
    assert sizes == [3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert bm.num_free_blocks == 5
    bm.free(s)
    assert bm.num_free_blocks == 10


def test_pool_exhaustion_is_reported_not_overdrawn() -> None:
    bm = BlockManager(3, 4)
    big = make_seq(list(range(13)))  # needs 4 blocks
    assert not bm.can_allocate(big)
    s = make_seq(list(range(12)))  # exactly 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert bm.num_free_blocks == 0
    other = make_seq([1])
    assert not bm.can_allocate(other)
    run_pass(bm, s)  # 13th token needs a 4th block
    assert not bm.can_append(s)
    bm.free(s)
    assert bm.can_allocate(other)


def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(12, 4)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)
    run_pass(bm, a)  # K/V written: the 3 full prompt blocks become cached
    b = make_seq([*PREFIX, 2, 3], "b")
    free_before = bm.num_free_blocks
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] not in a.block_table
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 2, 1]
    assert bm.num_free_blocks == free_before - 1  # only the unshared block is new
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    assert bm.prefix_hit_blocks == 3
    check_invariants(bm, [a, b])

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1]
    check_invariants(bm, [b])
    bm.free(b)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 12


def test_can_allocate_counts_shared_blocks_as_free_of_charge() -> None:
    bm = BlockManager(5, 4)
    a = make_seq([*PREFIX, 1], "a")  # 4 blocks
    bm.allocate(a)
    run_pass(bm, a)
    assert bm.num_free_blocks == 1
    b = make_seq([*PREFIX, 2], "b")  # 4 blocks, 3 of them shared with a
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)


def test_the_last_prompt_token_is_always_computed() -> None:
    bm = BlockManager(12, 4)
    a = make_seq(PREFIX[:8], "a")  # exactly 2 full blocks
    bm.allocate(a)
    run_pass(bm, a)
    b = make_seq(PREFIX[:8], "b")
    bm.allocate(b)
    # Block 2 holds the last token, which must run to produce logits: only block 1 is reused.
    assert b.num_cached_tokens == 4 and b.num_new_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.free(a)
    bm.free(b)


def test_blocks_are_shared_only_once_their_kv_is_written() -> None:
    bm = BlockManager(12, 4)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)  # scheduled, not yet run
    b = make_seq([*PREFIX, 2], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.prefix_hit_blocks == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.free(b)


def test_a_different_earlier_block_breaks_the_chain() -> None:
    bm = BlockManager(12, 4)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)
    run_pass(bm, a)
    # Same blocks 1 and 2, different block 0: chained hashes must not match anywhere.
    b = make_seq([999, *PREFIX[1:], 1], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.free(b)


def test_freed_blocks_keep_their_prefix_until_reused() -> None:
    bm = BlockManager(12, 4)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)
    run_pass(bm, a)
    old = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 12
    b = make_seq([*PREFIX, 5], "b")
    bm.allocate(b)
    assert b.block_table[:3] == old[:3], "cached free blocks were not reused"
    assert b.num_cached_tokens == 12 and bm.prefix_hit_blocks == 3
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1]
    check_invariants(bm, [b])
    bm.free(b)


def test_free_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(10, 4)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)
    assert a.block_table == [0, 1, 2, 3]
    run_pass(bm, a)
    bm.free(a)  # the tail goes back first, so the prefix head is evicted last
    c = make_seq(list(range(16)), "c")
    bm.allocate(c)
    assert c.block_table == [4, 5, 6, 7], "never-used blocks should go before cached ones"
    d = make_seq(list(range(200, 205)), "d")
    bm.allocate(d)
    assert d.block_table == [8, 9]
    e = make_seq(list(range(300, 305)), "e")
    bm.allocate(e)
    assert e.block_table == [3, 2], "a's tail (least useful) should be evicted first"
    bm.free(d)
    # a's first two blocks survived; its third was overwritten by e, so the chain stops there.
    b = make_seq([*PREFIX, 1], "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1]
    assert b.num_cached_tokens == 8
    assert set(b.block_table[2:]) == {8, 9}
    check_invariants(bm, [b, c, e])
    for s in (b, c, e):
        bm.free(s)
    check_invariants(bm, [])


def test_prefix_caching_disabled_never_shares() -> None:
    bm = BlockManager(12, 4, enable_prefix_caching=False)
    a = make_seq([*PREFIX, 1], "a")
    bm.allocate(a)
    run_pass(bm, a)
    b = make_seq([*PREFIX, 1], "b")
    bm.allocate(b)
    assert not set(a.block_table) & set(b.block_table)
    assert b.num_cached_tokens == 0 and bm.prefix_hit_blocks == 0
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(b)
    c = make_seq([*PREFIX, 1], "c")
    bm.allocate(c)
    assert c.num_cached_tokens == 0
    bm.free(c)


def test_preempted_sequence_gets_its_generated_blocks_back() -> None:
    bm = BlockManager(12, 4)
    s = make_seq(PREFIX[:6])
    bm.allocate(s)
    for t in range(7):  # prompt pass, then decode steps: 13 tokens in all
        run_pass(bm, s, 40 + t)
        bm.append_slot(s)
    old = list(s.block_table)
    bm.free(s)  # preemption
    assert bm.can_allocate(s)
    bm.allocate(s)  # resumed: 13 tokens, of which the first 12 (3 blocks) are cached
    assert s.block_table[:3] == old[:3]
    assert s.num_computed_tokens == 12 and s.num_new_tokens == 1
    bm.free(s)


def test_shallow_exit_depth_is_part_of_the_cache_key() -> None:
    bm = BlockManager(12, 4)
    full, shallow = make_seq(PREFIX[:6], "full"), make_seq(PREFIX[:6], "shallow")
    for s, depth in ((full, L), (shallow, 2)):
        bm.allocate(s)
        for t in range(7):  # same tokens; shallow's were computed only up to layer 2
            run_pass(bm, s, 40 + t, exit_layer=depth)
            bm.append_slot(s)
    old_full, old_shallow = list(full.block_table), list(shallow.block_table)
    bm.free(full)
    bm.free(shallow)
    full2, shallow2 = clone(full, "full2"), clone(shallow, "shallow2")
    bm.allocate(full2)
    bm.allocate(shallow2)
    # Block 0 holds prompt positions only: shared. Blocks 1 and 2 hold generated positions whose
    # K/V depth differs, so each sequence must get back its own.
    assert full2.block_table[0] == shallow2.block_table[0]
    assert full2.block_table[:3] == old_full[:3]
    assert shallow2.block_table[:3] == old_shallow[:3]
    assert not set(full2.block_table[1:3]) & set(shallow2.block_table[1:3])
    assert full2.num_cached_tokens == shallow2.num_cached_tokens == 12
    check_invariants(bm, [full2, shallow2])
    bm.free(full2)
    bm.free(shallow2)


def test_blocks_with_kv_debt_are_not_cached() -> None:
    bm = BlockManager(12, 4)
    s = make_seq(PREFIX[:6], "a")
    bm.allocate(s)
    for t in range(7):
        run_pass(bm, s, 40 + t, exit_layer=2 if t == 1 else L)
        bm.append_slot(s)
        if t == 1:
            s.owed = (6,)  # position 6 (block 1) has K/V up to some layer only: still owed
    other = clone(s, "b")
    bm.free(s)
    bm.allocate(other)
    assert other.num_cached_tokens == 4, "a block holding owed K/V was offered for reuse"
    bm.free(other)


def test_random_workload_keeps_counts_consistent_and_leaks_nothing() -> None:
    rng = random.Random(0)
    bm = BlockManager(24, 4)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    running: list[Sequence] = []
    for step in range(400):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(4))]
            s = make_seq(tokens, f"s{step}")
            if bm.can_allocate(s):
                bm.allocate(s)
                running.append(s)
        elif op < 0.8 and running:
            s = rng.choice(running)
            run_pass(bm, s, rng.randrange(1000))
            if bm.can_append(s):
                bm.append_slot(s)
            else:  # preempt, as the scheduler would
                bm.free(s)
                running.remove(s)
        elif running:
            s = running.pop(rng.randrange(len(running)))
            bm.free(s)
        check_invariants(bm, running)
    assert bm.prefix_hit_blocks > 0
    for s in running:
        bm.free(s)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks
