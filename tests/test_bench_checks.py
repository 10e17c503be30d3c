"""``eeserve bench checks`` runs on a tiny model and reports every measure the sidecar supports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eeserve.cli import main
from eeserve.exit_params import BASE_MEASURES, SHORTLIST_MEASURES
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import save_sidecar


def test_bench_checks_reports_each_measure(tiny_varied_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_varied_dir, folder)
    save_sidecar(folder, ExitConfig(4, [1, 2, 3], shortlist=list(range(64))), None)
    out = tmp_path / "checks.json"
    argv = ["bench", "checks", "--model", str(folder), "--batch-sizes", "1,2"]
    assert main([*argv, "--max-tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["provenance"]) >= {"command", "commit", "date", "machine"}
    measures = {r["measure"] for r in result["checks"]}
    assert measures == (set(BASE_MEASURES) - {"classifier"}) | set(SHORTLIST_MEASURES)
    for r in result["checks"]:
        assert r["check_ms"] > 0 and r["layer_ms"] > 0 and r["model_fraction"] >= 0
        if r["measure"] in SHORTLIST_MEASURES:
            assert 16 <= r["vocab_rows"] <= 64
    assert {(r["measure"], r["batch"]) for r in result["no_exit"]} == {
        (m, b) for m in measures for b in (1, 2)
    }
    assert all(r["ratio"] > 0 for r in result["no_exit"])
