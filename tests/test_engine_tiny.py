"""The engine end to end on tiny random models, against HF transformers and against itself.

- Oracle: greedy tokens equal HF ``generate``; returned logprobs equal HF's log-softmax (1e-4), for
  a Llama, a Llama with varied output and non-unit norms, a Qwen2 with q/k/v biases and a Llama
  with an untied lm_head, batched and one prompt at a time.
- Batching invariance: a request's output does not depend on what shares its batch, when it joins,
  how many sequences may run at once, whether it is preempted, or whether its prefix was cached.
- Request life cycle: streaming through ``step``, abort, limits and invalid input.

Every engine is built with ``make_llm``: after every test an autouse fixture checks that it holds
no request and that every KV block is back in the free pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eeserve import LLM, RequestOutput, SamplingParams
from tests.tiny_model import (
    assert_same_completion,
    build_tiny_model,
    hf_greedy,
    hf_greedy_checked,
    hf_next_logprobs,
    kv_block_bytes,
    load_hf,
    logprob_error,
    make_llm,
    random_prompt,
)

N_NEW = 20
TOL = 1e-4


def tiny(folder: Path, **options: Any) -> LLM:
    """``make_llm`` with a KV pool sized for tiny models (the 512 MiB default is pointless)."""
    options.setdefault("kv_cache_memory", 16 * 2**20)
    return make_llm(folder, **options)


def greedy(max_tokens: int = N_NEW, logprobs: int | None = 5) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, logprobs=logprobs)


def vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


def run_alone(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]


# -- oracle: HF transformers ---------------------------------------------------------------


@dataclass
class Variant:
    name: str
    llm: LLM
    hf: Any
    prompts: list[str | list[int]]
    refs: list[list[int]]  # HF greedy continuation of each prompt


# "..._pytorch": the same model without the engine's CPU kernels (PyTorch ops, gathered attention).
VARIANTS = ["llama", "llama_varied", "qwen2_bias", "llama_untied", "llama_varied_pytorch"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> Variant:
    fixture = {
        "llama": "tiny_model_dir",
        "llama_varied": "tiny_varied_dir",
        "qwen2_bias": "tiny_qwen2_dir",
        "llama_untied": "tiny_untied_dir",
        "llama_varied_pytorch": "tiny_varied_dir",
    }[request.param]
    folder: Path = request.getfixturevalue(fixture)
    llm = tiny(folder, cpu_kernels=not request.param.endswith("_pytorch"))
    hf = load_hf(folder)
    v = vocab(llm)
    prompts: list[str | list[int]] = [
        "The quick brown fox",
        "def add(a, b):\n    return",
        random_prompt(1, 11, v),
        random_prompt(37, 12, v),
    ]
    # HF checks the engine's tokens as a draft (hf_greedy_checked): HF's greedy continuation
    # whatever the engine's, in one forward pass a prompt.
    drafts = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    ids = [llm.engine.tokenize(p) for p in prompts]
    refs = [hf_greedy_checked(hf, i, d, N_NEW) for i, d in zip(ids, drafts)]
    return Variant(request.param, llm, hf, prompts, refs)


def check_against_hf(v: Variant, outs: list[RequestOutput]) -> None:
    assert len(outs) == len(v.prompts)
    for prompt, ref, out in zip(v.prompts, v.refs, outs):
        ids = v.llm.engine.tokenize(prompt)
        c = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert out.finished and c.finish_reason == "length"
        assert c.token_ids == ref, f"{v.name}: greedy tokens differ from HF for {prompt!r}"
        assert c.text == v.llm.tokenizer.decode(ref, skip_special_tokens=True)
        lp_ref = hf_next_logprobs(v.hf, ids, c.token_ids)
        assert all(len(entry) == 5 for entry in c.logprobs or [])
        assert all(max(e, key=e.__getitem__) == t for e, t in zip(c.logprobs or [], ref))
        err = logprob_error(c.token_ids, c.logprobs, lp_ref)
        assert err < TOL, f"{v.name}: logprobs differ from HF by {err}"


def test_greedy_batched_matches_hf(variant: Variant) -> None:
    outs = variant.llm.generate(variant.prompts, greedy(), use_tqdm=False)
    check_against_hf(variant, outs)


def test_greedy_one_by_one_matches_hf(variant: Variant) -> None:
    outs = run_alone(variant.llm, variant.prompts, [greedy()] * len(variant.prompts))
    check_against_hf(variant, outs)


def test_varied_model_really_varies(tiny_varied_dir: Path) -> None:
    """Guards the strength of the tests below: their greedy output is not one repeated token."""
    hf = load_hf(tiny_varied_dir)
    ref = hf_greedy(hf, [5, 6, 7], N_NEW)
    assert len(set(ref)) > N_NEW // 2


# -- batching invariance -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_varied_dir: Path) -> LLM:
    return tiny(tiny_varied_dir, block_size=4)


def mixed_prompts(llm: LLM) -> list[str | list[int]]:
    v = vocab(llm)
    return [
        random_prompt(1, 1, v),
        "Paris is the capital of France",
        random_prompt(9, 2, v),
        random_prompt(23, 3, v),
        random_prompt(50, 4, v),
    ]


def test_batch_of_different_lengths_equals_each_alone(llm: LLM) -> None:
    prompts = mixed_prompts(llm)
    # Different max_tokens too, so that the batch shrinks while the others continue.
    params = [greedy(m, logprobs=3) for m in (12, 30, 5, 20, 17)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    alone = run_alone(llm, prompts, params)
    for b, a, sp in zip(batched, alone, params):
        assert len(b.outputs[0].token_ids) == sp.max_tokens
        assert_same_completion(b, a)


def test_requests_joining_midway_get_the_same_output(llm: LLM) -> None:
    prompts = mixed_prompts(llm)
    alone = run_alone(llm, prompts, [greedy(16)] * len(prompts))
    engine = llm.engine
    final: dict[str, RequestOutput] = {}
    seen: dict[str, int] = {}
    ids: list[str] = []
    step = 0
    while len(ids) < len(prompts) or engine.has_unfinished_requests():
        if len(ids) < len(prompts) and step % 3 == 0:  # a new request every third step
            ids.append(engine.add_request(prompts[len(ids)], greedy(16)))
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            assert n == seen.get(out.request_id, 0) + 1, "a step must add exactly one token"
            seen[out.request_id] = n
            assert out.request_id not in final, "output after the request finished"
            if out.finished:
                final[out.request_id] = out
            else:
                assert out.outputs[0].finish_reason is None
        step += 1
    assert sorted(final) == sorted(ids)
    for rid, a in zip(ids, alone):
        assert_same_completion(final[rid], a)


def test_max_num_seqs_bounds_the_batch(tiny_varied_dir: Path, llm: LLM) -> None:
    small = tiny(tiny_varied_dir, max_num_seqs=2)
    prompts = mixed_prompts(small)
    params = [greedy(8 + 2 * i) for i in range(len(prompts))]
    engine = small.engine
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert 1 <= len(outs) <= 2
        assert len(engine.scheduler.running) <= 2
        final.update({o.request_id: o for o in outs if o.finished})
    alone = run_alone(llm, prompts, params)
    for rid, a in zip(rids, alone):
        assert_same_completion(final[rid], a)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_gives_the_same_output(
    tiny_varied_dir: Path, llm: LLM, prefix_caching: bool
) -> None:
    num_blocks = 12  # 48 tokens: one request fits, four at once do not
    small = make_llm(
        tiny_varied_dir,
        block_size=4,
        kv_cache_memory=num_blocks * kv_block_bytes(llm, 4),
        enable_prefix_caching=prefix_caching,
    )
    assert small.engine.block_manager.num_blocks == num_blocks
    v = vocab(llm)
    prompts = [random_prompt(6 + i, 20 + i, v) for i in range(4)]
    params = [
        greedy(24),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
        greedy(22),
        SamplingParams(temperature=1.0, top_k=20, seed=8, max_tokens=24, ignore_eos=True),
    ]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    roomy = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions == 0
    for o, r in zip(outs, roomy):
        assert o.finished
        assert_same_completion(o, r)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_request_finds_its_own_blocks_again(
    tiny_varied_dir: Path, llm: LLM, prefix_caching: bool
) -> None:
    """Two requests of 4 + 20 tokens in 10 blocks of 4: when both reach 21 tokens the second is
    preempted (its 5 blocks freed, the first takes the last of them) and resumes after the first
    finishes. Its first 4 blocks, 3 of them holding generated tokens, are still cached then."""
    small = make_llm(
        tiny_varied_dir,
        block_size=4,
        kv_cache_memory=10 * kv_block_bytes(llm, 4),
        enable_prefix_caching=prefix_caching,
    )
    prompts = [random_prompt(4, 70 + i, vocab(llm)) for i in range(2)]
    outs = small.generate(prompts, greedy(20), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions == 1
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == (16 if prefix_caching else 0)
    for o, r in zip(outs, llm.generate(prompts, greedy(20), use_tqdm=False)):
        assert_same_completion(o, r)


def test_prefix_caching_reuses_blocks_and_keeps_output(tiny_varied_dir: Path, llm: LLM) -> None:
    v = vocab(llm)
    prefix = random_prompt(30, 30, v)  # 7 full blocks of 4, then 2 tokens
    prompts = [prefix + random_prompt(5, 31 + i, v) for i in range(3)]
    results: dict[bool, list[RequestOutput]] = {}
    engines: dict[bool, LLM] = {}
    for on in (True, False):
        engines[on] = tiny(tiny_varied_dir, block_size=4, enable_prefix_caching=on)
        first = engines[on].generate(prompts[0], greedy(), use_tqdm=False)
        rest = engines[on].generate([*prompts[1:], prompts[0]], greedy(), use_tqdm=False)
        results[on] = [*first, *rest]
    hits_on = engines[True].engine.block_manager.prefix_hit_blocks
    assert hits_on > 0
    assert engines[False].engine.block_manager.prefix_hit_blocks == 0
    assert all(o.num_cached_tokens == 0 for o in results[False])
    cached = [o.num_cached_tokens for o in results[True]]
    # The first request found nothing; the next two share the 7 full prefix blocks; the repeat of
    # the first finds every full block before its last prompt token.
    assert cached == [0, 28, 28, 4 * ((len(prompts[0]) - 1) // 4)]
    for a, b in zip(results[True], results[False]):
        assert_same_completion(a, b)


def test_shared_prefix_blocks_are_shared_while_running(llm: LLM) -> None:
    engine = llm.engine
    v = vocab(llm)
    prefix = random_prompt(17, 40, v)  # 4 full blocks of 4
    engine.add_request([*prefix, 5], greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    hits_before = engine.block_manager.prefix_hit_blocks
    rids = [engine.add_request([*prefix, 6 + i], greedy(4)) for i in range(3)]
    engine.step()  # the prefill pass
    running = {s.request_id: s for s in engine.scheduler.running}
    tables = [running[r].block_table for r in rids]
    shared = tables[0][:4]
    assert all(t[:4] == shared for t in tables)
    assert [engine.block_manager.blocks[b].ref_count for b in shared] == [3, 3, 3, 3]
    tails = [t[4] for t in tables]
    assert len(set(tails)) == 3
    assert engine.block_manager.prefix_hit_blocks == hits_before + 12
    while engine.has_unfinished_requests():
        engine.step()


# -- request life cycle --------------------------------------------------------------------


def test_streamed_outputs_grow_and_end_like_generate(llm: LLM) -> None:
    prompt = "Paris is the capital"
    expected = llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    engine = llm.engine
    rid = engine.add_request(prompt, greedy(12), request_id="stream-1")
    assert rid == "stream-1"
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 13))
    assert [o.finished for o in outs] == [False] * 11 + [True]
    for o in outs[:-1]:
        assert (
            expected.outputs[0].token_ids[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
        )
    assert_same_completion(outs[-1], expected)


def test_abort_frees_blocks_and_leaves_the_others_intact(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    prompts = mixed_prompts(llm)[2:]
    alone = run_alone(llm, prompts, [greedy(16)] * 3)
    rids = [engine.add_request(p, greedy(16)) for p in prompts]
    for _ in range(4):
        engine.step()
    free_before = bm.num_free_blocks
    engine.abort_request(rids[1])
    assert bm.num_free_blocks > free_before
    assert rids[1] not in {s.request_id for s in engine.scheduler.running}
    engine.abort_request(rids[1])  # twice: no effect
    engine.abort_request("no-such-request")
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != rids[1]
            if out.finished:
                final[out.request_id] = out
    assert sorted(final) == sorted([rids[0], rids[2]])
    assert_same_completion(final[rids[0]], alone[0])
    assert_same_completion(final[rids[2]], alone[2])
    engine.abort_request(rids[0])  # finished: no effect


def test_abort_of_a_waiting_request(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request("The quick", greedy(4))
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_request_ids_must_be_unique(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("The quick", greedy(3), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("The lazy", greedy(3), request_id="dup")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("The lazy", greedy(3), request_id="dup")  # free again once finished
    while engine.has_unfinished_requests():
        engine.step()


def test_request_that_can_never_fit_the_model_length_is_refused(tiny_varied_dir: Path) -> None:
    short = tiny(tiny_varied_dir, max_model_len=64)
    assert short.engine.max_model_len == 64
    prompt = random_prompt(10, 50, vocab(short))
    with pytest.raises(ValueError, match=r"10 tokens.*max_tokens \(60\).*70.*64"):
        short.generate(prompt, greedy(60), use_tqdm=False)
    # Exactly at the limit is fine and stops by length.
    out = short.generate(prompt, greedy(54), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"
    # A bad request in a batch leaves nothing queued; the engine keeps working.
    with pytest.raises(ValueError, match="maximum model length 64"):
        short.generate([prompt, prompt], [greedy(8), greedy(60)], use_tqdm=False)
    assert not short.engine.has_unfinished_requests()
    again = short.generate(prompt, greedy(8), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids[:8]


def test_request_that_can_never_fit_the_kv_pool_is_refused(tiny_varied_dir: Path, llm: LLM) -> None:
    tiny_pool = make_llm(tiny_varied_dir, block_size=4, kv_cache_memory=5 * kv_block_bytes(llm, 4))
    assert tiny_pool.engine.max_model_len == 20
    prompt = random_prompt(8, 51, vocab(llm))
    with pytest.raises(ValueError, match="KV pool 20 tokens"):
        tiny_pool.generate(prompt, greedy(13), use_tqdm=False)
    out = tiny_pool.generate(prompt, greedy(12), use_tqdm=False)[0]
    assert_same_completion(out, llm.generate(prompt, greedy(12), use_tqdm=False)[0])


def test_kv_pool_too_small_for_one_block_is_refused(tiny_varied_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tiny_varied_dir), kv_cache_memory=100)


@pytest.mark.parametrize(
    "bad",
    [[], [-1], [320], [1, 2, 10**9], [1.5], [True, 3], ["a"], [None]],
    ids=["empty", "negative", "vocab", "huge", "float", "bool", "str", "none"],
)
def test_invalid_prompt_token_ids_are_refused(llm: LLM, bad: list[Any]) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([bad], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.engine.add_request(bad, greedy(2))
    with pytest.raises(ValueError, match="prompt"):
        llm.engine.add_request("ignored", greedy(2), prompt_token_ids=bad)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[3, 4, 5]], greedy(2), use_tqdm=False)  # still working
    assert len(out[0].outputs[0].token_ids) == 2


def test_empty_text_prompt_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(2), use_tqdm=False)


def test_generate_keeps_input_order_and_accepts_every_prompt_form(llm: LLM) -> None:
    ids = llm.engine.tokenize("The quick brown fox")
    one = llm.generate(ids, greedy(4), use_tqdm=False)  # a single list of ids is one prompt
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    text = llm.generate("The quick brown fox", greedy(4), use_tqdm=False)
    assert_same_completion(text[0], one[0])
    assert text[0].prompt == "The quick brown fox" and one[0].prompt is None
    prompts: list[str | list[int]] = [ids, "Paris", [7], "def add"]
    outs = llm.generate(prompts, [greedy(2 + i) for i in range(4)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3, 4, 5]
    assert [o.prompt_token_ids for o in outs] == [llm.engine.tokenize(p) for p in prompts]
    assert llm.generate([], greedy(2), use_tqdm=False) == []
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(prompts, [greedy(2)] * 3, use_tqdm=False)


def test_eos_from_the_model_config_stops_unless_ignored(tmp_path: Path, llm: LLM) -> None:
    prompt = [5, 6, 7]
    tokens = llm.generate(prompt, greedy(24, None), use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[6]
    first = tokens.index(eos)
    # Same seed and shapes: same weights, only the configured EOS differs.
    folder = build_tiny_model(tmp_path / "eos", weight_std=0.2, norm_noise=0.1, eos_token_id=eos)
    with_eos = tiny(folder)
    stopped = with_eos.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
    )[0]
    c = stopped.outputs[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == tokens[: first + 1]
    assert c.text == llm.tokenizer.decode(tokens[:first], skip_special_tokens=True)
    ignored = with_eos.generate(prompt, greedy(24, None), use_tqdm=False)[0]
    assert ignored.outputs[0].token_ids == tokens
    assert ignored.outputs[0].finish_reason == "length"


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    out = llm.chat(messages, greedy(6), use_tqdm=False)
    text = "<|im_start|>user\nParis is the capital of<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.engine.tokenize(text)
    assert out[0].prompt_token_ids == ids
    assert_same_completion(out[0], llm.generate([ids], greedy(6), use_tqdm=False)[0])
    two = llm.chat([messages, [{"role": "user", "content": "def"}]], greedy(3), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids[:3]
