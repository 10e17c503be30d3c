"""Structured outputs over HTTP: OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs``, driven by the official ``openai`` client against a live server with a
tiny random model. Every answer has its constraint's shape; every bad shape is a 400 naming the
field; the early-exit stats count forced tokens apart."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.live_server import Server, api_client

openai = pytest.importorskip("openai")

API_KEY = "so-key"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "boss": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]},
    },
    "required": ["name", "age", "tags", "boss"],
}
MESSAGES = [{"role": "user", "content": "Who is it?"}]


@pytest.fixture(scope="module")
def server(tiny_varied_dir: Path) -> Iterator[Server]:
    srv = Server(
        tiny_varied_dir,
        "--api-key",
        API_KEY,
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    )
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with api_client(server, API_KEY) as c:
        yield c


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": strict}}


def test_json_schema_answers_follow_it(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=300,
        temperature=1.0,
        seed=5,
        n=4,
        response_format=_schema_format(PERSON),
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content)
        jsonschema.validate(value, {**PERSON, "additionalProperties": False})  # strict: closed
    stats = r.model_extra["early_exit"]
    assert stats["num_forced"] > 0


def test_json_object_and_guided_fields(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=200,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    extra_cases = [
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"guided_regex": r"[a-c]{2}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{2}", t)),
        (
            {"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            lambda t: all(isinstance(x, bool) for x in json.loads(t)),
        ),
        (
            {"guided_grammar": 'root ::= "x" [0-9] | "none"'},
            lambda t: re.fullmatch("x[0-9]|none", t),
        ),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ]
    for extra, ok in extra_cases:
        for _ in range(2):
            c = client.completions.create(
                model="tiny", prompt="x", max_tokens=64, temperature=1.0, extra_body=extra
            )
            assert ok(c.choices[0].text), (extra, c.choices[0].text)


def test_streamed_answer_follows_the_schema(client: Any) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=300,
        temperature=0.0,
        stream=True,
        response_format=_schema_format(PERSON),
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_out_of_tokens_inside_the_grammar_is_length(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, response_format=_schema_format(PERSON)
    )
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        (
            {"response_format": _schema_format({"type": "objekt"})},
            "response_format.json_schema.schema",
        ),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
            "guided_json",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"guided_grammar": "start: nothing"}, "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    for kind, base in (
        ("chat/completions", {"messages": MESSAGES}),
        ("completions", {"prompt": "x"}),
    ):
        r = http.post(f"/v1/{kind}", json={"model": "tiny", "max_tokens": 8, **base, **body})
        assert r.status_code == 400, (kind, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4})
    assert ok.status_code == 200
