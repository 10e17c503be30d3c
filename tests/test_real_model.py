"""The real default model (SmolLM2-135M-Instruct, 30 layers) at full depth against HF transformers.

Both models are loaded once for the module. Greedy tokens must equal HF's greedy continuation
exactly, batched and one prompt at a time; returned logprobs must equal HF's log-softmax within
1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from eeserve import LLM, ExitParams, SamplingParams
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import prompt_texts
from tests.hf_parity import N_NEW, PROMPTS, greedy
from tests.tiny_model import hf_greedy_checked, hf_next_logprobs, load_hf, logprob_error, make_llm

pytestmark = pytest.mark.slow


@dataclass
class Real:
    llm: LLM
    hf: Any
    prompt_ids: list[list[int]]
    refs: list[list[int]]


@pytest.fixture(scope="module")
def real() -> Real:
    # Full depth whatever the packaged exit config enables by default: this is the HF oracle.
    llm = make_llm("smollm2", kv_cache_memory=64 * 2**20, exit_policy="none")
    hf = load_hf(resolve_model("smollm2"))
    ids = [llm.engine.tokenize(p) for p in PROMPTS]
    # HF checks the engine's tokens as a draft (hf_greedy_checked): HF's greedy continuation
    # whatever the engine's, in one pass over HF's weights a prompt instead of one a token.
    drafts = llm.generate(ids, greedy(), use_tqdm=False)
    refs = [hf_greedy_checked(hf, i, d.outputs[0].token_ids, N_NEW) for i, d in zip(ids, drafts)]
    return Real(llm, hf, ids, refs)


def test_default_model_is_the_30_layer_smollm2(real: Real) -> None:
    cfg = real.llm.engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert real.hf.config.num_hidden_layers == 30


def test_greedy_batched_equals_hf(real: Real) -> None:
    outs = real.llm.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
    for ids, ref, out in zip(real.prompt_ids, real.refs, outs):
        c = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert c.token_ids == ref, f"greedy tokens differ from HF for {out.prompt!r}"
        assert c.text == real.llm.tokenizer.decode(ref, skip_special_tokens=True)
        assert c.finish_reason == "length"
    # Logprobs of the whole completion against one HF forward pass (first prompt; all would
    # only repeat the same check at 30 layers' cost).
    c = outs[0].outputs[0]
    ref_lp = hf_next_logprobs(real.hf, real.prompt_ids[0], c.token_ids)
    err = logprob_error(c.token_ids, c.logprobs, ref_lp)
    assert err < 1e-4, f"logprobs differ from HF by {err}"


def test_greedy_one_by_one_equals_hf(real: Real) -> None:
    for ids, ref in zip(real.prompt_ids, real.refs):
        out = real.llm.generate([ids], greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref


def test_chat_uses_the_template_and_answers(real: Real) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    out = real.llm.chat(messages, params, use_tqdm=False)[0]
    tok = real.llm.tokenizer
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in templated
    ids = list(tok(templated, add_special_tokens=False).input_ids)
    assert out.prompt_token_ids == ids
    c = out.outputs[0]
    assert c.text.strip(), "empty answer"
    assert "Paris" in c.text
    eos = sorted(real.llm.engine.eos_token_ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        hf_out = real.hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    ref = [int(t) for t in hf_out[0, len(ids) :]]
    assert c.token_ids == ref
    assert c.finish_reason == ("stop" if ref[-1] in eos else "length")


def test_default_sidecar_exits_early_at_its_calibrated_default(real: Real) -> None:
    """``LLM("smollm2")`` without exit arguments is speculative with int8 drafts (its exit
    config's default mode and draft): full depth's tokens. Exit mode uses the packaged tuned heads
    and the threshold calibrated for delta 0.05 / epsilon 0.05; a tolerance of 0.05 (an exit
    rule, so exit mode without naming it) picks the same threshold."""
    # The policy the packaged threshold was calibrated under.
    llm = make_llm("smollm2", kv_cache_memory=64 * 2**20, exit_policy="per_sequence")
    cfg = llm.engine.exit_config
    cal = [
        c for c in cfg.calibration
        if c["delta"] == 0.05 and c["epsilon"] == 0.05 and c["measure"] == cfg.default_measure
    ]  # fmt: skip
    assert cfg.head == "tuned" and cfg.enabled_by_default and cal
    assert cfg.thresholds[cfg.default_measure] == cal[0]["threshold"]
    # Other measures are calibrated beside the default (``calibrate --keep-default``).
    beside = {c["measure"]: c["threshold"] for c in cfg.calibration}
    assert "shortlist_margin" in beside
    assert all(cfg.thresholds[m] == t for m, t in beside.items())
    assert (cfg.default_mode, llm.engine.speculative_draft) == ("speculative", "int8")
    # Held-out prompts of the kind it was calibrated on (the calibration saw ~3% of layers saved):
    # 32 tokens each, of which a few leave early.
    prompts = prompt_texts(8, seed=0, split="heldout")
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=32)
    full = llm.generate(prompts, params, use_tqdm=False, exit_params=ExitParams(enabled=False))
    default = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in full]
    drafted = {x for o in default for x in o.outputs[0].draft_layers or [] if x is not None}
    assert drafted == {30}, "the default drafts with the int8 copy"
    outs = llm.generate(prompts, params, use_tqdm=False, exit_params=ExitParams(mode="exit"))
    layers = [x for o in outs for x in o.outputs[0].exit_layers]
    assert len(layers) == len(prompts) * 32
    assert set(layers) <= {*cfg.exit_layers, 30} and min(layers) < 30, "nothing exited early"
    tol = llm.generate(prompts, params, use_tqdm=False, exit_params=ExitParams(tolerance=0.05))
    assert [o.outputs[0].token_ids for o in tol] == [o.outputs[0].token_ids for o in outs]
    # Rows that left early really skipped layers: the run's telemetry says so.
    assert all(o.outputs[0].exit_stats.layers_saved_fraction >= 0 for o in outs)
    assert any(o.outputs[0].exit_stats.layers_saved_fraction > 0 for o in outs)
