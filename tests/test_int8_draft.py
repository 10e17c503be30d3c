"""Speculative mode with the int8 drafter (``speculative_draft="int8"``): an int8 copy of the
model's own weights drafts at full depth, the float model verifies; output equals full depth."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eeserve import LLM, EngineConfig, SamplingParams
from eeserve.cli import main
from eeserve.engine.speculator import INT8_DRAFT_MAX_BATCH
from eeserve.exit_params import DraftSource, ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import save_sidecar
from tests.distribution_checks import sample_in_batches, second_token_chi_square
from tests.tiny_model import (
    assert_cache_matches_hf,
    assert_engine_clean,
    build_tiny_model,
    kv_block_bytes,
    load_hf,
    random_prompt,
    run_together,
)

L = 4
SPEC = ExitParams(mode="speculative")
FULL = ExitParams(enabled=False)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def varied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Varied greedy output and logits close enough that int8 rounding flips some argmaxes:
    drafts are both accepted and rejected (measured: ~93% accepted)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("int8d") / "m", weight_std=0.2, norm_noise=0.1, seed=0
    )


def _llm(folder: Path, **kw: object) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(str(folder), speculative_draft="int8", **kw)


def _prompts(n: int, start: int = 0) -> list[list[int]]:
    return [random_prompt(12, s, 300) for s in range(start, start + n)]


def _tokens(llm: LLM, prompts: list, ep: ExitParams, params: SamplingParams = GREEDY):
    return [c.token_ids for c in run_together(llm, prompts, params, [ep] * len(prompts))]


def _speculative_by_default(
    source: Path, folder: Path, exits: list[int], thresholds: dict, **extra: object
) -> LLM:
    """A copy of ``source`` whose sidecar makes requests speculative with int8 drafts."""
    shutil.copytree(source, folder)
    cfg = ExitConfig(
        L, exits, thresholds=thresholds, enabled_by_default=True,
        default_mode="speculative", default_draft="int8", **extra,  # type: ignore[arg-type]
    )  # fmt: skip
    save_sidecar(folder, cfg, None)
    llm = LLM(str(folder), enable_prefix_caching=False)
    assert llm.engine.speculative_draft == "int8"
    return llm


def _default_outputs_equal_full_depth(llm: LLM, prompts: list) -> list:
    """Requests without exit parameters, in one batch: their tokens are full depth's."""
    full = _tokens(llm, prompts, FULL)
    outs = run_together(llm, prompts, GREEDY, [None] * len(prompts))
    assert [c.token_ids for c in outs] == full
    return outs


@pytest.mark.parametrize("fixture", ["varied_dir", "tiny_qwen2_dir", "tiny_untied_dir"])
def test_greedy_equals_full_depth_at_batch_1_and_in_batches(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    llm = _llm(request.getfixturevalue(fixture))
    prompts = _prompts(6)
    full = _tokens(llm, prompts, FULL)
    for batch in (1, 3, 6):
        got: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            got += _tokens(llm, prompts[i : i + batch], SPEC)
        assert got == full, batch
    outs = run_together(llm, prompts[:2], GREEDY, [SPEC, SPEC])
    for c in outs:
        assert c.exit_layers == [L] * len(c.token_ids)
        drafted = [x for x in c.draft_layers or [] if x is not None]
        assert drafted and set(drafted) == {L}, "int8 drafts are taken at full depth"
    assert_engine_clean(llm)


def test_acceptance_and_rejection_both_happen(varied_dir: Path) -> None:
    llm = _llm(varied_dir)
    prompts = _prompts(6)
    full = _tokens(llm, prompts, FULL)
    outs = run_together(llm, prompts, GREEDY, [SPEC] * len(prompts))
    assert [c.token_ids for c in outs] == full
    flags = [a for c in outs for a in c.draft_accepted or [] if a is not None]
    assert True in flags and False in flags, "both paths must be exercised"
    rates = [c.exit_stats.acceptance_rate for c in outs if c.exit_stats]
    assert all(r is not None and 0 <= r <= 1 for r in rates) and max(rates) > 0.5  # type: ignore[operator]
    assert_engine_clean(llm)


def test_mixed_with_other_modes_and_large_batches(varied_dir: Path) -> None:
    """A step drafts only when every row drafts: beside full-depth or exit-mode rows, and in
    batches above the limit, speculative rows verify every step (still exact)."""
    llm = _llm(varied_dir)
    prompts = _prompts(INT8_DRAFT_MAX_BATCH + 1)
    full = _tokens(llm, prompts, FULL)
    outs = run_together(llm, prompts, GREEDY, [SPEC] * len(prompts))
    assert [c.token_ids for c in outs] == full
    assert all(x is None for c in outs for x in c.draft_layers or [])
    mixed = run_together(llm, prompts[:3], GREEDY, [SPEC, FULL, SPEC])
    assert [c.token_ids for c in mixed] == full[:3]
    assert_engine_clean(llm)


def test_kv_after_verification_equals_full_depth(varied_dir: Path) -> None:
    llm = _llm(varied_dir)
    engine = llm.engine
    engine.add_request(_prompts(1)[0], GREEDY, exit_params=SPEC)
    checks = drafted = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not engine.scheduler.running:
            break
        (seq,) = engine.scheduler.running
        if seq.num_drafts:
            drafted += 1
            # A drafted position is owed from layer 1: its K/V so far are the int8 copy's.
            owed = engine.runner.requests[seq.seq_id].owed
            assert seq.owed and all(owed[p].layer == 0 for p in seq.owed)
        elif len(seq.output_token_ids) > 1:
            assert not seq.owed
            assert_cache_matches_hf(engine, seq, varied_dir)
            checks += 1
    assert checks >= 2 and drafted >= 2
    assert_engine_clean(llm)


def test_preemption_prefix_caching_stop_strings_and_no_leak(varied_dir: Path) -> None:
    roomy = _llm(varied_dir)
    prompts = _prompts(4)
    full = _tokens(roomy, prompts, FULL)
    tight = _llm(varied_dir, block_size=4, kv_cache_memory=kv_block_bytes(roomy, 4) * 14)
    assert _tokens(tight, prompts, SPEC) == full
    assert tight.engine.scheduler.num_preemptions > 0
    cached = LLM(str(varied_dir), speculative_draft="int8", block_size=4)
    longer = [prompts[0] + [7, 8, 9], prompts[0] + [7, 8, 9, 10, 11]]
    ref = _tokens(roomy, longer, FULL)
    assert [_tokens(cached, [p], SPEC)[0] for p in longer] == ref
    assert cached.engine.block_manager.prefix_hit_blocks > 0
    text = roomy.generate([prompts[0]], GREEDY, use_tqdm=False, exit_params=FULL)[0]
    stop = text.outputs[0].text[3:6]
    assert stop
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    a = run_together(roomy, prompts[:1], sp, [FULL])[0]
    b = run_together(roomy, prompts[:1], sp, [SPEC])[0]
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(0, 100, 4):
        _tokens(tight, _prompts(4, 100 + i), SPEC, short)
    for llm in (roomy, tight, cached):
        assert_engine_clean(llm)


def test_logprobs_come_from_full_depth(varied_dir: Path) -> None:
    llm = _llm(varied_dir)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompt = _prompts(1)
    (a,) = run_together(llm, prompt, sp, [FULL])
    (b,) = run_together(llm, prompt, sp, [SPEC])
    assert a.token_ids == b.token_ids and a.logprobs and b.logprobs
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_sampling_matches_full_depth_distribution(varied_dir: Path) -> None:
    """The second generated token (the first that can be a draft), sampled at temperature 1.5
    with top-k 8: with int8 drafts its empirical distribution matches full depth's (chi-square,
    fixed seeds); drafts are both accepted and rejected."""
    llm = _llm(varied_dir)
    ids = _prompts(1, 7)[0]
    n = 600
    sp = [
        SamplingParams(max_tokens=3, temperature=1.5, top_k=8, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    outs = sample_in_batches(llm, ids, sp, SPEC)
    flags = [c.draft_accepted[1] for c in outs]  # type: ignore[index]
    assert True in flags and False in flags
    stat, dof = second_token_chi_square(load_hf(varied_dir), ids, outs, temperature=1.5)
    assert stat < dof + 3.1 * (2 * dof) ** 0.5 + 5, (stat, dof)
    assert_engine_clean(llm)


def test_bad_options_are_rejected(varied_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="speculative_draft must be one of"):
        EngineConfig(speculative_draft="int4")
    with pytest.raises(ValueError, match="already quantised"):
        EngineConfig(speculative_draft="int8", quantization="int8")
    base = ["generate", "--model", str(varied_dir), "--prompt", "hello", "--max-tokens", "8"]
    assert main([*base, "--no-exit"]) == 0
    full = capsys.readouterr().out
    extra = ["--exit-mode", "speculative", "--speculative-draft", "int8"]
    assert main([*base, *extra]) == 0
    got = capsys.readouterr()
    assert got.out == full and "acceptance" in got.err
    with pytest.raises(SystemExit) as e:
        main([*base, "--speculative-draft", "fp4"])
    assert e.value.code == 2 and "--speculative-draft" in capsys.readouterr().err


def test_auto_takes_the_models_default_draft(varied_dir: Path, tmp_path: Path) -> None:
    """A sidecar with ``default_mode: speculative`` and ``default_draft: int8``: requests without
    exit parameters are speculative with int8 drafts (full depth's tokens); a request stating an
    exit rule exits; ``auto`` falls back to exit drafts without the CPU kernels, on a quantised
    model, with exits off or with bfloat16 activations."""
    folder = tmp_path / "m"
    llm = _speculative_by_default(varied_dir, folder, [1, 2, 3], {"softmax_margin": 0.0})
    prompts = _prompts(3)
    outs = _default_outputs_equal_full_depth(llm, prompts)
    assert {x for c in outs for x in c.draft_layers or [] if x is not None} == {L}
    (exits,) = run_together(llm, prompts[:1], GREEDY, [ExitParams(threshold=0.0)])
    assert exits.draft_layers is None and min(exits.exit_layers) == 1  # threshold 0: first exit
    fallbacks = [{"cpu_kernels": False}, {"quantization": "int8"}, {"exit_policy": "none"}]
    for kw in [*fallbacks, {"dtype": "bfloat16"}]:
        assert LLM(str(folder), **kw).engine.speculative_draft == "exits", kw
    with pytest.raises(ValueError, match="default_draft"):
        ExitConfig(L, [1], default_draft="fp8")


def test_draft_ids_exit_drafts_take_an_id_prefix_int8_drafts_the_shortlist() -> None:
    cfg = ExitConfig(L, [1], draft_vocab=2, int8_draft_vocab=3, shortlist=[9, 4, 7, 1])
    assert cfg.draft_ids(10, DraftSource.EXITS) == [0, 1]
    assert cfg.draft_ids(10, DraftSource.INT8) == [9, 4, 7]
    assert ExitConfig(L, [1], shortlist=[9]).draft_ids(10, DraftSource.INT8) is None  # 0: every id
    assert (
        ExitConfig(L, [1], draft_vocab=10).draft_ids(10, DraftSource.EXITS) is None
    )  # all of them
    with pytest.raises(ValueError, match="int8_draft_vocab 3 needs a shortlist"):
        ExitConfig(L, [1], int8_draft_vocab=3, shortlist=[9, 4])


def test_int8_drafts_over_a_draft_vocabulary_keep_output_exact(
    varied_dir: Path, tmp_path: Path
) -> None:
    """``int8_draft_vocab`` over a shortlist that is not a prefix of the ids (Gemma's case): the
    int8 copy drafts only ids of the upper half, drafts of others are impossible (the
    verification produces those), and the output stays full depth's."""
    vocab = LLM(str(varied_dir)).engine.model_config.vocab_size
    upper = list(range(vocab - 1, vocab // 2 - 1, -1))
    vocab_kw = {"int8_draft_vocab": len(upper), "shortlist": upper}
    llm = _speculative_by_default(varied_dir, tmp_path / "m", [2], {}, **vocab_kw)
    outs = _default_outputs_equal_full_depth(llm, _prompts(4))
    pairs = [(t, a) for c in outs for t, a in zip(c.token_ids, c.draft_accepted or [])]
    assert any(a for _, a in pairs), "no draft accepted"
    assert all(t >= vocab // 2 for t, a in pairs if a)
    assert any(t < vocab // 2 for c in outs for t in c.token_ids), "no draft could miss"
    assert_engine_clean(llm)


@pytest.mark.slow
def test_real_model_greedy_equals_full_depth() -> None:
    """smollm2 with the int8 drafter: chat prompts one at a time and in one batch; nearly every
    draft is accepted (the copy agrees with the float model on nearly every token)."""
    llm = LLM("smollm2", speculative_draft="int8", enable_prefix_caching=False)
    msgs = ["What is the capital of France?", "Write a short poem about the sea.", "Name 3 fruits."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": m}]) for m in msgs]
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    full = [c.token_ids for c in run_together(llm, prompts, sp, [FULL] * 3)]  # type: ignore[arg-type]
    alone = [run_together(llm, [p], sp, [SPEC])[0] for p in prompts]  # type: ignore[list-item]
    together = run_together(llm, prompts, sp, [SPEC] * 3)  # type: ignore[arg-type]
    assert [c.token_ids for c in alone] == full
    assert [c.token_ids for c in together] == full
    flags = [a for c in alone for a in c.draft_accepted or [] if a is not None]
    assert len(flags) > 40 and sum(flags) / len(flags) > 0.8
    assert_engine_clean(llm)
