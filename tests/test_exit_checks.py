"""Exit checks through ``ExitChecks``: the shortlist check with a tuned head's adapter and norm
folded into its projections scores as the unfolded head does, and as the full-vocabulary
measure when the shortlist is the whole vocabulary; the classifier probe is the sidecar's; checks
that the layer kernel computes between layers take the same decisions as checks made apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eeserve import SamplingParams
from eeserve.engine import exit_loop
from eeserve.engine.kernel_route import CheckRoute
from eeserve.exit_params import ExitParams
from eeserve.models.loader import load_model
from tests.tiny_gemma3 import build_tiny_gemma3
from tests.tiny_model import make_llm, with_random_tuned_heads

LAYERS = [1, 2, 3]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def whole(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = int(load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))[1].vocab_size)
    dst = tmp_path_factory.mktemp("checks") / "whole"
    return with_random_tuned_heads(tiny_varied_dir, dst, LAYERS, 5, list(reversed(range(vocab))))


@pytest.fixture(scope="module")
def gemma_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 3 (window 8: the prompts below decode past it) with random tuned heads."""
    src = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    vocab = int(load_model(src, torch.float32, torch.device("cpu"))[1].vocab_size)
    dst = tmp_path_factory.mktemp("checks") / "gemma3"
    return with_random_tuned_heads(src, dst, LAYERS, 5, list(reversed(range(vocab))))


@torch.inference_mode()
def test_folded_shortlist_of_the_whole_vocabulary_is_the_full_measure(whole: Path) -> None:
    llm = make_llm(whole, exit_policy="per_sequence", enable_prefix_caching=False)
    checks = llm.engine.runner.exit_loop.checks
    h = torch.randn(
        5, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    for layer in LAYERS:
        for short, full in (
            ("shortlist_margin", "softmax_margin"),
            ("shortlist_max_prob", "max_prob"),
        ):
            a, no_logits = checks.confidence(short, layer, h, h)
            b, logits = checks.confidence(full, layer, h, h)
            assert no_logits is None and logits is not None  # a leaving row's token: full head
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for threshold in (0.05, 0.3):
        outs = [
            llm.generate(["a b c", "x"], GREEDY, use_tqdm=False, exit_params=ExitParams(
                threshold=threshold, measure=m))
            for m in ("shortlist_max_prob", "max_prob")
        ]  # fmt: skip
        a_out, b_out = ([c.outputs[0] for c in o] for o in outs)
        assert [c.token_ids for c in a_out] == [c.token_ids for c in b_out]
        assert [c.exit_layers for c in a_out] == [c.exit_layers for c in b_out]


@torch.inference_mode()
def test_a_short_shortlist_scores_as_the_unfolded_head(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    ids = list(range(7, 40))
    llm = make_llm(
        with_random_tuned_heads(tiny_varied_dir, tmp_path / "short", LAYERS, 5, ids),
        enable_prefix_caching=False,
    )
    runner = llm.engine.runner
    checks = runner.exit_loop.checks
    assert checks.shortlist_rows == len(ids)
    rows = runner.model.lm_head.weight[torch.tensor(ids)]
    h = torch.randn(
        4, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    for layer in LAYERS:
        unfolded = torch.nn.functional.linear(checks.heads.normed(layer, h), rows)
        folded = checks.measure_logits("shortlist_margin", layer, h)
        assert folded is not None
        torch.testing.assert_close(folded, unfolded, atol=1e-5, rtol=1e-5)
        probe, _ = checks.confidence("classifier", layer, h, h)
        torch.testing.assert_close(probe, torch.sigmoid(checks.heads.probe(layer, h)))


@torch.inference_mode()
def test_int8_weights_keep_the_adapter_and_check_close_to_float(whole: Path) -> None:
    """Quantised heads are not folded (the int8 adapter runs as it is); the shortlist check over
    int8 rows stays close to the float one."""
    f32 = make_llm(whole, enable_prefix_caching=False).engine.runner.exit_loop.checks
    q8 = make_llm(whole, enable_prefix_caching=False, quantization="int8")
    checks = q8.engine.runner.exit_loop.checks
    h = torch.randn(
        3, q8.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    for layer in LAYERS:
        a, _ = checks.confidence("shortlist_max_prob", layer, h, h)
        b, _ = f32.confidence("shortlist_max_prob", layer, h, h)
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.0)


@pytest.mark.parametrize("policy", ["per_sequence", "batch_all", "auto"])
@pytest.mark.parametrize(
    ("measure", "threshold"),
    [("shortlist_margin", 0.05), ("shortlist_max_prob", 0.1), ("classifier", 0.5)],
)
@pytest.mark.parametrize("model", ["whole", "gemma_heads"])
def test_checks_inside_the_layer_call_decide_as_checks_apart(
    model: str,
    policy: str,
    measure: str,
    threshold: float,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Llama and Gemma 3 layers (its local layers past their window)."""
    llm = make_llm(request.getfixturevalue(model), exit_policy=policy, enable_prefix_caching=False)
    loop = llm.engine.runner.exit_loop
    calls: list[int] = []
    run_checked = loop.stack.run_checked

    def counted(*args: object) -> object:
        calls.append(1)
        return run_checked(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop.stack, "run_checked", counted)
    params = ExitParams(threshold=threshold, measure=measure)
    prompts = ["a b c", "x", "the quick brown", "1 2"]
    inside = llm.generate(prompts, GREEDY, use_tqdm=False, exit_params=params)
    assert calls, "the decode steps' checks ran inside the layer call"
    kept_apart = CheckRoute(why_not="the test keeps the checks apart")
    monkeypatch.setattr(exit_loop, "route_checks", lambda **_: kept_apart)
    apart = llm.generate(prompts, GREEDY, use_tqdm=False, exit_params=params)
    a_out, b_out = [c.outputs[0] for c in inside], [c.outputs[0] for c in apart]
    assert [c.token_ids for c in a_out] == [c.token_ids for c in b_out]
    assert [c.exit_layers for c in a_out] == [c.exit_layers for c in b_out]
    layers = [x for c in a_out for x in c.exit_layers[1:]]
    assert min(layers) < llm.engine.model_config.num_layers, "some token exits"
