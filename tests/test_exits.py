"""Early exit: the invariants of docs/design.md, on a tiny random Llama whose exits we steer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from eeserve import LLM, SamplingParams
from eeserve.exit_params import ExitParams
from eeserve.models.config import rope_tables
from eeserve.models.llama import apply_rotary
from tests.tiny_model import TINY_KV_BYTES, assert_cache_matches_hf, run_together, step_until_debt

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
L = 4  # layers of the tiny model


def _gen(llm: LLM, prompts: list[str], exit_params: ExitParams | list[ExitParams] | None = None):
    if isinstance(exit_params, list):
        return run_together(llm, prompts, GREEDY, list(exit_params))
    return [
        o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False, exit_params=exit_params)
    ]


@pytest.fixture(scope="module")
def llm(tiny_varied_dir: Path) -> LLM:
    return LLM(
        str(tiny_varied_dir),
        kv_cache_memory=TINY_KV_BYTES,
        exit_policy="per_sequence",
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def full(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in _gen(llm, PROMPTS, ExitParams(enabled=False))]


def test_full_depth_matches_hf(tiny_varied_dir: Path, full: list[list[int]], llm: LLM) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_varied_dir)
    for prompt, ours in zip(PROMPTS, full):
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert ref[0, ids.shape[1] :].tolist() == ours


@pytest.mark.parametrize("measure", ["softmax_margin", "max_prob", "hidden_cosine"])
def test_unreachable_threshold_is_full_depth(llm: LLM, full: list[list[int]], measure: str) -> None:
    outs = _gen(llm, PROMPTS, ExitParams(threshold=1.5, measure=measure, exit_layers=[1, 2, 3]))
    assert [c.token_ids for c in outs] == full
    assert all(layer == L for c in outs for layer in c.exit_layers)


def test_no_exit_params_means_full_depth(llm: LLM, full: list[list[int]]) -> None:
    outs = _gen(llm, PROMPTS, None)
    assert [c.token_ids for c in outs] == full
    assert all(c.exit_stats is not None and c.exit_stats.layers_saved_fraction == 0 for c in outs)


def test_threshold_zero_exits_every_decode_token_at_first_exit(llm: LLM) -> None:
    outs = _gen(llm, PROMPTS, ExitParams(threshold=0.0, exit_layers=[2, 3]))
    for c in outs:
        assert c.exit_layers[0] == L  # the prefill's token: never exits
        assert c.exit_layers[1:] == [2] * (len(c.token_ids) - 1)
        assert c.exit_stats is not None
        assert c.exit_stats.layers_saved_fraction == pytest.approx(
            1 - sum(c.exit_layers) / (12 * L)
        )


def test_min_layer_moves_the_first_exit(llm: LLM) -> None:
    (c,) = _gen(llm, PROMPTS[:1], ExitParams(threshold=0.0, exit_layers=[1, 2, 3], min_layer=3))
    assert c.exit_layers[1:] == [3] * 11


def test_exit_tokens_come_from_the_exit_head(tiny_varied_dir: Path, llm: LLM) -> None:
    """With threshold 0 at layer 1 the token is argmax(lm_head(norm(h_1))): check against HF."""
    (c,) = _gen(llm, PROMPTS[:1], ExitParams(threshold=0.0, exit_layers=[1]))
    hf = AutoModelForCausalLM.from_pretrained(tiny_varied_dir)
    ids = llm.tokenizer(PROMPTS[0]).input_ids + c.token_ids
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    # Position p's hidden at layer 1 decides token p+1. With fill the deeper K/V of exited
    # tokens differ from HF's, but layer 1 only ever reads real layer-1 K/V.
    h1 = out.hidden_states[1][0]
    expected = hf.lm_head(hf.model.norm(h1)).argmax(-1)
    p0 = len(ids) - len(c.token_ids)
    assert c.token_ids[1:] == expected[p0 : p0 + len(c.token_ids) - 1].tolist()


def _row_exit_params() -> list[ExitParams]:
    return [
        ExitParams(threshold=0.0, exit_layers=[1, 2, 3]),  # confident everywhere
        ExitParams(threshold=[2.0, 0.0, 0.0], exit_layers=[1, 2, 3]),  # confident from layer 2
        ExitParams(threshold=[2.0, 2.0, 0.0], exit_layers=[1, 2, 3]),  # confident at layer 3
    ]


def test_rows_leaving_without_logits_get_their_own_token_in_a_mixed_batch(llm: LLM) -> None:
    """``hidden_cosine`` exits carry no logits: the leaving row is projected in the step's one
    LM-head pass after the full-depth rows, and its token must still be its own (same as alone)."""
    leaves = ExitParams(threshold=-2.0, measure="hidden_cosine", exit_layers=[2])
    stays = ExitParams(enabled=False)
    params = [leaves, stays, leaves]
    batched = _gen(llm, PROMPTS, params)
    alone = [_gen(llm, [p], [e])[0] for p, e in zip(PROMPTS, params)]
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids
        assert b.exit_layers == a.exit_layers
    assert set(batched[0].exit_layers[1:]) == {2} and set(batched[1].exit_layers) == {L}


def test_per_sequence_rows_leave_at_their_own_first_confident_exit(llm: LLM) -> None:
    outs = _gen(llm, PROMPTS, _row_exit_params())
    for c, layer in zip(outs, [1, 2, 3]):
        assert c.exit_layers[1:] == [layer] * 11


def test_batch_all_stops_where_every_row_is_confident(tiny_varied_dir: Path) -> None:
    llm = LLM(
        str(tiny_varied_dir),
        kv_cache_memory=TINY_KV_BYTES,
        exit_policy="batch_all",
        enable_prefix_caching=False,
    )
    outs = _gen(llm, PROMPTS, _row_exit_params())
    for c in outs:
        assert c.exit_layers[1:] == [3] * 11  # the slowest row holds everyone to layer 3
    # One row that never becomes confident keeps the whole batch at full depth.
    never = [*_row_exit_params()[:2], ExitParams(threshold=2.0, exit_layers=[1, 2, 3])]
    outs = _gen(llm, PROMPTS, never)
    assert all(c.exit_layers[1:] == [L] * 11 for c in outs)
    # Alone, each row exits at its own layer: batching, not the row, decided above.
    (alone,) = _gen(llm, PROMPTS[:1], [_row_exit_params()[0]])
    assert alone.exit_layers[1:] == [1] * 11


def test_fill_writes_the_reference_kv_of_skipped_layers(tiny_varied_dir: Path) -> None:
    """After one decode step where rows exit at layers 1, 2 and L, the cache rows of each exited
    token for every deeper layer equal norm -> K/V projection -> rotary of its exit hidden state."""
    llm = LLM(
        str(tiny_varied_dir),
        kv_cache_memory=TINY_KV_BYTES,
        enable_prefix_caching=False,
        exit_policy="per_sequence",
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    exits = [
        ExitParams(threshold=0.0, exit_layers=[1]),
        ExitParams(threshold=0.0, exit_layers=[2]),
        ExitParams(enabled=False),
    ]
    for p, e in zip(PROMPTS, exits):
        engine.add_request(p, params, exit_params=e)
    engine.step()  # prefill
    engine.step()  # one decode step: the first output token goes in, exits at 1 / 2 / L
    seqs = list(engine.scheduler.running)
    assert [s.exit_layers[1] for s in seqs] == [1, 2, L]

    hf = AutoModelForCausalLM.from_pretrained(tiny_varied_dir)
    cfg = engine.model_config
    cos, sin = rope_tables(cfg, 64)
    bs = engine.block_manager.block_size
    for seq, exit_layer in zip(seqs, [1, 2]):
        pos = seq.num_prompt_tokens  # the decoded token's position
        slot = seq.block_table[pos // bs] * bs + pos % bs
        with torch.no_grad():
            # The decoded token attended only to full-depth prompt K/V: HF's hidden is exact.
            out = hf(torch.tensor([seq.token_ids[: pos + 1]]), output_hidden_states=True)
            h = out.hidden_states[exit_layer][0, pos]
            for j in range(exit_layer, L):  # 0-based layers above the exit
                layer = hf.model.layers[j]
                x = layer.input_layernorm(h[None])
                k = layer.self_attn.k_proj(x).view(1, cfg.num_kv_heads, cfg.head_dim)
                v = layer.self_attn.v_proj(x).view(1, cfg.num_kv_heads, cfg.head_dim)
                rot = type("R", (), {"cos": cos[pos : pos + 1], "sin": sin[pos : pos + 1]})
                k = apply_rotary(k, rot)  # type: ignore[arg-type]
                torch.testing.assert_close(engine.runner.kv.k[j, slot], k[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(engine.runner.kv.v[j, slot], v[0], atol=1e-5, rtol=1e-4)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_layers_run_match_exit_telemetry(tiny_varied_dir: Path) -> None:
    """Count decoder-layer rows actually computed with hooks; compare with the exit record."""
    llm = LLM(str(tiny_varied_dir), kv_cache_memory=TINY_KV_BYTES, enable_prefix_caching=False)
    rows = [0]

    def count(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        rows[0] += args[0].shape[0]

    for layer in llm.engine.runner.model.layers:
        layer.register_forward_pre_hook(count)
    fused = llm.engine.runner.stack.fused
    if fused is not None:  # passes run whole layers in one kernel call, past the hooks
        run = fused.run

        def counted(call: Any, h: torch.Tensor, *args: Any) -> torch.Tensor:
            start, end = args[5], args[6]  # LayerStack.run passes the layer range last
            rows[0] += h.shape[0] * (end - start)
            return run(call, h, *args)

        fused.run = counted  # type: ignore[method-assign]
    (c,) = _gen(llm, PROMPTS[:1], ExitParams(threshold=0.05, exit_layers=[1, 2, 3]))
    n_prompt = len(llm.tokenizer(PROMPTS[0]).input_ids)
    assert len(c.exit_layers) == len(c.token_ids) == 12
    # The prompt runs every layer; each fed-back token runs to the layer its successor left at.
    assert rows[0] == n_prompt * L + sum(c.exit_layers[1:])
    assert c.exit_stats is not None
    assert c.exit_stats.layers_saved_fraction == pytest.approx(1 - sum(c.exit_layers) / (12 * L))
    assert len(set(c.exit_layers[1:])) > 1, "threshold should give a mix of exits on this model"


@pytest.mark.parametrize("policy", ["per_sequence"])
def test_preemption_and_prefix_caching_keep_exit_outputs(
    tiny_varied_dir: Path, policy: str
) -> None:
    exit_params = ExitParams(threshold=0.05, exit_layers=[1, 2, 3])
    roomy = LLM(
        str(tiny_varied_dir),
        kv_cache_memory=TINY_KV_BYTES,
        exit_policy=policy,
        enable_prefix_caching=False,
    )
    ref = _gen(roomy, PROMPTS, exit_params)
    # About two sequences' worth of blocks for three: preemption must happen.
    per_token = 2 * L * 2 * 16 * 4  # K and V, layers, kv heads, head dim, float32 bytes
    tight = LLM(
        str(tiny_varied_dir), exit_policy=policy, block_size=4, kv_cache_memory=per_token * 4 * 9
    )
    got = _gen(tight, PROMPTS, exit_params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert [c.exit_layers for c in got] == [c.exit_layers for c in ref]
    assert any(layer < L for c in ref for layer in c.exit_layers), "no exit: weak test"
    # Prefix caching on, shared prefixes: same outputs and exits, blocks reused.
    cached = LLM(
        str(tiny_varied_dir), kv_cache_memory=TINY_KV_BYTES, exit_policy=policy, block_size=4
    )
    prompts = [PROMPTS[0] + " jumps over", PROMPTS[0] + " jumps over the lazy"]
    first = _gen(roomy, prompts, exit_params)
    # One at a time: blocks are registered once their K/V is written, after the step.
    again = [_gen(cached, [p], exit_params)[0] for p in prompts]
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert [c.exit_layers for c in again] == [c.exit_layers for c in first]
    assert cached.engine.block_manager.prefix_hit_blocks > 0
    for llm_ in (tight, cached):
        bm = llm_.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_bad_exit_params_are_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="measure"):
        ExitParams(measure="entropy")
    with pytest.raises(ValueError, match="min_layer"):
        ExitParams(min_layer=0)
    with pytest.raises(ValueError, match="no exit threshold"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, exit_params=ExitParams())
    with pytest.raises(ValueError, match="below the model"):
        llm.generate(
            PROMPTS[:1],
            GREEDY,
            use_tqdm=False,
            exit_params=ExitParams(threshold=0.5, exit_layers=[L]),
        )
    with pytest.raises(ValueError, match="classifier"):
        llm.generate(
            PROMPTS[:1],
            GREEDY,
            use_tqdm=False,
            exit_params=ExitParams(threshold=0.5, measure="classifier"),
        )
    with pytest.raises(ValueError, match="no calibration"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, exit_params=ExitParams(tolerance=0.05))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_recompute_pays_debt_before_it_is_read(tiny_varied_dir: Path) -> None:
    """``recompute``: owed positions get their deep K/V when a later token goes deeper, so every
    position not owed holds exactly the K/V of a full-depth pass; runs are deterministic."""
    exit_params = ExitParams(threshold=0.05, exit_layers=[1, 2, 3])
    runs = []
    for _ in range(2):
        llm = LLM(
            str(tiny_varied_dir),
            kv_cache_memory=TINY_KV_BYTES,
            kv_fill="recompute",
            enable_prefix_caching=False,
        )
        engine = llm.engine
        seq = step_until_debt(engine, PROMPTS[0], exit_params)
        # Owed positions have K/V up to their depth only.
        checked = assert_cache_matches_hf(engine, seq, tiny_varied_dir)
        assert checked > seq.num_prompt_tokens * L
        runs.append((list(seq.output_token_ids), list(seq.exit_layers)))
        engine.abort_request(seq.request_id)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert runs[0] == runs[1]
    assert any(layer < L for layer in runs[0][1])


def test_recompute_with_batch_and_preemption(tiny_varied_dir: Path) -> None:
    exit_params = ExitParams(threshold=0.05, exit_layers=[1, 2, 3])
    per_row = {"kv_fill": "recompute", "exit_policy": "per_sequence"}
    roomy = LLM(
        str(tiny_varied_dir), kv_cache_memory=TINY_KV_BYTES, enable_prefix_caching=False, **per_row
    )
    ref = _gen(roomy, PROMPTS, exit_params)
    per_token = 2 * L * 2 * 16 * 4
    tight = LLM(str(tiny_varied_dir), block_size=4, kv_cache_memory=per_token * 4 * 9, **per_row)
    got = _gen(tight, PROMPTS, exit_params)
    assert tight.engine.scheduler.num_preemptions > 0
    # Preemption recomputes at full depth, which is what paying the debt gives: same tokens.
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert any(layer < L for c in ref for layer in c.exit_layers)


def test_calibration_applies_only_to_its_policy() -> None:
    from eeserve.engine.plan import resolve_exit_plan
    from eeserve.models.exit_config import ExitConfig

    cfg = ExitConfig(
        num_layers=L,
        exit_layers=[1, 2, 3],
        calibration=[
            {"measure": "softmax_margin", "delta": 0.05, "threshold": 0.8, "policy": "per_sequence"}
        ],
    )
    plan = resolve_exit_plan(ExitParams(tolerance=0.05), cfg, "per_sequence")
    assert plan is not None and set(plan.thresholds.values()) == {0.8}
    with pytest.raises(ValueError, match="batch_all"):
        resolve_exit_plan(ExitParams(tolerance=0.05), cfg, "batch_all")
