"""``eeserve bench report`` end to end on a tiny model: JSON, markdown and PNGs (no timings)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from eeserve.bench import llamacpp
from eeserve.bench.report_peer import peer_section
from eeserve.cli import main
from tests.tiny_model import build_tiny_model

MAX_TOKENS = 8
BATCHES = [1, 2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("report")
    # Long context: the bench prompts are several hundred tokens with the tiny tokenizer.
    model = build_tiny_model(tmp / "model", weight_std=0.2, norm_noise=0.1, max_pos=2048)
    out = tmp / "out"
    argv = [
        "bench", "report", "--model", str(model), "--out", str(out),
        "--batch-sizes", ",".join(map(str, BATCHES)), "--max-tokens", str(MAX_TOKENS),
        "--repeats", "1", "--threshold", "0.05", "--thresholds", "0.05",
        "--cosine-thresholds", "0.9", "--frontier-batch", "2", "--note", "tiny test", "--no-peer",
    ]  # fmt: skip
    assert main(argv) == 0
    return out, json.loads((out / "report.json").read_text())


def _ee_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    return results["paper"] + results["frontier"]


def test_json_covers_every_section(report: tuple[Path, dict[str, Any]]) -> None:
    _, r = report
    assert {"meta", "paper", "full_depth", "hf", "frontier"} <= set(r)
    meta = r["meta"]
    assert meta["batch_sizes"] == BATCHES and meta["max_tokens"] == MAX_TOKENS
    assert meta["repeats_done"] == meta["repeats"] == 1
    assert meta["num_layers"] == 4 and meta["dtype"] == "float32"
    assert meta["prompts"]["split"] == "bench" and meta["prompts"]["tokens_min"] > 0
    assert "bench report" in meta["canonical_command"]
    configs = {(x["policy"], x["kv_fill"]) for x in r["paper"]}
    assert configs == {(p, f) for p in ("per_sequence", "batch_all") for f in ("fill", "recompute")}
    assert sorted({x["batch"] for x in r["paper"]}) == BATCHES
    assert [x["batch"] for x in r["full_depth"]] == BATCHES
    assert [x["batch"] for x in r["hf"]] == BATCHES
    assert {x["measure"] for x in r["frontier"]} == {"softmax_margin", "max_prob", "hidden_cosine"}


def test_figures_are_sane(report: tuple[Path, dict[str, Any]]) -> None:
    _, r = report
    for row in _ee_rows(r):
        for key in ("ratio", "decode_tok_s", "full_decode_tok_s", "itl_ms", "full_itl_ms"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert 0 <= row["token_agreement"] <= 1 and 0 <= row["rouge_l"] <= 1
    for row in r["hf"]:
        assert row["decode_tok_s"] > 0 and row["engine_vs_hf"] > 0
        # Full depth is HF's greedy output, token for token (the tiny model's texts survive HF's
        # left padding at batch 2).
        assert row["token_agreement_engine_vs_hf"] == 1.0, row


def test_telemetry_counts_every_generated_token(report: tuple[Path, dict[str, Any]]) -> None:
    _, r = report
    exited = False
    for row in _ee_rows(r):
        t = row["telemetry"]
        assert t["tokens"] == row["batch"] * MAX_TOKENS
        assert sum(t["histogram"].values()) == t["tokens"]
        assert all(1 <= int(layer) <= 4 for layer in t["histogram"])
        assert t["histogram"].get("4", 0) >= row["batch"]  # first tokens come from the prefill
        mean = sum(int(k) * v for k, v in t["histogram"].items()) / t["tokens"]
        assert t["mean_layers_per_token"] == pytest.approx(mean)
        exited |= t["mean_layers_per_token"] < 4
    assert exited  # threshold 0.05 makes some decode tokens leave early


def test_markdown_has_tables_and_command(report: tuple[Path, dict[str, Any]]) -> None:
    out, r = report
    md = (out / "report.md").read_text()
    assert r["meta"]["command"] in md and r["meta"]["canonical_command"] in md
    for heading in ("## Setup", "## Headline", "## 1. Early exit vs full depth", "## 2. Frontier",
                    "## 3. Baseline: HF transformers", "## 4. Exit telemetry"):  # fmt: skip
        assert heading in md
    assert "| batch | HF tok/s | full depth tok/s |" in md
    assert "tiny test" in md and "float32" in md
    for png in ("frontier.png", "throughput.png", "exit_layers.png"):
        assert f"]({png})" in md


def test_plots_are_png_files(report: tuple[Path, dict[str, Any]]) -> None:
    out, _ = report
    for name in ("frontier.png", "throughput.png", "exit_layers.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


def test_time_budget_stops_further_repeats() -> None:
    import time

    from eeserve.bench.measure import Run
    from eeserve.bench.report_blocks import Block, run_blocks

    class Bar:
        def set_postfix_str(self, s: str, refresh: bool = True) -> None:
            pass

        def update(self, n: int) -> None:
            pass

    def job() -> Run:
        time.sleep(0.02)
        return Run(tokens_per_s=1.0, mean_itl_ms=1.0, decode_tokens_per_s=1.0)

    blocks = [Block("b", 1, [("full", job), ("ee", job)])]
    assert run_blocks(blocks, 5, 0.05, Bar(), 8) == 1  # the 2nd repeat would end past 0.05 s
    assert [len(v) for v in blocks[0].runs.values()] == [1, 1]
    blocks = [Block("b", 1, [("full", job)])]
    assert run_blocks(blocks, 3, 0, Bar(), 8) == 3  # no budget


def test_quick_and_full_defaults() -> None:
    from eeserve.bench.report_config import config_from_args
    from eeserve.cli import _build_parser

    quick = config_from_args(_build_parser().parse_args(["bench", "report", "--quick"]))
    assert quick.batch_sizes == [1, 8] and quick.max_tokens == 32 and quick.repeats == 1
    assert quick.out == "bench/results/quick" and len(quick.thresholds) == 2
    full = config_from_args(_build_parser().parse_args(["bench", "report", "--max-tokens", "256"]))
    assert full.batch_sizes[:3] == [1, 8, 32] and full.max_tokens == 256 and full.repeats == 3
    assert full.policies == ["per_sequence", "batch_all"] and full.kv_fills == ["fill", "recompute"]


def test_default_and_calibrated_thresholds_join_the_frontier() -> None:
    from eeserve.bench.report_config import ReportConfig
    from eeserve.bench.report_run import frontier_settings, operating_point
    from eeserve.models.exit_config import ExitConfig

    xc = ExitConfig(
        num_layers=30,
        exit_layers=[6, 12],
        classifier=True,
        thresholds={"softmax_margin": 0.93},
        calibration=[{"measure": "max_prob", "delta": 0.05, "epsilon": 0.05, "threshold": 0.97}],
    )
    cfg = ReportConfig(thresholds=[0.5], cosine_thresholds=[0.99])
    points = frontier_settings(cfg, xc)
    assert ("softmax_margin", 0.93, "default") in points
    assert ("max_prob", 0.97, "calibrated δ=0.05") in points
    assert ("classifier", 0.5, "sweep") in points and ("hidden_cosine", 0.99, "sweep") in points
    assert operating_point(cfg, xc) == ("softmax_margin", 0.93, "exit config default")
    cfg.measure = "max_prob"
    assert operating_point(cfg, xc) == ("max_prob", 0.97, "calibrated")
    cfg.threshold = 0.8
    assert operating_point(cfg, xc) == ("max_prob", 0.8, "--threshold")


def test_speculative_section_is_lossless(report: tuple[Path, dict[str, Any]]) -> None:
    out, r = report
    rows = r["speculative"]
    for draft in ("exits", "int8"):  # both draft sources, each at every batch size
        assert sorted(x["batch"] for x in rows if x["draft"] == draft) == BATCHES
    for x in rows:
        assert x["identical"] and x["token_agreement"] == 1.0
        assert x["ratio"] > 0 and 0 <= x["acceptance_rate"] <= 1 and x["drafted"] > 0
        assert sum(v["verified"] for v in x["per_layer"].values()) > 0
        if x["draft"] == "int8":  # drafted at full depth
            assert set(x["per_layer"]) == {str(r["meta"]["num_layers"])}
    md = (out / "report.md").read_text()
    assert "## Speculative mode" in md and "1.000" in md


def test_sections_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: without llama-cpp-python the llama.cpp section says so and how to install it."""
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    model = build_tiny_model(tmp_path / "model", weight_std=0.2, max_pos=2048)
    out = tmp_path / "out"
    argv = [
        "bench", "report", "--model", str(model), "--out", str(out), "--batch-sizes", "2",
        "--max-tokens", "4", "--repeats", "1", "--threshold", "0.05", "--no-hf",
        "--policies", "per_sequence", "--kv-fills", "fill", "--sections", "speculative",
        "--num-draft-tokens", "2,3", "--speculative-drafts", "exits",
    ]  # fmt: skip
    assert main(argv) == 0
    r = json.loads((out / "report.json").read_text())
    assert "paper" not in r and [x["num_draft_tokens"] for x in r["speculative"]] == [2, 3]
    assert main([*argv[:-1], "fp4"]) == 2
    assert r["peer"] == {"skipped": f"llama-cpp-python is not installed; {llamacpp.INSTALL_HINT}"}
    md = (out / "report.md").read_text()
    assert "## llama.cpp\n\nSkipped: llama-cpp-python is not installed; pip install" in md
    assert main([*argv[:-6], "--sections", "papers"]) == 2


def test_no_peer_leaves_the_llama_cpp_section_out(report: tuple[Path, dict[str, Any]]) -> None:
    out, r = report
    assert "peer" not in r and "## llama.cpp" not in (out / "report.md").read_text()
    assert r["meta"]["canonical_command"].endswith("--no-peer")


def test_llama_cpp_rows_render_as_a_table() -> None:
    row = {
        "batch": 8,
        "engine_decode_tok_s": 255.5,
        "llamacpp_decode_tok_s": 275.9,
        "engine_vs_llamacpp": 255.5 / 275.9,
        "token_agreement": 1.0,
        "rouge_l": 1.0,
    }
    md = peer_section({"peer": {"rows": [row]}})
    assert md.startswith("## llama.cpp\n")
    assert "| 8 | 255.5 | 275.9 | 0.93× | 1.000 / 1.000 |" in md


# -- the paper section (--sections paper) ------------------------------------------------------

PAPER_POLICIES = ["batch_all", "per_sequence", "auto"]


@pytest.fixture(scope="module")
def paper(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("paper")
    model = build_tiny_model(tmp / "model", weight_std=0.2, norm_noise=0.1, max_pos=2048)
    out = tmp / "out"
    argv = [
        "bench", "report", "--model", str(model), "--out", str(out), "--batch-sizes", "1,2",
        "--max-tokens", str(MAX_TOKENS), "--repeats", "1", "--no-hf", "--no-peer",
        "--sections", "paper", "--paper-measures", "softmax_margin",
        "--paper-thresholds", "1.01,0.05", "--paper-texts", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    return out, json.loads((out / "report.json").read_text())


def test_paper_section_rows(paper: tuple[Path, dict[str, Any]]) -> None:
    _, r = paper
    assert "paper" not in r and "speculative" not in r  # only the section asked for
    sweep = r["paper_sweep"]
    assert sweep["policies"] == PAPER_POLICIES
    assert [(x["batch"], x["policy"], x["threshold"]) for x in sweep["rows"]] == [
        (b, p, t) for b in BATCHES for p in PAPER_POLICIES for t in (1.01, 0.05)
    ]
    assert [x["batch"] for x in sweep["full_depth"]] == BATCHES
    for x in sweep["full_depth"]:
        assert x["layers_per_iteration"] == x["layers_per_token"] == x["mean_exit_layer"] == 4
        assert x["decode_passes"] == MAX_TOKENS - 1
    exited = False
    for x in sweep["rows"]:
        assert x["decode_passes"] == MAX_TOKENS - 1 and x["ratio"] > 0
        assert 0 <= x["rouge_l"] <= 1 and x["ppl_ratio"] > 0
        assert 1 <= x["layers_per_token"] <= 4 and 1 <= x["layers_per_iteration"] <= 4
        if x["batch"] == 1:  # one row: a pass is a token
            assert x["layers_per_iteration"] == pytest.approx(x["mean_exit_layer"])
            assert x["ideal_pass"] == pytest.approx(x["ideal_token"])
        if x["threshold"] == 1.01:  # nothing exits: full depth, whatever the policy
            assert x["layers_per_iteration"] == x["layers_per_token"] == 4
            assert x["ideal_pass"] == x["ideal_token"] == 1.0
            assert x["ppl_ratio"] == 1.0 and x["rouge_l"] == 1.0 and x["token_agreement"] == 1.0
        else:
            assert (x["ideal_token"] > 1) == (x["mean_exit_layer"] < 4)
            exited |= x["layers_per_iteration"] < 4
    assert exited  # threshold 0.05 makes some passes stop early
    tf = sweep["teacher_forced"]
    assert tf["texts"]["count"] == 2 and tf["texts"]["scored_tokens"] > 0
    assert tf["points"]["softmax_margin@1.01"]["ratio"] == 1.0
    assert tf["points"]["softmax_margin@0.05"]["exited"] > 0
    cm = sweep["cost_model"]
    assert cm["layer"] > 0 and cm["head"] > 0


def test_paper_section_markdown_and_plot(paper: tuple[Path, dict[str, Any]]) -> None:
    out, r = paper
    md = (out / "report.md").read_text()
    assert "## The paper's comparison" in md and "](paper_sweep.png)" in md
    assert "| full depth | – | – |" in md and "### Held-out quality per threshold" in md
    assert "## 1. Early exit" not in md
    data = (out / "paper_sweep.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    cmd = r["meta"]["canonical_command"]
    assert "--sections paper" in cmd and "--paper-thresholds 1.01,0.05" in cmd
    # What tests/test_docs.py asks of a result file under bench/results/.
    assert all(r["provenance"][k] for k in ("commit", "date", "machine", "command"))


def test_paper_thresholds_flag() -> None:
    from eeserve.bench.report_config import ReportConfig, parse_paper_thresholds

    spec = parse_paper_thresholds("classifier=1.01,0.9;hidden_cosine=1.01,0.99")
    assert spec == {"classifier": [1.01, 0.9], "hidden_cosine": [1.01, 0.99]}
    cfg = ReportConfig(paper_thresholds=spec)
    assert cfg.thresholds_for("classifier") == [1.01, 0.9]
    assert cfg.thresholds_for("max_prob")[0] == 1.01  # the defaults start where nothing exits
    assert ReportConfig(paper_thresholds=parse_paper_thresholds("0.5")).thresholds_for("x") == [0.5]


def _sweep_row(policy: str, threshold: float, ratio: float, ideal: float, ppl: float) -> Any:
    return {"batch": 1, "policy": policy, "threshold": threshold, "ratio": ratio,
            "ideal_pass": ideal, "ideal_token": ideal, "ppl_ratio": ppl, "rouge_l": 1.0,
            "layers_per_iteration": 30.0, "mean_exit_layer": 30.0}  # fmt: skip


def test_the_target_verdict_names_what_is_left() -> None:
    from eeserve.bench.report_paper_md import target_verdict

    exits = {"rows": [_sweep_row("auto", 0.99, 1.02, 1.05, 1.01),
                      _sweep_row("auto", 0.5, 1.6, 1.7, 1.5)]}  # fmt: skip
    assert "model's exits" in target_verdict(exits, 1, 1.25)
    assert "1.02× (`auto` at 0.99), 18% short" in target_verdict(exits, 1, 1.25)
    overhead = {"rows": [_sweep_row("per_sequence", 0.9, 1.1, 1.4, 1.04)]}
    assert "cost of the checks and the policy" in target_verdict(overhead, 1, 1.25)
    assert target_verdict(overhead, 1, 1.05).endswith(": met")
    assert "no point within the budget" in target_verdict({"rows": []}, 1, 1.25)
