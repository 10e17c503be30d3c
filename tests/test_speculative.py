"""Speculative mode: an early exit drafts, the layers above verify; output equals full depth."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eeserve import LLM, SamplingParams
from eeserve.cli import main
from eeserve.engine.speculative import accept_sampled
from eeserve.engine.speculator import DRAFT_MAX_BATCH
from eeserve.exit_params import ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import save_sidecar
from eeserve.models.loader import load_model
from eeserve.tuning.heads import init_heads
from tests.distribution_checks import chi_square, sample_in_batches, second_token_chi_square
from tests.tiny_model import (
    assert_cache_matches_hf,
    assert_engine_clean,
    build_agreeing_model,
    kv_block_bytes,
    load_hf,
    run_together,
    with_random_tuned_heads,
)

L = 4
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "One two three"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FULL = ExitParams(enabled=False)


def spec(threshold: float, layers: list[int] | None = None, n: int = 4) -> ExitParams:
    return ExitParams(
        mode="speculative", threshold=threshold, exit_layers=layers or [1, 2, 3], num_draft_tokens=n
    )


def _run(llm: LLM, prompts: list[str], exits: list[ExitParams], params: SamplingParams = GREEDY):
    """Every request added before the first step, so that they share batches."""
    return run_together(llm, prompts, params, list(exits))


def _tokens(llm: LLM, prompts: list[str], exit_params: ExitParams, params=GREEDY):
    return [c.token_ids for c in _run(llm, prompts, [exit_params] * len(prompts), params)]


@pytest.fixture(scope="module")
def agreeing_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose last layer barely changes the hidden state: the logit lens at layer
    L - 1 mostly agrees with full depth, so drafts are both accepted and rejected."""
    return build_agreeing_model(tmp_path_factory.mktemp("spec") / "agree", L)


@pytest.fixture(scope="module")
def tuned_dir(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The varied tiny model with random tuned (linear adapter) heads at 1, 2, 3."""
    dst = tmp_path_factory.mktemp("spec") / "tuned"
    return with_random_tuned_heads(tiny_varied_dir, dst, [1, 2, 3], 5)


def _llm(folder: Path, **kw) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(str(folder), exit_policy="per_sequence", **kw)


@pytest.mark.parametrize("fixture", ["tiny_varied_dir", "tiny_qwen2_dir", "tiny_untied_dir"])
def test_greedy_equals_full_depth_on_each_variant(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    llm = _llm(request.getfixturevalue(fixture))
    full = _tokens(llm, PROMPTS, FULL)
    for threshold in (0.0, 0.05, 0.3, 2.0):  # 0: every token drafted; 2.0: none
        outs = _run(llm, PROMPTS, [spec(threshold)] * len(PROMPTS))
        assert [c.token_ids for c in outs] == full, threshold
        for c in outs:
            assert c.exit_layers == [L] * len(c.token_ids)
            assert c.draft_layers is not None and len(c.draft_layers) == len(c.token_ids)
        drafted = [x for c in outs for x in c.draft_layers or [] if x is not None]
        assert bool(drafted) == (threshold < 1), threshold
    assert_engine_clean(llm)


def test_acceptance_and_rejection_both_happen_and_match(agreeing_dir: Path) -> None:
    llm = _llm(agreeing_dir)
    full = _tokens(llm, PROMPTS, FULL)
    outs = _run(llm, PROMPTS, [spec(0.0, [L - 1])] * len(PROMPTS))
    assert [c.token_ids for c in outs] == full
    flags = [a for c in outs for a in c.draft_accepted or []]
    assert True in flags and False in flags, "both paths must be exercised"
    for c in outs:
        st = c.exit_stats
        assert st is not None and st.acceptance_rate is not None and st.mean_draft_length
        # The per-token record holds drafts up to the first rejected one of each verification;
        # the rate counts the drafts after it too (they were drafted and not accepted).
        drafted = [a for a in c.draft_accepted or [] if a is not None]
        if drafted:
            assert st.acceptance_rate <= sum(drafted) / len(drafted) + 1e-9
    assert any((c.exit_stats.acceptance_rate or 0) > 0 for c in outs)  # type: ignore[union-attr]
    assert_engine_clean(llm)


def test_mixed_batch_of_modes_with_tuned_heads(tuned_dir: Path) -> None:
    """Speculative rows (drafting and verifying on their own schedules) share steps with exit
    and full-depth rows; each speculative output equals full depth."""
    llm = _llm(tuned_dir)
    full = _tokens(llm, PROMPTS, FULL)
    exits = [spec(0.0, n=2), ExitParams(threshold=0.05), spec(0.2, n=5), FULL]
    outs = _run(llm, PROMPTS, exits)
    assert outs[0].token_ids == full[0] and outs[2].token_ids == full[2]
    assert outs[3].token_ids == full[3]
    for measure in ("classifier", "max_prob"):
        ep = ExitParams(mode="speculative", threshold=0.0, measure=measure)
        assert _tokens(llm, PROMPTS, ep) == full
    assert_engine_clean(llm)


def test_kv_after_verification_equals_full_depth(agreeing_dir: Path) -> None:
    llm = _llm(agreeing_dir)
    engine = llm.engine
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, exit_params=spec(0.0, [L - 1]))
    verified_checks = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not engine.scheduler.running:
            break
        (seq,) = engine.scheduler.running
        if seq.num_drafts == 0 and len(seq.output_token_ids) > 1:
            assert not seq.owed
            assert_cache_matches_hf(engine, seq, agreeing_dir)
            verified_checks += 1
    assert verified_checks >= 2
    assert_engine_clean(llm)


def test_preemption_prefix_caching_and_stop_strings(agreeing_dir: Path) -> None:
    roomy = _llm(agreeing_dir)
    full = _tokens(roomy, PROMPTS, FULL)
    block = kv_block_bytes(roomy, 4)
    tight = _llm(agreeing_dir, block_size=4, kv_cache_memory=block * 12)
    got = _tokens(tight, PROMPTS, spec(0.0, [L - 1]))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == full
    cached = LLM(str(agreeing_dir), exit_policy="per_sequence", block_size=4)
    prompts = [PROMPTS[0] + " jumps over", PROMPTS[0] + " jumps over the lazy"]
    ref = _tokens(roomy, prompts, FULL)
    again = [_tokens(cached, [p], spec(0.0, [L - 1]))[0] for p in prompts]
    assert again == ref
    assert cached.engine.block_manager.prefix_hit_blocks > 0
    # Stop strings and max_tokens see verified tokens only: same text and ids as full depth.
    text = roomy.generate(PROMPTS[:1], GREEDY, use_tqdm=False, exit_params=FULL)[0]
    stop = text.outputs[0].text[3:6]
    assert stop
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    a = _run(roomy, PROMPTS[:1], [FULL], sp)[0]
    b = _run(roomy, PROMPTS[:1], [spec(0.0, [L - 1])], sp)[0]
    assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    for llm in (roomy, tight, cached):
        assert_engine_clean(llm)


def test_large_decode_batches_verify_instead_of_drafting(agreeing_dir: Path) -> None:
    llm = _llm(agreeing_dir)
    prompts = [f"{PROMPTS[j % 4]} {j}" for j in range(DRAFT_MAX_BATCH + 1)]
    full = _tokens(llm, prompts, FULL)
    outs = _run(llm, prompts, [spec(0.0, [L - 1])] * len(prompts))
    assert [c.token_ids for c in outs] == full
    assert all(x is None for c in outs for x in c.draft_layers or [])


def test_no_block_leak_after_many_requests(agreeing_dir: Path) -> None:
    llm = _llm(agreeing_dir, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(0, 100, 4):  # batches of 4: larger decode batches do not draft
        prompts = [f"{PROMPTS[j % 4]} {j}" for j in range(i, i + 4)]
        _tokens(llm, prompts, spec(0.0, [L - 1]), params)
    assert_engine_clean(llm)


def test_logprobs_come_from_full_depth(agreeing_dir: Path) -> None:
    llm = _llm(agreeing_dir)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    (a,) = _run(llm, PROMPTS[:1], [FULL], sp)
    (b,) = _run(llm, PROMPTS[:1], [spec(0.0, [L - 1])], sp)
    assert a.token_ids == b.token_ids and a.logprobs is not None and b.logprobs is not None
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_bad_speculative_params_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"ExitParams\.mode"):
        ExitParams(mode="draft")
    for bad in (0, -1, 65, 2.5, True):
        with pytest.raises(ValueError, match=r"ExitParams\.num_draft_tokens"):
            ExitParams(mode="speculative", num_draft_tokens=bad)  # type: ignore[arg-type]


# -- sampling ----------------------------------------------------------------------------------


def test_speculative_sampling_is_exact_in_distribution() -> None:
    """accept_sampled with a draft distribution q far from p: the first kept token is
    distributed as p (both accepted and resampled paths taken), 20k fixed-seed draws."""
    gen = torch.Generator().manual_seed(0)
    v = 12
    p = torch.softmax(torch.randn(2, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(1, v, generator=gen) * 1.5, -1)
    counts = torch.zeros(v)
    paths = [0, 0]
    for _ in range(20000):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        tokens, a = accept_sampled([draft], q, p, gen)
        counts[tokens[0]] += 1
        paths[a] += 1
    assert min(paths) > 1000, paths
    stat, dof = chi_square(counts, p[0])
    # 99.9% quantile of chi-square with ~11 dof is 31.3; fixed seed: deterministic.
    assert stat < 31.3, (stat, dof)


def test_engine_sampling_matches_full_depth_distribution(agreeing_dir: Path) -> None:
    """The engine's second generated token (the first that can be a draft), sampled with top-k:
    its empirical distribution with speculation matches full depth's own (chi-square against
    full depth's probabilities at that position, fixed seeds)."""
    llm = _llm(agreeing_dir)
    prompt = PROMPTS[1]
    greedy_first = _tokens(llm, [prompt], FULL, SamplingParams(max_tokens=1, temperature=0.0))
    ids = llm.tokenizer(prompt).input_ids + greedy_first[0]
    n = 600
    sp = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=8, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    outs = sample_in_batches(llm, ids, sp, spec(0.0, [L - 1], n=2))
    flags = [c.draft_accepted[1] for c in outs]  # type: ignore[index]
    assert True in flags and False in flags
    stat, dof = second_token_chi_square(load_hf(agreeing_dir), ids, outs)
    # Normal approximation of the chi-square 99.9% quantile (deterministic with fixed seeds).
    assert stat < dof + 3.1 * (2 * dof) ** 0.5 + 5, (stat, dof)
    assert_engine_clean(llm)


def test_cli_generate_speculative(agreeing_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--model", str(agreeing_dir), "--prompt", PROMPTS[0], "--max-tokens", "8"]
    assert main([*base, "--no-exit"]) == 0
    full = capsys.readouterr().out
    extra = ["--exit-mode", "speculative", "--num-draft-tokens", "3", "--exit-threshold", "0"]
    assert main([*base, *extra]) == 0
    got = capsys.readouterr()
    assert got.out == full
    assert "acceptance" in got.err and "mean draft layer" in got.err
    assert main([*base, "--exit-mode", "speculative", "--num-draft-tokens", "0"]) == 2
    assert "num_draft_tokens" in capsys.readouterr().err


def test_draft_vocabulary_subset_keeps_output_exact(tuned_dir: Path) -> None:
    """Drafts projected onto the first ids only (``ExitConfig.draft_vocab``): drafts whose token
    lies outside are rejected, the output stays full depth's."""
    llm = _llm(tuned_dir)
    full = _tokens(llm, PROMPTS, FULL)
    llm.engine.runner.set_draft_vocab(list(range(40)))
    ep = ExitParams(mode="speculative", threshold=0.0, measure="classifier")
    outs = _run(llm, PROMPTS, [ep] * len(PROMPTS))
    assert [c.token_ids for c in outs] == full
    assert llm.engine.model_config.vocab_size > 40
    accepted = [t for c in outs for t, a in zip(c.token_ids, c.draft_accepted or []) if a]
    assert all(t < 40 for t in accepted)
    assert any(x is not None for c in outs for x in c.draft_layers or []), "nothing drafted"
    assert any(t >= 40 for c in outs for t in c.token_ids), "no draft could miss: weak test"
    assert_engine_clean(llm)


@pytest.mark.slow
def test_real_model_greedy_equals_full_depth() -> None:
    """smollm2 with its packaged tuned heads, probes and draft vocabulary: a few chat prompts in
    one batch, at the default threshold and a looser one (more drafts, more rejections)."""
    llm = LLM("smollm2", enable_prefix_caching=False)
    msgs = ["What is the capital of France?", "Write a short poem about the sea.", "Name 3 fruits."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": m}]) for m in msgs]
    sp = SamplingParams(max_tokens=40, temperature=0.0)
    full = [c.token_ids for c in _run(llm, prompts, [FULL] * 3, sp)]  # type: ignore[arg-type]
    for ep in (ExitParams(mode="speculative"), ExitParams(mode="speculative", threshold=0.8)):
        outs = _run(llm, prompts, [ep] * 3, sp)  # type: ignore[arg-type]
        assert [c.token_ids for c in outs] == full
    assert any(a is not None for c in outs for a in c.draft_accepted or [])
    assert_engine_clean(llm)


def test_layer_heads_draft_and_verify_exactly(
    tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``layer`` exit heads check exit l inside layer l + 1 (its attention already ran): drafts
    owe from l + 1 and their verification still reproduces full depth."""
    folder = tmp_path_factory.mktemp("spec") / "layered"
    shutil.copytree(tiny_varied_dir, folder)
    model, mcfg = load_model(folder, torch.float32, torch.device("cpu"))
    cfg = ExitConfig(
        mcfg.num_layers, [1, 2], head="tuned", adapter="layer",
        adapter_rank=mcfg.intermediate_size, classifier=True,
    )  # fmt: skip
    heads = init_heads(cfg, model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    save_sidecar(folder, cfg, heads)
    llm = _llm(folder)
    full = _tokens(llm, PROMPTS, FULL)
    for measure in ("classifier", "softmax_margin"):
        ep = ExitParams(mode="speculative", threshold=0.0, measure=measure, num_draft_tokens=3)
        outs = _run(llm, PROMPTS, [ep] * len(PROMPTS))
        assert [c.token_ids for c in outs] == full, measure
        assert any(x is not None for c in outs for x in c.draft_layers or [])
    assert_engine_clean(llm)
