"""Exit-head tuning (``eeserve tune-exits``) on a tiny random model: loss, sidecar, engine use."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from eeserve import ExitParams, SamplingParams
from eeserve.cli import main as cli_main
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import build_exit_heads, load_exit_setup, load_sidecar, save_sidecar
from eeserve.models.loader import load_model, packaged_sidecar
from eeserve.tuning.data import collect
from eeserve.tuning.groups import Group, text_groups
from eeserve.tuning.heads import init_heads, train_head, tune_layers
from eeserve.tuning.options import TuneOptions
from eeserve.tuning.tune import tune
from tests.tiny_model import base_weight_hashes, make_llm, tiny_tune_options

LAYERS = [1, 2, 3]


@dataclass
class Tuned:
    folder: Path
    report: dict[str, Any]
    hashes_before: dict[str, str]


def _opts(folder: Path, cache: Path, **kw: Any) -> TuneOptions:
    return tiny_tune_options(folder, cache, LAYERS, **kw)


@pytest.fixture(scope="module")
def tuned(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    """A copy of the tiny model with a tuned sidecar written into its folder."""
    folder = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_varied_dir, folder)
    before = base_weight_hashes(folder)
    report = tune(_opts(folder, folder.parent / "cache"))
    return Tuned(folder, report, before)


def _data(folder: Path, n: int = 12) -> list[Group]:
    """Deterministic text groups (no generation) for the low-level tests."""
    gen = torch.Generator().manual_seed(0)
    return [Group([1, 2], [torch.randint(3, 300, (40,), generator=gen).tolist()]) for _ in range(n)]


def test_tuning_lowers_the_distillation_loss(tuned: Tuned) -> None:
    r = tuned.report
    for row in r["layers"]:  # tuned heads start as the shared head; held-out KL must drop
        assert row["kl_tuned"] < row["kl_shared"], row
    for stats in r["training"].values():
        assert stats["last_loss"] < stats["first_loss"], stats
    assert r["layers"][0]["agreement_tuned"] > r["layers"][0]["agreement_shared"]


def test_sidecar_and_report_written(tuned: Tuned) -> None:
    found = load_sidecar(tuned.folder)
    assert found is not None
    cfg, weights = found
    assert (cfg.head, cfg.adapter, cfg.classifier, cfg.exit_layers) == (
        "tuned",
        "linear",
        True,
        LAYERS,
    )
    assert set(cfg.thresholds) == {"softmax_margin", "max_prob", "hidden_cosine", "classifier"}
    assert cfg.default_measure == tuned.report["default_measure"]
    assert "heads.2.classifier.weight" in weights
    report = json.loads((tuned.folder / "tune_report.json").read_text())
    assert [row["layer"] for row in report["layers"]] == LAYERS
    assert "| layer | shared head | tuned head |" in (tuned.folder / "tune_report.md").read_text()


def test_base_weights_bit_identical_after_tuning(tuned: Tuned, tmp_path: Path) -> None:
    assert base_weight_hashes(tuned.folder) == tuned.hashes_before  # the files
    model, mcfg = load_model(tuned.folder, torch.float32, torch.device("cpu"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = ExitConfig(mcfg.num_layers, LAYERS, head="tuned", adapter="linear", classifier=True)
    heads = init_heads(cfg, model)
    data = collect(model, _data(tuned.folder), LAYERS, topk=8)
    tune_layers(model, heads, data, data, _opts(tuned.folder, tmp_path, steps=5))
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)  # the module in memory
    assert not any(p.requires_grad for p in model.parameters())


def test_sidecar_round_trip_same_logits(tuned: Tuned, tmp_path: Path) -> None:
    model, mcfg = load_model(tuned.folder, torch.float32, torch.device("cpu"))
    cfg = ExitConfig(mcfg.num_layers, LAYERS, head="tuned", adapter="mlp", adapter_rank=16)
    cfg.classifier = True
    heads = init_heads(cfg, model)
    data = collect(model, _data(tuned.folder), LAYERS, topk=8)
    tune_layers(model, heads, data, data, _opts(tuned.folder, tmp_path, steps=10, adapter="mlp"))
    save_sidecar(tmp_path / "side", cfg, heads)
    cfg2, heads2 = load_exit_setup([tmp_path / "side"], 4, mcfg.hidden_size, mcfg.rms_norm_eps)
    assert cfg2 == cfg and heads2 is not None
    h = torch.randn(5, mcfg.hidden_size)
    with torch.no_grad():
        for layer in LAYERS:
            a = model.lm_head(heads.normed(layer, h))
            b = model.lm_head(heads2.normed(layer, h))
            assert torch.equal(a, b)
            assert torch.equal(heads.probe(layer, h), heads2.probe(layer, h))


def test_training_is_deterministic_with_a_seed(tuned: Tuned, tmp_path: Path) -> None:
    model, mcfg = load_model(tuned.folder, torch.float32, torch.device("cpu"))
    cfg = ExitConfig(mcfg.num_layers, [2], head="tuned", adapter="linear")
    data = collect(model, _data(tuned.folder), [2], topk=8)
    runs = []
    for _ in range(2):
        heads = init_heads(cfg, model)
        opts = _opts(tuned.folder, tmp_path, steps=8, negatives=16, topk=4)
        train_head(heads.head(2), data.hidden[2], data, model.lm_head.weight, opts)
        runs.append(heads.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_engine_uses_the_tuned_head(tuned: Tuned) -> None:
    """Threshold 0 at layer 2: every decode token is the tuned head's argmax there."""
    llm = make_llm(tuned.folder, enable_prefix_caching=False)
    assert llm.engine.exit_config.head == "tuned"
    out = llm.generate(
        ["Paris is the capital"],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        exit_params=ExitParams(threshold=0.0, exit_layers=[2], measure="softmax_margin"),
        use_tqdm=False,
    )[0]
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].exit_layers[1:] == [2] * (len(tokens) - 1)
    model, _ = load_model(tuned.folder, torch.float32, torch.device("cpu"))
    found = load_sidecar(tuned.folder)
    assert found is not None
    heads = build_exit_heads(*found, model.config.hidden_size, model.config.rms_norm_eps)
    assert heads is not None
    # Layers <= 2 of every position are computed exactly under early exit: a teacher-forced
    # full-depth pass gives the same hidden states after layer 2.
    data = collect(model, [Group(list(out.prompt_token_ids), [tokens])], [2], topk=4)
    with torch.no_grad():
        tuned_next = model.lm_head(heads.normed(2, data.hidden[2])).argmax(-1).tolist()
        shared_next = model.lm_head(model.final_norm(data.hidden[2])).argmax(-1).tolist()
    assert tokens[1:] == tuned_next
    assert tokens[1:] != shared_next, "tuned and shared heads agree everywhere: weak test"


def test_text_data_files(tuned: Tuned, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tuned.folder)
    (tmp_path / "a.txt").write_text("The quick brown fox.\n\nOne two three four five six.")
    rows = [{"text": "Paris is the capital of France."}, {"prompt": "def f", "completion": "(x)"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    groups = text_groups([tmp_path / "a.txt", tmp_path / "b.jsonl"], tok)
    assert len(groups) == 4
    assert groups[3].prompt == list(tok("def f").input_ids)
    with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
        text_groups([tmp_path / "c.csv"], tok)


@pytest.mark.slow
def test_tune_exits_command_writes_what_its_flags_ask(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    """``eeserve tune-exits`` end to end on the tiny model: the adapter, rank, exit layers and the
    sidecar's defaults (the packaged smollm2 sidecar's come from these flags, Makefile
    tune-default) land in the sidecar, the seed in the report, and the base stays untouched."""
    before = base_weight_hashes(tiny_varied_dir)
    out = tmp_path / "heads"
    argv = [
        "tune-exits", str(tiny_varied_dir), "--exit-layers", "1,2", "--out", str(out),
        "--adapter", "lowrank", "--rank", "8", "--seed", "3", "--steps", "20", "--tokens", "400",
        "--heldout-tokens", "200", "--batch-size", "64", "--max-tokens", "24", "--threads", "1",
        "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    defaults = ["--default-mode", "speculative", "--default-draft", "int8", "--draft-vocab", "64"]
    assert cli_main([*argv, *defaults]) == 0
    found = load_sidecar(out)
    assert found is not None
    cfg, weights = found
    assert (cfg.adapter, cfg.adapter_rank, cfg.exit_layers) == ("lowrank", 8, [1, 2])
    assert (cfg.default_mode, cfg.default_draft, cfg.draft_vocab) == ("speculative", "int8", 64)
    assert "heads.2.adapter.layers.1.weight" in weights  # lowrank: two layers
    report = json.loads((out / "tune_report.json").read_text())
    assert report["options"]["seed"] == 3 and report["options"]["adapter"] == "lowrank"
    assert base_weight_hashes(tiny_varied_dir) == before
    # The sidecar's defaults are not part of the trained heads' key: the same heads either way.
    opts = TuneOptions("smollm2", [6, 10], tmp_path, default_mode="speculative", draft_vocab=64)
    assert opts.key() == TuneOptions("smollm2", [6, 10], tmp_path).key()
    with pytest.raises(SystemExit) as exc:
        cli_main([*argv, "--default-draft", "fp8"])
    assert exc.value.code == 2


def test_packaged_default_sidecar_loads() -> None:
    folder = packaged_sidecar("smollm2")
    if folder is None:
        pytest.skip("no packaged sidecar for the default model yet")
    found = load_sidecar(folder)
    assert found is not None
    cfg, weights = found
    assert cfg.num_layers == 30 and cfg.head == "tuned" and cfg.classifier
    heads = build_exit_heads(cfg, weights, 576, 1e-5)
    assert heads is not None and set(heads.heads) == {str(x) for x in cfg.exit_layers}
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert size < 20 * 2**20


def test_bench_exits_section_runs_on_a_tuned_sidecar(tuned: Tuned, tmp_path: Path) -> None:
    """The efficiency check (every token exits at one layer) uses the sidecar's first exit
    layer: a tuned sidecar has heads nowhere else."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tuned.folder), "--sections", "exits", "--out", str(out)]
    small = ["--batch-sizes", "2", "--max-tokens", "4", "--repeats", "1", "--prompt-len", "8"]
    assert cli_main([*argv, *small, "--thresholds", "0.5", "--policies", "per_sequence"]) == 0
    result = json.loads(out.read_text())
    assert set(result["provenance"]) >= {"command", "commit", "date", "machine"}
    rows = {r["threshold"]: r for r in result["exits"]}
    assert set(rows) == {"0.5", f"0@{LAYERS[0]}"}
    # Prefill's first token is full depth; the other three leave at the first exit layer.
    assert rows[f"0@{LAYERS[0]}"]["mean_exit_layer"] < LAYERS[1]
