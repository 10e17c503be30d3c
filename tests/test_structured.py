"""Structured outputs: every token chosen under a grammar is one it allows (full depth, exits,
drafts), forced tokens run no pass of their own, and speculative output equals constrained full
depth. Tiny random models: their text is nonsense, but it must have the constraint's shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from eeserve import LLM, SamplingParams, StructuredOutputsParams
from eeserve.engine.grammar import GrammarCompiler, draft_masks
from eeserve.exit_params import ExitParams
from tests.tiny_model import (
    build_agreeing_model,
    make_llm,
    run_together,
    with_random_tuned_heads,
)

L = 4
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "One two three"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "pet": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
    },
    "required": ["name", "age", "color", "pet"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes please", "no thanks", "maybe"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "regex": StructuredOutputsParams(regex=REGEX),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "none"'),
}
SPEC = ExitParams(mode="speculative", threshold=0.3, exit_layers=[1, 2, 3], num_draft_tokens=4)
EXIT = ExitParams(mode="exit", threshold=0.0, exit_layers=[2, 3])


def satisfies(name: str, text: str) -> bool:
    if name == "json":
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if name == "choice":
        return text in CHOICES
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    return re.fullmatch(r"\([a-c]+\)|none", text) is not None


def params(name: str, temperature: float = 0.0, **kw: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=80, temperature=temperature, seed=7, structured_outputs=CONSTRAINTS[name], **kw
    )


@pytest.fixture(scope="module")
def agreeing_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose last layer barely changes the hidden state, with tuned heads at 1-3:
    drafts at the exits are both accepted and rejected."""
    folder = build_agreeing_model(tmp_path_factory.mktemp("structured") / "agree", L)
    return with_random_tuned_heads(folder, folder.parent / "tuned", [1, 2, 3], 5)


def _texts(llm: LLM, name: str, exits: ExitParams | None = None, **kw: object) -> list[str]:
    outs = run_together(llm, PROMPTS, params(name, **kw), [exits] * len(PROMPTS))
    return [c.text for c in outs]


def _tokens(llm: LLM, name: str, exits: ExitParams | None = None) -> list[list[int]]:
    outs = run_together(llm, PROMPTS, params(name), [exits] * len(PROMPTS))
    return [c.token_ids for c in outs]


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_output_has_the_constraints_shape(tiny_varied_dir: Path, name: str) -> None:
    llm = make_llm(tiny_varied_dir)
    for temperature in (0.0, 1.0):
        for text in _texts(llm, name, temperature=temperature):
            assert satisfies(name, text), text


def test_ten_schemas_hold_under_sampling(tiny_varied_dir: Path) -> None:
    llm = make_llm(tiny_varied_dir)
    for schema in SCHEMAS:
        sp = SamplingParams(
            max_tokens=200,
            temperature=1.0,
            seed=1,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for out in llm.generate(PROMPTS, sp, use_tqdm=False):
            c = out.outputs[0]
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
            else:  # out of tokens inside the grammar: OpenAI's "length"
                assert c.finish_reason == "length" and len(c.token_ids) == 200


SCHEMAS: list[dict] = [
    PERSON,
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3},
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"k": {"type": "string", "maxLength": 3}},
                "required": ["k"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 2}]},
    {
        "type": "object",
        "properties": {"v": {"type": ["string", "null"], "maxLength": 3}},
        "required": ["v"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[A-Z][a-z]{1,3}$"},
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "kind": {"const": "item"}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"n": {"type": "integer", "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
]


def test_constrained_full_depth_is_the_same_with_and_without_jump_forward(
    tiny_varied_dir: Path,
) -> None:
    plain = make_llm(tiny_varied_dir, exit_policy="none", jump_forward=False)
    jump = make_llm(tiny_varied_dir, exit_policy="none")
    for name in CONSTRAINTS:
        assert _tokens(jump, name) == _tokens(plain, name), name


def test_the_screened_head_picks_the_allowed_maximum(tiny_varied_dir: Path) -> None:
    """Greedy constrained rows read the screened head's logits at the tiles that can hold the
    maximum over their allowed tokens (``kernels.screened_head``): the tokens are the full
    head's."""
    screened = make_llm(tiny_varied_dir, exit_policy="none", jump_forward=False)
    full = make_llm(tiny_varied_dir, exit_policy="none", jump_forward=False, screen_head=False)
    for name in CONSTRAINTS:
        assert _tokens(screened, name) == _tokens(full, name), name


def test_forced_tokens_run_no_pass(tiny_model_dir: Path) -> None:
    """One choice: every token is forced. The prompt's pass samples the first (the only one
    allowed); the rest and the end of sequence follow without a pass."""
    llm = make_llm(tiny_model_dir, exit_policy="none")
    only = "one single long answer"
    sp = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(choice=[only]))
    out = llm.generate(["Say it"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == only and out.finish_reason == "stop"
    assert llm.engine.stats.passes == 1
    assert out.forced == [False] + [True] * (len(out.token_ids) - 1)
    assert out.exit_stats is not None and out.exit_stats.num_forced == len(out.token_ids) - 1


@pytest.mark.parametrize("draft", ["exits", "int8"])
def test_speculative_equals_constrained_full_depth(agreeing_dir: Path, draft: str) -> None:
    """Drafts under the mask, verification under the mask at every drafted position, the
    grammar rolled back past rejected drafts, the screened LM head read at the maximum over
    each position's allowed tokens: the tokens are constrained full depth's (full LM head)."""
    full = make_llm(agreeing_dir, exit_policy="none", screen_head=False)
    spec = make_llm(agreeing_dir, exit_policy="per_sequence", speculative_draft=draft)
    drafted = accepted = 0
    for name in CONSTRAINTS:
        outs = run_together(spec, PROMPTS, params(name), [SPEC] * len(PROMPTS))
        assert [c.token_ids for c in outs] == _tokens(full, name), name
        for c in outs:
            assert c.exit_stats is not None and c.exit_stats.num_drafted is not None
            drafted += c.exit_stats.num_drafted
            accepted += c.exit_stats.num_accepted or 0
    assert 0 < accepted < drafted  # some drafts were rejected: the grammar was rolled back


@pytest.mark.parametrize("policy", ["per_sequence", "batch_all", "auto"])
def test_exited_tokens_are_allowed(agreeing_dir: Path, policy: str) -> None:
    llm = make_llm(agreeing_dir, exit_policy=policy)
    layers = []
    for name in CONSTRAINTS:
        outs = run_together(llm, PROMPTS, params(name, temperature=1.0), [EXIT] * len(PROMPTS))
        for c in outs:
            assert satisfies(name, c.text), (name, c.text)
        layers += [e for c in outs for e, f in zip(c.exit_layers, c.forced) if not f]
    assert min(layers) < L  # some tokens left at an exit


def test_a_small_cache_preempts_and_keeps_the_tokens(agreeing_dir: Path) -> None:
    roomy = make_llm(agreeing_dir, exit_policy="none")
    tight = make_llm(agreeing_dir, exit_policy="per_sequence", kv_cache_memory=150_000)
    want = _tokens(roomy, "json")
    assert _tokens(tight, "json", SPEC) == want
    assert tight.engine.scheduler.num_preemptions > 0


def test_length_inside_the_grammar(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    sp = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=PERSON))
    c = llm.generate(["x"], sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (dict(json={"type": "objekt"}), "structured_outputs.json"),
        (dict(regex="[a-"), "structured_outputs.regex"),
        (dict(grammar="start: foo"), "structured_outputs.grammar"),
        (dict(grammar="root ::= missing"), "structured_outputs.grammar"),
    ],
)
def test_a_rejected_constraint_names_its_field(
    tiny_model_dir: Path, constraint: dict, field: str
) -> None:
    llm = make_llm(tiny_model_dir)
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], sp, use_tqdm=False)
    ok = SamplingParams(max_tokens=16, structured_outputs=CONSTRAINTS["choice"])
    assert llm.generate(["x"], ok, use_tqdm=False)[0].outputs[0].text in CHOICES


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json": PERSON, "regex": "a"},
        {"choice": []},
        {"choice": [""]},
        {"json": "{"},
        {"regex": ""},
        {"json": [1]},
    ],
)
def test_malformed_params_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"StructuredOutputsParams|structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_ignore_eos_cannot_outlive_the_grammar() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=CONSTRAINTS["choice"])


def test_exits_are_judged_over_the_allowed_tokens(agreeing_dir: Path) -> None:
    """Without jump-forward, a forced token is the model's to choose, among one allowed token:
    its confidence over the allowed tokens is 1, so it leaves at the first exit whatever the
    threshold; the same threshold lets no free-text token out."""
    llm = make_llm(agreeing_dir, exit_policy="per_sequence", jump_forward=False)
    strict = ExitParams(mode="exit", threshold=0.999, measure="max_prob", exit_layers=[2, 3])
    only = "one single long answer"
    sp = SamplingParams(max_tokens=32, structured_outputs=StructuredOutputsParams(choice=[only]))
    (c,) = run_together(llm, ["Say it"], sp, [strict])
    assert c.text == only
    assert c.exit_layers[1:] == [2] * (len(c.token_ids) - 1)  # every decode token: exit 2
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    (f,) = run_together(llm, ["Say it"], free, [strict])
    assert set(f.exit_layers) == {L}


def test_the_matchers_masks_follow_rollbacks_onto_another_branch(tiny_model_dir: Path) -> None:
    """Masks are kept per position along the accepted tokens: after a rollback and another
    token, each position's mask is that of a matcher that took the new tokens from the start."""
    llm = make_llm(tiny_model_dir)
    compiler = GrammarCompiler(llm.tokenizer, vocab_size=320, eos=llm.engine.grammars.eos_token_id)
    grammar = compiler.compile(StructuredOutputsParams(regex="a[0-9]x|b[x-z][0-9]"))
    tok = {c: llm.tokenizer.convert_tokens_to_ids(c) for c in "ab1xy"}
    assert len(set(tok.values())) == 5  # each character a token of its own

    def fresh(tokens: list[int]) -> torch.Tensor:
        m = grammar.matcher()
        m.accept(tokens)
        return m.allowed().clone()

    m = grammar.matcher()
    m.accept([tok["a"], tok["1"]])
    assert torch.equal(m.allowed(), fresh([tok["a"], tok["1"]]))
    m.rollback(2)
    m.accept([tok["b"]])
    assert torch.equal(m.allowed(), fresh([tok["b"]]))
    assert not torch.equal(m.allowed(), fresh([tok["a"]]))
    m.accept([tok["y"]])
    masks = draft_masks(m, [tok["b"], tok["y"]])  # as a verification of two drafts reads them
    want = [fresh([]), fresh([tok["b"]]), fresh([tok["b"], tok["y"]])]
    assert all(torch.equal(a, b) for a, b in zip(masks, want))
    assert torch.equal(m.allowed(), want[-1])  # still after both drafts
