"""The default model trained to exit (``smollm2-ee``: the default weights plus the packaged sidecar
that carries a base delta) against its oracle, HF transformers on the same weights with the same
float16 delta added by HF projection name; and its exits at the calibrated default."""

from __future__ import annotations

import json

import pytest

from eeserve import LLM, ExitParams, SamplingParams
from eeserve.models.exit_heads import CONFIG_NAME
from eeserve.models.loader import packaged_sidecar, resolve_model
from tests.tiny_model import add_base_delta, hf_greedy_checked, hf_next_tokens, load_hf, make_llm

pytestmark = pytest.mark.slow

N_NEW = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "The three primary colors are"]


def test_variant_full_depth_equals_hf_with_the_delta_merged() -> None:
    llm = make_llm("smollm2-ee", kv_cache_memory=64 * 2**20, exit_policy="none")
    assert llm.engine.exit_config is not None and llm.engine.exit_config.base_delta is not None
    sidecar = packaged_sidecar("smollm2-ee")
    assert sidecar is not None
    scale = json.loads((sidecar / CONFIG_NAME).read_text())["base_delta"]["scale"]
    original = load_hf(resolve_model("smollm2"))
    variant = load_hf(resolve_model("smollm2"))
    add_base_delta(variant, sidecar, scale)
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=N_NEW)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(ids, greedy, use_tqdm=False)]
    # HF's greedy continuations, checked from the engine's tokens as drafts (hf_greedy_checked).
    want = [hf_greedy_checked(variant, i, d, N_NEW) for i, d in zip(ids, got)]
    assert got == want
    # The original model departs from them somewhere (its greedy choice after a prefix of them).
    plain = [hf_next_tokens(original, i, w[:-1]) for i, w in zip(ids, want)]
    assert plain != want, "the delta changes nothing"


@pytest.fixture(scope="module")
def shipped() -> LLM:
    """``smollm2-ee`` as shipped (its exit config's defaults), loaded once for the tests below."""
    return make_llm("smollm2-ee", kv_cache_memory=64 * 2**20)


def test_variant_generates_with_early_exit_at_its_default(shipped: LLM) -> None:
    llm = shipped
    cfg = llm.engine.exit_config
    assert cfg is not None and cfg.enabled_by_default and cfg.calibration
    out = llm.generate(
        ["Explain why the sky is blue."],
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        use_tqdm=False,
    )[0]
    layers = out.outputs[0].exit_layers
    stats = out.outputs[0].exit_stats
    assert len(layers) == 48 and stats is not None
    assert all(lay in (*cfg.exit_layers, cfg.num_layers) for lay in layers)
    assert stats.mean_exit_layer == pytest.approx(sum(layers) / len(layers))


def test_variant_exits_early_at_a_low_threshold(shipped: LLM) -> None:
    """At a loose threshold the variant's probes let tokens leave before full depth, and each
    leaves at one of its exit layers: the exits are live, not only allowed."""
    llm = shipped
    cfg = llm.engine.exit_config
    assert cfg is not None
    out = llm.generate(
        ["Explain why the sky is blue."],
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        exit_params=ExitParams(mode="exit", threshold=0.5, measure="classifier"),
        use_tqdm=False,
    )[0].outputs[0]
    early = [lay for lay in out.exit_layers if lay < cfg.num_layers]
    assert early, out.exit_layers
    assert set(early) <= set(cfg.exit_layers)
    assert out.exit_stats is not None and out.exit_stats.layers_saved_fraction > 0
