"""Tool calls over HTTP: ``tools`` and ``tool_choice`` (``none``, ``auto``, ``required``, a named
function) driven by the official ``openai`` client against a live server with a tiny random model
whose chat template knows no tools (so the server describes them in a system message). Every call
names an offered function with arguments that satisfy its schema; a round trip sends the result
back; streamed calls concatenate to the whole response's; bad shapes are 400s naming the field.
The reading of outputs, the prompts and the ``auto`` grammar are also checked without a server."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import llguidance
import llguidance.hf
import pytest

from eeserve.server.protocol import ChatCompletionRequest
from eeserve.server.tool_output import ToolStream, split_output, tool_message
from eeserve.server.tools import output_constraint, prompt_messages, template_takes_tools
from tests.live_server import Server, api_client
from tests.tiny_model import build_tiny_model, build_tokenizer

openai = pytest.importorskip("openai")

API_KEY = "tool-key"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": {**WEATHER, "additionalProperties": False}, "get_time": CLOCK}
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Room for the tools' description: the tiny tokenizer spends about a token a character.
    model = build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "tools", weight_std=0.2, norm_noise=0.1, max_pos=2048
    )
    srv = Server(
        model, "--api-key", API_KEY, "--max-model-len", "2048", "--served-model-name", "tiny"
    )
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with api_client(server, API_KEY, timeout=120) as c:
        yield c


def _check_calls(calls: list[Any], names: set[str]) -> None:
    """Every call names one of ``names`` and has JSON arguments satisfying its schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_round_trip_with_the_openai_client(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, set(SCHEMAS))
    call = choice.message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true, "value": 21}'}
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True), result]
    again = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=24, temperature=0.0
    )
    answer = again.choices[0]
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The call and its result are part of the prompt.
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + len(call.function.arguments)


def test_named_function_is_the_one_called(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=300,
        temperature=1.0,
        seed=1,
        n=3,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # a named function is called once
        _check_calls(choice.message.tool_calls, {"get_time"})
    assert r.model_extra["early_exit"]["num_forced"] > 0  # the call's frame is forced


def test_required_allows_several_calls_in_a_turn(client: Any) -> None:
    counts = []
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls"
        if calls:
            _check_calls(calls, set(SCHEMAS))
        counts.append(len(choice.message.tool_calls))
    assert min(counts) >= 1


def test_auto_answers_in_text_or_with_a_valid_call(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=48,
        temperature=1.0,
        seed=7,
        n=6,
    )
    for choice in r.choices:
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls, set(SCHEMAS))
        else:
            assert isinstance(choice.message.content, str)
            assert choice.finish_reason in ("stop", "length")


def test_none_ignores_the_tools(client: Any) -> None:
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.0
    )
    none = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=16,
        temperature=0.0,
    )
    auto = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=1, temperature=0.0
    )
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are described


def test_streamed_calls_match_the_whole_response(client: Any) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [ch for ch in client.chat.completions.create(stream=True, **kwargs) if ch.choices]
    parts = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert len(parts) >= 2  # the name first, then the arguments as they are generated
    first = parts[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in parts[1:])
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert arguments == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"guided_regex": "[a-z]+"}, "tool_choice"),  # tools with auto (the default) constrain
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ]
    + [
        (
            {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": p}}]},
            "tools.1.function.parameters",
        )
        for p in ({"type": "objekt"}, {"type": "object", "properties": {"a": {"$ref": "#/x"}}})
    ]
    + [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{x"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    http: httpx.Client, extra: dict, param: str
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_choice_none_leaves_other_constraints_alone(http: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "none",
        "guided_choice": ["yes", "no"],
        "max_tokens": 8,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


# -- without a server -----------------------------------------------------------------------------

CALL = (
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc", "n": [1, "}"]}}\n</tool_call>'
)


def test_outputs_are_read_into_content_and_calls() -> None:
    out = split_output("Let me check. " + CALL + "\n" + CALL, final=True)
    assert out.content == "Let me check. "
    assert [c.name for c in out.calls] == ["get_time", "get_time"]
    assert all(json.loads(c.arguments)["n"] == [1, "}"] and c.complete for c in out.calls)
    assert split_output("no call <tool_", final=False).content == "no call "
    assert split_output("no call <tool_", final=True).content == "no call <tool_"
    cut = split_output('<tool_call>\n{"name": "get_ti', final=True)
    assert cut.calls == [] and cut.content == '<tool_call>\n{"name": "get_ti'
    msg = tool_message(CALL)
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_time"
    assert tool_message("just text") == {"role": "assistant", "content": "just text"}


def test_a_stream_sends_the_name_first_and_the_arguments_in_pieces() -> None:
    text = "Hm. " + CALL
    stream, content, parts = ToolStream(), "", []
    for k in range(1, len(text) + 1):
        new, entries = stream.delta(text[:k], final=k == len(text))
        content += new
        parts += entries
    assert content == "Hm. "
    assert parts[0]["function"] == {"name": "get_time", "arguments": ""}
    assert (
        "".join(p["function"]["arguments"] for p in parts)
        == tool_message(text)["tool_calls"][0]["function"]["arguments"]
    )
    assert stream.called


def _request(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **extra}
    )


def test_prompts_fold_calls_and_results_where_the_template_knows_no_tools() -> None:
    tok = build_tokenizer()
    assert not template_takes_tools(tok)
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c2", "content": "13:00"},
    ]
    messages, kwargs = prompt_messages(_request(messages=history, tool_choice="required"), tok)
    assert kwargs == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[0]["content"].startswith("Be brief.\n\n")
        and "get_weather" in messages[0]["content"]
    )
    assert "at least one function call" in messages[0]["content"]
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert messages[3]["content"].count("<tool_response>") == 2
    none, _ = prompt_messages(_request(tool_choice="none"), tok)
    assert none == MESSAGES


def test_a_template_with_tools_gets_them_and_the_calls() -> None:
    tok = build_tokenizer()
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}"
        "</tool_call>{% endfor %}\n{% endfor %}"
    )
    assert template_takes_tools(tok)
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "utc"}'},
                }
            ],
        },
    ]
    messages, kwargs = prompt_messages(_request(messages=history), tok)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text.startswith("TOOLS:get_weather;get_time;")
    assert '<tool_call>{"zone": "utc"}</tool_call>' in text


def test_auto_grammar_allows_text_and_holds_calls_to_their_schema() -> None:
    tok = build_tokenizer()
    params = output_constraint(_request(tool_choice="auto"))
    assert params is not None and params.grammar is not None
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_lark(params.grammar)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        return all(m.consume_token(t) for t in tok(text).input_ids) and m.is_accepting()

    args = '{"city": "Oslo", "unit": "c", "days": 2}'
    good = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert accepts("Any text at all.")
    assert accepts(good) and accepts("First, a look. " + good + "\n" + good)
    assert not accepts(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert not accepts('Text <tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not accepts(good + " and text after")
