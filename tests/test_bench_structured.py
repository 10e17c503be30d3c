"""``eeserve bench structured`` end to end on the tiny model: every constrained mode's output
holds its constraint, the lossless modes agree with constrained full depth token for token, and
the results file says where it comes from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eeserve.bench import llamacpp_build, structured
from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.structured_llamacpp import constraint_fields
from eeserve.cli import main
from eeserve.structured_outputs import StructuredOutputsParams
from eeserve.tuning.structured_workloads import classification, extraction, field_agreement


def test_bench_structured_writes_its_table(tiny_varied_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    rc = main(
        [
            "bench",
            "structured",
            "--model",
            str(tiny_varied_dir),
            "--batch-sizes",
            "1,3",
            "--modes",
            "free,free_matched,constrained,jump_forward,exits,default,hf",
            "--min-prompts",
            "2",
            "--max-tokens",
            "48",
            "--rounds",
            "1",
            "--exit-threshold",
            "0.5",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["provenance"]["commit"] and "isa" in result["provenance"]["machine"]
    rows = result["rows"]
    assert {(r["workload"], r["batch"]) for r in rows} == {
        (w, b) for w in ("extraction", "classification") for b in (1, 3)
    }
    for r in rows:
        assert r["num_requests"] == max(r["batch"], 2)
        if r["mode"] not in ("free", "free_matched"):
            assert r["valid_rate"] == 1.0 or r["workload"] == "extraction", r
        if r["mode"] in ("jump_forward", "default", "hf"):
            assert r["token_agreement"] == 1.0, r  # the same constrained greedy tokens
    # The matched free run does constrained full depth's amount of work without the grammar.
    tokens = {(r["workload"], r["batch"], r["mode"]): r["output_tokens"] for r in rows}
    for w, b, m in tokens:
        if m == "free_matched":
            assert tokens[(w, b, m)] == tokens[(w, b, "constrained")]
    # Forced tokens are counted where the grammar forces any (a choice's later letters).
    assert any(r["forced_tokens"] > 0 for r in rows if r["mode"] == "jump_forward")


def test_workloads_are_fixed_and_score_fields() -> None:
    a, b = extraction(5), extraction(5)
    assert a.prompts == b.prompts and a.truth == b.truth
    truth = a.truth[0]
    assert a.valid(json.dumps(truth)) and not a.valid('{"name": 1}')
    assert field_agreement(a.fields(json.dumps(truth)), truth) == 1.0
    assert field_agreement(None, truth) == 0.0
    c = classification(10)
    assert sorted({t["label"] for t in c.truth}) == sorted(c.constraint.choice or [])


def test_llamacpp_takes_a_schema_as_json_schema_and_a_choice_as_gbnf() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert constraint_fields(StructuredOutputsParams(json=schema)) == {"json_schema": schema}
    choice = constraint_fields(StructuredOutputsParams(choice=['say "hi"', "no"]))
    assert choice == {"grammar": 'root ::= "say \\"hi\\"" | "no"'}
    gbnf = 'root ::= "a" [0-9]+'
    assert constraint_fields(StructuredOutputsParams(grammar=gbnf)) == {"grammar": gbnf}
    with pytest.raises(ValueError, match="regex"):
        constraint_fields(StructuredOutputsParams(regex="[a-z]+"))


def _built() -> bool:
    return llamacpp_build.is_built()  # collection never starts a build


@pytest.mark.slow
@pytest.mark.skipif(not _built(), reason="llama.cpp's tools not built (--sections peer)")
def test_llamacpp_mode_decodes_under_the_same_constraints(
    tiny_varied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server on the tiny model's exported GGUF: every output holds its constraint."""
    gguf = write_gguf_f32(tiny_varied_dir, tmp_path / "m.gguf")
    monkeypatch.setattr(structured, "own_gguf", lambda folder: ("F32", gguf))
    out = tmp_path / "structured.json"
    args = ["bench", "structured", "--model", str(tiny_varied_dir), "--batch-sizes", "1,2"]
    args += ["--modes", "constrained,llamacpp", "--min-prompts", "2", "--max-tokens", "48"]
    assert main([*args, "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    llama = [r for r in rows if r["mode"] == "llamacpp"]
    assert len(llama) == 4 and all(r["median_tokens_per_s"] > 0 for r in llama)
    for r in llama:
        assert r["valid_rate"] == 1.0 or (
            r["workload"] == "extraction" and r["output_tokens"] >= 48
        )
