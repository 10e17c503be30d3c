"""``eeserve bench structured`` end to end on the tiny model: every constrained mode's output
holds its constraint, the lossless modes agree with constrained full depth token for token, and
the results file says where it comes from."""

from __future__ import annotations

import json
from pathlib import Path

from eeserve.cli import main
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
            "free,constrained,jump_forward,exits,default,hf",
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
        if r["mode"] != "free":
            assert r["valid_rate"] == 1.0 or r["workload"] == "extraction", r
        if r["mode"] in ("jump_forward", "default", "hf"):
            assert r["token_agreement"] == 1.0, r  # the same constrained greedy tokens
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
