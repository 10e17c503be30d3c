"""``eeserve batch``: OpenAI batch files through the engine, in this process (tiny model).

The command end to end (50 requests with two malformed lines, resume after deleting output
lines), error lines for every kind of bad line, ``early_exit`` in a body, text that cannot be
encoded (server, ``LLM.generate``/``chat`` and batch alike), and a fuzzer of the batch reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eeserve.cli import main
from eeserve.sampling_params import SamplingParams
from eeserve.server.batch import read_envelopes
from eeserve.server.batch_run import BatchProcessor
from tests.batch_files import read_output, request_line, run_cli, stable, write_batch
from tests.tiny_model import make_llm

SURROGATE = "\ud800"


def test_batch_file_with_malformed_lines_and_resume(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_model_dir)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad_body = json.dumps({**request_line(20, model), "body": {"model": model, "prompt": 5}})
    write_batch(src, model, 50, {7: '{"custom_id": "req-6", "body": ', 21: bad_body})
    assert run_cli(src, dst, tiny_model_dir) == 1  # some lines failed
    out = read_output(dst)
    assert len(out) == 50
    errors = {o["error"]["line"]: o for o in out if o["error"] is not None}
    assert sorted(errors) == [7, 21]
    assert errors[7]["response"] is None and errors[7]["error"]["code"] == "json_invalid"
    assert errors[21]["response"]["status_code"] == 400
    assert errors[21]["response"]["body"]["error"]["param"] == "prompt"
    assert errors[21]["custom_id"] == "req-20" and "line 21" in errors[21]["error"]["message"]

    # Bodies are the server's: greedy completions equal the engine's own output.
    llm = make_llm(tiny_model_dir, kv_cache_memory=8_000_000)
    by_id = {o["custom_id"]: o for o in out if o["error"] is None}
    for i in (0, 2, 4):
        req = request_line(i, model)["body"]
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0)
        want = llm.generate(req["prompt"], params, use_tqdm=False)[0].outputs[0]
        resp = by_id[f"req-{i}"]["response"]
        assert resp["status_code"] == 200 and resp["body"]["object"] == "text_completion"
        assert resp["body"]["choices"][0]["text"] == want.text
        assert resp["body"]["usage"]["completion_tokens"] == len(want.token_ids)
    chat = by_id["req-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["early_exit"]["num_layers"] == 4

    # Resume: drop five answered lines; only those (and the two failed lines) run again.
    first = {o["custom_id"]: o for o in out}
    dropped = {"req-3", "req-10", "req-11", "req-30", "req-49"}
    kept = [line for line, o in zip(dst.read_text().splitlines(), out)
            if o["custom_id"] not in dropped]  # fmt: skip
    dst.write_text("\n".join(kept) + "\n")
    capsys.readouterr()
    assert run_cli(src, dst, tiny_model_dir) == 1
    assert "7 lines written (2 failed), 43 already done" in capsys.readouterr().err
    again = read_output(dst)
    assert len(again) == 50 and len({o["id"] for o in again}) == 50
    for o in again:
        if o["custom_id"] not in dropped and o["error"] is None:
            assert o["id"] == first[o["custom_id"]]["id"]  # untouched
        assert stable(o) == stable(first[o["custom_id"]])


def test_bad_lines_become_error_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = str(tiny_model_dir)
    ok = request_line(0, model)
    lines = [
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        json.dumps({**ok, "custom_id": 3}).encode(),
        json.dumps(ok).encode(),
        json.dumps(ok).encode(),  # duplicate custom_id
        json.dumps({**ok, "custom_id": "u", "url": "/v1/embeddings"}).encode(),
        json.dumps({**ok, "custom_id": "m", "method": "GET"}).encode(),
        json.dumps({**ok, "custom_id": "b", "body": [1]}).encode(),
        json.dumps({**ok, "custom_id": "s", "body": {**ok["body"], "stream": True}}).encode(),
        json.dumps({**ok, "custom_id": "x", "body": {**ok["body"], "model": "nope"}}).encode(),
        json.dumps({**ok, "custom_id": "p", "body": {**ok["body"], "prompt": SURROGATE}}).encode(),
        json.dumps({**ok, "custom_id": "L", "body": {**ok["body"], "max_tokens": 10**6}}).encode(),
        b"",  # blank lines are skipped
        b'{"custom_id": "d", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"',
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert run_cli(src, dst, tiny_model_dir) == 1
    out = {o["error"]["line"] if o["error"] else 0: o for o in read_output(dst)}
    assert sorted(out) == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 14]
    codes = {line: (o["error"]["code"], o["error"]["param"]) for line, o in out.items() if line}
    assert codes == {
        1: ("invalid_utf8", None),
        2: ("invalid_line", None),
        3: ("invalid_line", "custom_id"),
        5: ("duplicate_custom_id", "custom_id"),
        6: ("invalid_line", "url"),
        7: ("invalid_line", "method"),
        8: ("invalid_line", "body"),
        9: ("invalid_request_error", "stream"),
        10: ("model_not_found", "model"),
        11: ("invalid_unicode", "prompt"),
        12: ("context_length_exceeded", "prompt"),
        14: ("json_invalid", None),
    }
    assert out[10]["response"]["status_code"] == 404
    assert out[0]["response"]["status_code"] == 200
    assert all(o["error"]["message"].startswith(f"line {k}: ") for k, o in out.items() if k)


def test_early_exit_in_a_batch_body(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Rows leave at their own exits (auto would keep the exiting row running beside the other).
    llm = make_llm(tiny_model_dir, kv_cache_memory=8_000_000, exit_policy="per_sequence")
    model = str(tiny_model_dir)
    base = {"model": model, "prompt": "One", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    modes = {"off": {"enabled": False}, "first": {"threshold": 0.0, "measure": "softmax_margin"}}
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {"custom_id": k, "url": "/v1/completions", "body": {**base, "early_exit": ee}}
            )
            + "\n"
            for k, ee in modes.items()
        )
    )
    out: list[dict[str, Any]] = []
    BatchProcessor(llm.engine, [model]).run(read_envelopes(src, set()), out.append)
    means = {o["custom_id"]: o["response"]["body"]["early_exit"]["mean_exit_layer"] for o in out}
    assert means["off"] == 4 and means["first"] < 4


def test_text_that_cannot_be_encoded_is_a_value_error(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, kv_cache_memory=8_000_000)
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode.*U\+D800 at position 2"):
        llm.generate(["fine", "ab" + SURROGATE], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content is not valid Unicode"):
        llm.chat([{"role": "user", "content": SURROGATE}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop\[1\] is not valid Unicode"):
        SamplingParams(stop=["ok", SURROGATE])


# -- fuzzing the reader ------------------------------------------------------------------------


def _text(max_size: int) -> st.SearchStrategy[str]:
    """Any text, lone surrogates included (JSON can carry them; hypothesis leaves them out)."""
    return st.text(st.characters(exclude_categories=()), max_size=max_size)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text(8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text(6), inner),
    max_leaves=6,
)
_FIELDS: dict[str, Any] = {
    "prompt": _text(12) | st.lists(st.integers(-5, 400), max_size=4),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "robot"]), "content": _text(8)},
            optional={"name": _text(4)},
        ),
        max_size=2,
    ),
    "max_tokens": st.integers(-2, 6),
    "temperature": st.floats(allow_nan=True) | st.integers(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 10**6),
    "seed": st.integers(-(2**64), 2**64),
    "n": st.integers(0, 3),
    "stop": _text(3) | st.lists(_text(3), max_size=2),
    "logprobs": st.integers(-1, 22) | st.booleans(),
    "top_logprobs": st.integers(-1, 22),
    "early_exit": st.fixed_dictionaries(
        {},
        optional={
            "threshold": st.floats(-1, 2) | st.lists(st.floats(0, 1), max_size=4),
            "measure": st.sampled_from(["softmax_margin", "max_prob", "vibes"]),
            "min_layer": st.integers(-1, 6),
            "enabled": st.booleans(),
        },
    ),
}


@st.composite
def _line(draw: st.DrawFn, model: str) -> bytes:
    kind = draw(st.sampled_from(["request", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=30)).replace(b"\n", b" ")
    if kind == "json":
        return json.dumps(draw(_JSON)).encode()
    keys = draw(st.sets(st.sampled_from(sorted(_FIELDS)), max_size=6))
    body: dict[str, Any] = {k: draw(_FIELDS[k]) for k in keys}
    body["model"] = draw(st.sampled_from([model, "other"]))
    body.setdefault("max_tokens", 4)
    url = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/nope"]))
    cid = draw(st.sampled_from(["a", "b", "c"]) | _text(4))
    return json.dumps({"custom_id": cid, "url": url, "body": body}).encode()


def test_fuzz_batch_lines_never_crash(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Generated lines (requests valid and not, other JSON, raw bytes): one output line each,
    each in the batch output format; the engine is left clean (the suite's fixture checks)."""
    llm = make_llm(tiny_model_dir, kv_cache_memory=8_000_000, max_model_len=64)
    model = str(tiny_model_dir)
    processor = BatchProcessor(llm.engine, [model])

    @given(lines=st.lists(_line(model), min_size=1, max_size=6))
    @settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(lines: list[bytes]) -> None:
        src = tmp_path / "fuzz.jsonl"
        src.write_bytes(b"\n".join(lines) + b"\n")
        out: list[dict[str, Any]] = []
        processor.run(read_envelopes(src, set()), out.append)
        assert len(out) == sum(1 for raw in lines if raw.strip())
        for o in out:
            json.dumps(o, ensure_ascii=True)  # always serialisable
            assert set(o) == {"id", "custom_id", "response", "error"}
            if o["error"] is None:
                assert o["response"]["status_code"] == 200
            else:
                assert o["error"]["message"].startswith(f"line {o['error']['line']}: ")
                status = (o["response"] or {}).get("status_code", 400)
                assert 400 <= status < 500, o

    check()


def test_ray_options_without_ray_name_the_extra(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the `ray` extra were not installed
    assert main(["serve", str(tiny_model_dir), "--replicas", "2"]) == 2
    assert "pip install 'eeserve[ray]'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_line_does_not_import_ray() -> None:
    code = "import sys, eeserve.cli, eeserve.server; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
