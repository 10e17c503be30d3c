"""Chunked prefill: decode rows and prompt chunks share a forward pass, outputs do not change.

- The scheduler alone (no model): a prompt longer than the budget is split over several passes
  while every running sequence gets its decode row in each of them.
- End to end on a tiny model: outputs with chunking equal outputs without it (greedy and seeded
  sampling, logprobs), with prompts longer than the budget, requests joining mid-way, prefix-cache
  hits that end inside a chunk, preemption, and early exits under both policies and both KV-debt
  strategies. Every engine is built with ``make_llm``, so the suite's autouse fixture checks that
  no KV block leaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eeserve import LLM, EngineConfig, ExitParams, RequestOutput, SamplingParams
from eeserve.engine.block_manager import BlockManager
from eeserve.engine.scheduler import Scheduler, SchedulerConfig, chunk_size
from eeserve.engine.sequence import Sequence
from eeserve.models.cost import CostModel
from tests.tiny_model import assert_same_completion, kv_block_bytes, make_llm, random_prompt

BUDGET = 12  # positions per pass: every prompt below longer than this is chunked
L = 4  # layers of the tiny model


def engine(folder: Path, chunked: bool, **options: Any) -> LLM:
    options.setdefault("kv_cache_memory", 16 * 2**20)
    return make_llm(
        folder,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        enable_chunked_prefill=chunked,
        **options,
    )


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, logprobs=3)


def prompts(llm: LLM) -> list[list[int]]:
    v = llm.engine.model_config.vocab_size
    return [random_prompt(n, 100 + n, v) for n in (5, 31, 3, 47, 12)]


def params() -> list[SamplingParams]:
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    return [greedy(), sampled, greedy(9), greedy(), greedy(12)]


# -- the scheduler alone ---------------------------------------------------------------------


def _fake_step(out: Any) -> None:
    """What the engine does after a pass: advance computed tokens, sample where due."""
    for seq, n in zip(out.seqs, out.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)


def test_long_prompt_is_split_while_every_running_sequence_decodes() -> None:
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(4, BUDGET, enable_chunked_prefill=True), bm)
    sp = SamplingParams(max_tokens=100)
    short = [Sequence(f"s{i}", [1, 2, 3], sp) for i in range(2)]
    for s in short:
        sched.add(s)
    _fake_step(sched.schedule())  # both prompts (6 positions) in one pass
    assert all(len(s.output_token_ids) == 1 for s in short)
    long = Sequence("long", list(range(3, 43)), sp)  # 40 tokens > budget
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        out = sched.schedule()
        counts = dict(zip([s.request_id for s in out.seqs], out.num_tokens))
        assert counts["s0"] == counts["s1"] == 1, "a decoding sequence missed its row"
        assert sum(out.num_tokens) <= BUDGET
        chunks.append(counts["long"])
        _fake_step(out)
    assert chunks == [10, 10, 10, 10]  # the budget minus the two decode rows
    assert long.num_computed_tokens == 40
    for s in [*short, long]:
        sched.finish(s, "stop")
    assert bm.num_free_blocks == bm.num_blocks


def test_attention_context_shortens_late_chunks_within_the_budget() -> None:
    """Position p costs 1 + p / C: chunks shrink as the prompt goes on, no pass costs more than
    the budget, and every prompt position is computed exactly once."""
    bm = BlockManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
    c, budget = 40.0, 48
    sched = Scheduler(SchedulerConfig(4, budget, True, attention_context=c), bm)
    sp = SamplingParams(max_tokens=100)
    short = Sequence("s0", [1, 2, 3], sp)
    sched.add(short)
    _fake_step(sched.schedule())
    long = Sequence("long", list(range(3, 203)), sp)  # 200 positions
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        out = sched.schedule()
        counts = dict(zip([s.request_id for s in out.seqs], out.num_tokens))
        assert counts["s0"] == 1
        start, n = long.num_computed_tokens, counts["long"]
        assert 1 + sum(1 + p / c for p in range(start, start + n)) <= budget + 1e-9
        chunks.append(n)
        _fake_step(out)
    assert sum(chunks) == 200 and long.num_computed_tokens == 200
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > 3 * chunks[-2], chunks
    assert chunk_size(0, 100, 10, 0.0) == (10, 10.0)  # C = 0: a position counts one
    assert chunk_size(5, 3, 10, 0.0) == (3, 3.0)
    assert chunk_size(10_000, 50, 2.0, 40.0)[0] == 1  # at least one position, always


def test_attention_context_default_follows_the_attention_kernel(tiny_varied_dir: Path) -> None:
    """Unset, a position's attention is weighed at the span kernel's rate with the CPU kernels
    (0.6 of the projections'), at SDPA's without them (0.4)."""
    for kernels, efficiency in ((True, 0.6), (False, 0.4)):
        llm = engine(tiny_varied_dir, True, cpu_kernels=kernels)
        mcfg = llm.engine.model_config
        expected = CostModel.of(mcfg).attention_context(mcfg, efficiency)
        assert llm.engine.scheduler.config.attention_context == pytest.approx(expected)


def test_chunked_prefill_needs_room_beyond_the_decode_rows() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=64)
    EngineConfig(max_num_seqs=64, max_num_batched_tokens=64, enable_chunked_prefill=False)
    # Unset, the budget follows max_num_seqs where 112 would leave prompts too little room.
    assert EngineConfig().batched_tokens() == 112
    assert EngineConfig(max_num_seqs=128).batched_tokens() == 176
    assert EngineConfig(max_num_seqs=128, max_num_batched_tokens=160).batched_tokens() == 160
    with pytest.raises(ValueError, match="attention_context"):
        EngineConfig(attention_context=-1.0)
    EngineConfig(attention_context=0.0)


# -- end to end ------------------------------------------------------------------------------


def _mixed_steps(
    llm: LLM, ps: list[list[int]], sps: list[SamplingParams], ex: ExitParams | None = None
) -> list[RequestOutput]:
    """Requests join one per step, so decode rows and prompt chunks share passes."""
    engine = llm.engine
    pending = list(zip(ps, sps))
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    mixed = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            p, sp = pending.pop(0)
            ids.append(engine.add_request(p, sp, exit_params=ex))
        running = [s for s in engine.scheduler.running if s.output_token_ids]
        outs = engine.step()
        mixed += bool(running) and any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
        )
        done.update({o.request_id: o for o in outs if o.finished})
    assert mixed > 0, "no pass mixed decodes with a prompt chunk: weak test"
    return [done[i] for i in ids]


def test_outputs_equal_unchunked_with_long_prompts(tiny_varied_dir: Path) -> None:
    # No prefix caching: the second run must compute its prompts again, in chunks.
    on = engine(tiny_varied_dir, True, enable_prefix_caching=False)
    off = engine(tiny_varied_dir, False)
    ps = prompts(on)
    a = on.generate(ps, params(), use_tqdm=False)
    b = off.generate(ps, params(), use_tqdm=False)
    for x, y in zip(a, b):
        assert_same_completion(x, y)
    joined = _mixed_steps(on, ps, params())
    for x, y in zip(joined, b):
        assert_same_completion(x, y)


def test_chunks_short_of_the_last_token_skip_the_lm_head(tiny_varied_dir: Path) -> None:
    """A 47-token prompt in passes of 12: only the pass that samples runs the LM head, and for
    that one row only, beside a decoding sequence too."""
    llm = engine(tiny_varied_dir, True, enable_prefix_caching=False)
    rows: list[int] = []
    head = llm.engine.runner.lm_head
    hook = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    prompt = prompts(llm)[3]
    llm.generate([prompt], greedy(1), use_tqdm=False)
    assert rows == [1]
    rows.clear()
    engine_ = llm.engine
    engine_.add_request(prompts(llm)[0], greedy(8))
    engine_.step()  # the short prompt, whole
    engine_.add_request(prompt, greedy(1))
    while engine_.has_unfinished_requests():
        engine_.step()
    hook.remove()
    # One row per sampled token (the short prompt's first, its 7 decodes, the long prompt's
    # first), so never a row of a chunk that samples nothing; the last chunk's pass has two.
    assert sum(rows) == 1 + 7 + 1 and rows.count(2) == 1


def test_prefix_cache_hit_ending_inside_a_chunk(tiny_varied_dir: Path) -> None:
    on = engine(tiny_varied_dir, True)
    off = engine(tiny_varied_dir, False, enable_prefix_caching=False)
    base = prompts(on)[3]  # 47 tokens
    first = on.generate([base[:30]], greedy(), use_tqdm=False)[0]
    assert on.engine.block_manager.prefix_hit_blocks == 0
    # 28 cached tokens (7 full blocks of the first prompt), then 19 more: chunks of 12 and 7.
    second = on.generate([base], greedy(), use_tqdm=False)[0]
    assert second.num_cached_tokens == 28
    for x, y in zip([first, second], off.generate([base[:30], base], greedy(), use_tqdm=False)):
        assert_same_completion(x, y)


def test_preemption_with_chunks_keeps_outputs(tiny_varied_dir: Path) -> None:
    roomy = engine(tiny_varied_dir, False)
    ps = prompts(roomy)
    tight = engine(
        tiny_varied_dir, True, kv_cache_memory=30 * kv_block_bytes(roomy, 4)
    )  # 120 tokens: the five requests need ~170
    a = tight.generate(ps, params(), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    for x, y in zip(a, roomy.generate(ps, params(), use_tqdm=False)):
        assert_same_completion(x, y)


@pytest.mark.parametrize("kv_fill", ["fill", "recompute"])
def test_per_sequence_exits_unchanged_by_chunking(tiny_varied_dir: Path, kv_fill: str) -> None:
    ex = ExitParams(threshold=0.05, exit_layers=[1, 2, 3])
    opts = {"kv_fill": kv_fill, "enable_prefix_caching": False, "exit_policy": "per_sequence"}
    on = engine(tiny_varied_dir, True, **opts)
    off = engine(tiny_varied_dir, False, **opts)
    ps = prompts(on)
    sps = [greedy() for _ in ps]
    b = off.generate(ps, sps, use_tqdm=False, exit_params=ex)
    c = _mixed_steps(on, ps, sps, ex)
    assert any(layer < L for o in b for layer in o.outputs[0].exit_layers), "no exit: weak test"
    for x, y in zip(c, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].exit_layers == y.outputs[0].exit_layers


@pytest.mark.parametrize("kv_fill", ["fill", "recompute"])
def test_batch_all_decode_rows_exit_beside_prompt_chunks(
    tiny_varied_dir: Path, kv_fill: str
) -> None:
    """Threshold 0: every decode row is confident at the first exit layer. A prompt chunk in the
    same pass is no part of ``batch_all``'s batch, so it does not hold the decode rows back."""
    ex = ExitParams(threshold=0.0, exit_layers=[1, 2, 3])
    on = engine(tiny_varied_dir, True, exit_policy="batch_all", kv_fill=kv_fill)
    off = engine(tiny_varied_dir, False, exit_policy="batch_all", kv_fill=kv_fill)
    ps = prompts(on)
    sps = [greedy() for _ in ps]
    a = _mixed_steps(on, ps, sps, ex)
    b = off.generate(ps, sps, use_tqdm=False, exit_params=ex)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].exit_layers[1:] == [1] * (len(x.outputs[0].exit_layers) - 1)


def test_speculative_rows_beside_prompt_chunks_stay_lossless(tiny_varied_dir: Path) -> None:
    """Threshold 0 drafts every token; verification rows share passes with prompt chunks."""
    ex = ExitParams(mode="speculative", threshold=0.0, exit_layers=[1, 2, 3], num_draft_tokens=3)
    on = engine(tiny_varied_dir, True, enable_prefix_caching=False)
    off = engine(tiny_varied_dir, False)
    ps = prompts(on)
    sps = [greedy() for _ in ps]
    a = _mixed_steps(on, ps, sps, ex)
    b = off.generate(ps, sps, use_tqdm=False, exit_params=ExitParams(enabled=False))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    stats = [x.outputs[0].exit_stats for x in a]
    assert any(s is not None and s.acceptance_rate is not None for s in stats), "no drafts"
