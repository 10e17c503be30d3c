"""SamplingParams validation, the Sampler on hand-made logits, and sampling/stopping end to end.

Engine-level tests run on the tiny Llama with varied output (see conftest.py); each engine is
checked for leaked requests and blocks after every test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eeserve import LLM, RequestOutput, SamplingParams
from eeserve.engine.sampler import Sampler, greedy_tokens
from tests.tiny_model import make_llm, random_prompt

# -- SamplingParams ------------------------------------------------------------------------

BAD_PARAMS: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "0.7"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", float("nan")),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", None),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop", [None]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("stop_token_ids", "ab"),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 2.0),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_invalid_sampling_params_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_valid_sampling_params_are_normalised() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]
    for ok in (
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(max_tokens=1),
        dict(temperature=2),
        dict(seed=0),
        dict(seed=-3),
        dict(seed=2**64 - 1),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(ignore_eos=True),
    ):
        SamplingParams(**ok)  # type: ignore[arg-type]


# -- Sampler on hand-made logits -----------------------------------------------------------


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def support(row: torch.Tensor) -> set[int]:
    return {int(i) for i in torch.nonzero(row > 0).flatten()}


P4 = [0.5, 0.25, 0.15, 0.1]  # already sorted, for readable expectations


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    for t in (0.5, 1.0, 2.0):
        got = Sampler.probabilities(logits, [sp(temperature=t)])
        torch.testing.assert_close(got, (logits / t).softmax(-1))


@pytest.mark.parametrize(("k", "expected"), [(1, {0}), (2, {0, 1}), (3, {0, 1, 2})])
def test_top_k_keeps_the_k_most_likely(k: int, expected: set[int]) -> None:
    # Shuffled so that the kept ids are not simply a prefix.
    order = [2, 0, 3, 1]
    probs = [P4[order.index(i)] for i in range(4)]
    got = Sampler.probabilities(logits_of(probs), [sp(top_k=k)])[0]
    assert support(got) == {order[i] for i in expected}
    kept = torch.tensor(probs)[sorted(support(got))]
    torch.testing.assert_close(got[sorted(support(got))], kept / kept.sum())
    assert abs(float(got.sum()) - 1) < 1e-6


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_top_k_off_or_above_vocab_keeps_everything(k: int) -> None:
    got = Sampler.probabilities(logits_of(P4), [sp(top_k=k)])[0]
    torch.testing.assert_close(got, torch.tensor(P4))


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (1e-6, {0}),
        (0.4, {0}),
        (0.6, {0, 1}),
        (0.74, {0, 1}),
        (0.76, {0, 1, 2}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, expected: set[int]) -> None:
    got = Sampler.probabilities(logits_of(P4), [sp(top_p=p)])[0]
    assert support(got) == expected
    kept = torch.tensor(P4)[sorted(expected)]
    torch.testing.assert_close(got[sorted(expected)], kept / kept.sum())


def test_top_k_applies_before_top_p() -> None:
    # After top-k 3 the renormalised masses are .556, .278, .167: top-p .8 is reached by two.
    got = Sampler.probabilities(logits_of(P4), [sp(top_k=3, top_p=0.8)])[0]
    assert support(got) == {0, 1}
    # Top-p alone on the original distribution needs three tokens for .8.
    assert support(Sampler.probabilities(logits_of(P4), [sp(top_p=0.8)])[0]) == {0, 1, 2}


def test_each_row_uses_its_own_parameters() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    params = [sp(top_k=3), sp(top_p=0.5, temperature=0.7), sp(), sp(top_k=5, top_p=0.9)]
    together = Sampler.probabilities(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(
            together[i : i + 1], Sampler.probabilities(logits[i : i + 1], [p])
        )
    assert len(support(together[0])) == 3
    assert len(support(together[2])) == 50


def test_greedy_rows_take_the_argmax_whatever_shares_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=gen)
    before = logits.clone()
    params = [sp(temperature=0), sp(temperature=1.0, seed=3), sp(temperature=0, top_k=7)]
    tokens = Sampler().sample(logits, params, [0, 1, 2])
    assert tokens.shape == (3,)
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())
    assert torch.equal(logits, before), "sample must not modify the logits"


def test_top_k_1_sampling_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 64, generator=gen)
    params = [sp(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    tokens = Sampler().sample(logits, params, list(range(8)))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_samples_stay_in_the_support_and_follow_the_distribution() -> None:
    probs = [0.05, 0.4, 0.05, 0.3, 0.2]
    logits = logits_of(probs)
    sampler = Sampler()
    for params, allowed in (
        (sp(top_k=2, seed=5), {1, 3}),
        (sp(top_p=0.65, seed=6), {1, 3}),
        (sp(top_k=3, top_p=0.99, seed=7), {1, 3, 4}),
    ):
        draws = [int(sampler.sample(logits, [params], [99])[0]) for _ in range(300)]
        sampler.release(99)
        assert set(draws) == allowed, params
    # Frequencies of an untruncated draw match the probabilities (fixed seed: deterministic).
    draws = [int(sampler.sample(logits, [sp(seed=11)], [5])[0]) for _ in range(4000)]
    sampler.release(5)
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor(probs), atol=0.025, rtol=0)


def test_seeded_draws_are_reproducible_per_sequence() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 100, generator=gen)

    def stream(sampler: Sampler, seq_id: int, seed: int, n: int = 20) -> list[int]:
        return [int(sampler.sample(logits, [sp(seed=seed)], [seq_id])[0]) for _ in range(n)]

    a = Sampler()
    first = stream(a, 1, seed=42)
    assert len(set(first)) > 1, "a seeded stream continues, it does not repeat its first draw"
    assert stream(Sampler(), 7, seed=42) == first  # another sampler, another id: same stream
    assert stream(Sampler(), 1, seed=43) != first
    # Interleaving another sequence does not disturb the stream.
    b = Sampler()
    mixed = []
    for _ in range(20):
        both = torch.cat([logits, logits])
        out = b.sample(both, [sp(seed=42), sp(seed=1000)], [1, 2])
        mixed.append(int(out[0]))
    assert mixed == first
    a.release(1)
    assert stream(a, 1, seed=42) == first  # released: a new request with that id starts afresh


# -- sampling and stopping end to end ------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_varied_dir: Path) -> LLM:
    return make_llm(tiny_varied_dir, kv_cache_memory=16 * 2**20)


def greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def completion(llm: LLM, prompt: Any, params: SamplingParams) -> RequestOutput:
    return llm.generate([prompt], params, use_tqdm=False)[0]


PROMPTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):\n    return a + b\n"]


def test_same_seed_same_text_even_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = completion(llm, PROMPTS[0], seeded)
    again = completion(llm, PROMPTS[0], seeded)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),  # unseeded
        SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
        greedy(20),
    ]
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]],
        [others[0], seeded, *others[1:]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[1].outputs[0].text == alone.outputs[0].text
    other_seed = SamplingParams(
        temperature=0.8, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True
    )
    assert (
        completion(llm, PROMPTS[0], other_seed).outputs[0].token_ids != alone.outputs[0].token_ids
    )
    # Sampling is really happening: it is not the greedy output.
    assert completion(llm, PROMPTS[0], greedy()).outputs[0].token_ids != alone.outputs[0].token_ids


def test_same_seed_for_two_requests_in_one_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    a, b = llm.generate([PROMPTS[2], PROMPTS[2]], seeded, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    for prompt in PROMPTS:
        ref = completion(llm, prompt, greedy()).outputs[0].token_ids
        k1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=24, ignore_eos=True)
        p0 = SamplingParams(temperature=1.3, top_p=1e-6, seed=3, max_tokens=24, ignore_eos=True)
        assert completion(llm, prompt, k1).outputs[0].token_ids == ref
        assert completion(llm, prompt, p0).outputs[0].token_ids == ref


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    for n in (1, 2, 7):
        out = completion(llm, PROMPTS[1], greedy(n))
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == n


def test_logprobs_count_and_absence(llm: LLM) -> None:
    out = completion(llm, PROMPTS[0], greedy(6, logprobs=3)).outputs[0]
    assert out.logprobs is not None and [len(e) for e in out.logprobs] == [3] * 6
    assert all(v <= 0 for e in out.logprobs for v in e.values())
    assert completion(llm, PROMPTS[0], greedy(6)).outputs[0].logprobs is None


def test_logprobs_include_the_sampled_token(llm: LLM) -> None:
    params = SamplingParams(temperature=3.0, seed=8, max_tokens=24, ignore_eos=True, logprobs=2)
    out = completion(llm, PROMPTS[1], params).outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 24
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry
        assert len(entry) == (2 if tok in sorted(entry, key=entry.__getitem__)[-2:] else 3)
    assert any(len(e) == 3 for e in out.logprobs), "at temperature 3 some draw leaves the top 2"


def full_text(llm: LLM, prompt: Any, n: int = 40) -> tuple[list[int], str]:
    out = completion(llm, prompt, greedy(n)).outputs[0]
    return out.token_ids, out.text


def decode(llm: LLM, ids: list[int]) -> str:
    return str(llm.tokenizer.decode(ids, skip_special_tokens=True))


def check_stopped_at(llm: LLM, prompt: Any, stop: list[str], tokens: list[int], text: str) -> None:
    """Generation with ``stop`` ends at the first occurrence of any of them, text cut before it."""
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    out = completion(llm, prompt, greedy(len(tokens), stop=stop)).outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    n = len(out.token_ids)
    assert out.token_ids == tokens[:n], "stopping must not change the tokens before it"
    # It stopped at the token that completed the stop string, not later.
    assert any(s in decode(llm, tokens[:n])[cut:] for s in stop)
    assert not any(s in decode(llm, tokens[: n - 1]) for s in stop)


def printable_window(text: str, start: int, width: int) -> str:
    for i in range(start, len(text) - width):
        w = text[i : i + width]
        if w.isascii() and w.isprintable() and text.find(w) == i:
            return w
    raise AssertionError(f"no printable window in {text!r}")


def test_stop_string_cuts_the_text_exactly(llm: LLM) -> None:
    for prompt in PROMPTS:
        tokens, text = full_text(llm, prompt)
        stop = printable_window(text, 6, 2)
        check_stopped_at(llm, prompt, [stop], tokens, text)


def test_earliest_of_several_stop_strings_wins(llm: LLM) -> None:
    tokens, text = full_text(llm, PROMPTS[0])
    early = printable_window(text, 4, 2)
    late = printable_window(text, text.find(early) + 6, 3)
    check_stopped_at(llm, PROMPTS[0], [late, early], tokens, text)


def test_stop_string_that_never_appears_does_not_stop(llm: LLM) -> None:
    tokens, text = full_text(llm, PROMPTS[1], 20)
    never = "§never§"
    assert never not in text
    out = completion(llm, PROMPTS[1], greedy(20, stop=[never])).outputs[0]
    assert out.finish_reason == "length" and out.token_ids == tokens and out.text == text


def test_stop_string_completed_by_a_later_byte_token(llm: LLM) -> None:
    """A multi-byte character split over tokens decodes to U+FFFD until its last byte arrives; a
    stop string ending in it must still be found then."""
    for prompt in [*PROMPTS, "Early exit", "one two", "capital of"]:
        tokens, text = full_text(llm, prompt)
        for j in range(1, len(tokens)):
            before, after = decode(llm, tokens[:j]), decode(llm, tokens[: j + 1])
            if not before.endswith("\ufffd") or len(after) != len(before):
                continue
            ch = after[-1]
            if ch != "\ufffd" and not ch.isascii() and text.find(ch) == len(after) - 1:
                check_stopped_at(llm, prompt, [ch], tokens, text)
                return
    raise AssertionError("no split multi-byte character in the sample outputs")


def test_stop_token_ids_stop_and_are_left_out_of_the_text(llm: LLM) -> None:
    tokens, _ = full_text(llm, PROMPTS[2], 24)
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = completion(llm, PROMPTS[2], greedy(24, stop_token_ids=[stop_id])).outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: first + 1]
    assert out.text == decode(llm, tokens[:first])
    # Never-generated stop ids change nothing.
    unused = next(t for t in range(3, 320) if t not in tokens)
    out = completion(llm, PROMPTS[2], greedy(24, stop_token_ids=[unused])).outputs[0]
    assert out.finish_reason == "length" and out.token_ids == tokens


def test_sampled_requests_stop_too(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=21, max_tokens=30, ignore_eos=True)
    tokens = completion(llm, PROMPTS[0], seeded).outputs[0].token_ids
    stop_id = tokens[4]
    params = SamplingParams(
        temperature=1.0, seed=21, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]
    )
    out = completion(llm, PROMPTS[0], params).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(stop_id) + 1]


def test_random_prompts_sample_without_error(llm: LLM) -> None:
    prompts = [random_prompt(n, n, 320) for n in (1, 2, 3, 30)]
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=8, ignore_eos=True)
        for t, k, p in ((0.1, 0, 1.0), (5.0, 0, 1.0), (1.0, 319, 0.5), (1.0, 1000, 0.999))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 8
        assert all(0 <= t < 320 for t in o.outputs[0].token_ids)


@pytest.mark.parametrize("vocab", [1000, 16 * 1024, 40 * 1024 + 300, 262144])
def test_greedy_tokens_are_argmax_with_ties_tails_and_nans(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    x[1, 5000 % vocab] = x[1, vocab - 1] = 50.0  # a tie: the first index wins
    x[2, -1] = 60.0  # the maximum in the last ids (past the last whole chunk of 1,024)
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 17] = float("nan")  # a NaN is argmax's maximum
    x[5, 3] = x[5, 2000 % vocab] = float("inf")
    x[6, :] = 0.0  # all equal
    assert torch.equal(greedy_tokens(x), x.argmax(-1))
    assert torch.equal(greedy_tokens(x[:, : vocab - 1]), x[:, : vocab - 1].argmax(-1))  # strided
