"""A model trained to exit (``tune-exits --train-base lora``): the base delta's training, format,
merge at load, hash check, and the ``smollm2-ee`` name, on tiny random models."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from eeserve import ExitParams, SamplingParams
from eeserve.cli import _build_parser
from eeserve.models import loader
from eeserve.models.base_delta import BaseDelta, delta_key, merge_base_delta, weights_hash
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import (
    CONFIG_NAME,
    FORMAT,
    load_exit_setup,
    load_sidecar,
    save_sidecar,
)
from eeserve.models.loader import load_model
from eeserve.tuning import delta_train as base_delta_mod
from eeserve.tuning.data import collect
from eeserve.tuning.delta_train import attach_adapters, train_base_delta
from eeserve.tuning.groups import Group
from eeserve.tuning.heads import init_heads
from eeserve.tuning.tune import tune
from tests.tiny_model import add_base_delta, hf_greedy, load_hf, make_llm, tiny_tune_options

LAYERS = [1, 2, 3]


def _groups(n: int = 8, seed: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    return [Group([1, 2], [torch.randint(3, 300, (30,), generator=gen).tolist()]) for _ in range(n)]


def _random_delta(folder: Path, rank: int = 4, seed: int = 0) -> BaseDelta:
    """Adapters with random A and B (B is zero after init: a zero delta tests nothing)."""
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    adapters = attach_adapters(model, rank, 0.5, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    adapters.remove()
    return adapters.delta()


def _logits(model: Any, groups: list[Group]) -> torch.Tensor:
    data = collect(model, groups, [1], topk=1, rows="all")
    with torch.no_grad():
        return model.lm_head(data.final.to(model.lm_head.weight.dtype))  # type: ignore[no-any-return]


def _opts(folder: Path, cache: Path, **kw: Any) -> Any:
    base = dict(base_tokens=400, lora_rank=4, lora_lr=3e-3, base_batch_tokens=128)
    base.update(kw)
    return tiny_tune_options(folder, cache, LAYERS, train_base="lora", **base)


def _save_v2(folder: Path, model_dir: Path, delta: BaseDelta) -> ExitConfig:
    model, mcfg = load_model(model_dir, torch.float32, torch.device("cpu"))
    cfg = ExitConfig(mcfg.num_layers, LAYERS, head="tuned", adapter="linear")
    cfg.base_delta = {"base_model_hash": weights_hash(model_dir)}
    save_sidecar(folder, cfg, init_heads(cfg, model), delta)
    return cfg


def test_merged_delta_equals_the_unmerged_adapters(tiny_varied_dir: Path) -> None:
    """In float64, so that the check is of the merge, not of float32 rounding (in float32 the two
    differ by up to ~3e-5 on this model's logits, |logit| <= 7: a different summation order)."""
    delta = _random_delta(tiny_varied_dir)
    model, _ = load_model(tiny_varied_dir, torch.float64, torch.device("cpu"))
    before = _logits(model, _groups(3))
    adapters = attach_adapters(model, delta.rank, delta.scale, seed=0)
    with torch.no_grad():
        for p, (_, saved) in zip(adapters.parameters(), _ordered(adapters, delta)):
            p.copy_(saved)
    unmerged = _logits(model, _groups(3))
    adapters.remove()
    merge_base_delta(model, delta)
    merged = _logits(model, _groups(3))
    assert (unmerged - before).abs().max() > 0.1, "the delta changes nothing: weak test"
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


def _ordered(adapters: Any, delta: BaseDelta) -> list[tuple[str, torch.Tensor]]:
    """The delta's tensors in ``adapters.parameters()`` order (per module: A's, then B's)."""
    out = []
    for (i, _path), projs in adapters.names.items():
        for ab in "AB":
            out += [(k, delta.tensors[k]) for k in (f"{delta_key(i, p)}.lora_{ab}" for p in projs)]
    return out


@pytest.mark.slow
def test_sidecar_v2_round_trip_and_engine_matches_hf(tiny_varied_dir: Path, tmp_path: Path) -> None:
    """A v2 sidecar in the model folder: the engine merges its delta before packing, and full
    depth equals HF transformers on the HF weights with W + s B A added by HF projection name."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_varied_dir, folder)
    delta = _random_delta(folder)
    cfg = _save_v2(folder, folder, delta)
    raw = json.loads((folder / CONFIG_NAME).read_text())
    assert raw["format"] == FORMAT == "eeserve-exit-heads/2"
    assert raw["base_delta"]["file"] == "base_delta.safetensors"
    assert (raw["base_delta"]["rank"], raw["base_delta"]["scale"]) == (4, 0.5)
    found = load_sidecar(folder)
    assert found is not None and found[0] == cfg
    hf = load_hf(tiny_varied_dir)
    add_base_delta(hf, folder, 0.5)
    prompt = [5, 17, 42, 8, 99]
    want = hf_greedy(hf, prompt, 12)
    llm = make_llm(folder, enable_prefix_caching=False)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        exit_params=ExitParams(enabled=False),
        use_tqdm=False,
    )[0]
    assert list(out.outputs[0].token_ids) == want
    assert want != hf_greedy(load_hf(tiny_varied_dir), prompt, 12), "delta changes nothing"


def test_delta_refuses_another_base(
    tiny_varied_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    side = tmp_path / "side"
    _save_v2(side, tiny_varied_dir, _random_delta(tiny_varied_dir))
    model, mcfg = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    ours, theirs = weights_hash(tiny_varied_dir), weights_hash(tiny_model_dir)
    assert ours != theirs
    with pytest.raises(ValueError, match=f"{ours}.*{theirs}"):
        load_exit_setup(
            [side], 4, mcfg.hidden_size, mcfg.rms_norm_eps, model=model, base=tiny_model_dir
        )
    with pytest.raises(ValueError, match="base delta needs the model"):
        load_exit_setup([side], 4, mcfg.hidden_size, mcfg.rms_norm_eps)


def test_sidecar_v1_still_loads(tiny_varied_dir: Path, tmp_path: Path) -> None:
    side = tmp_path / "v1"
    side.mkdir()
    cfg = ExitConfig(4, [2], head="shared")
    v1 = {k: v for k, v in cfg.__dict__.items() if k != "base_delta"}
    (side / CONFIG_NAME).write_text(json.dumps({"format": "eeserve-exit-heads/1", **v1}))
    model, mcfg = load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got, heads = load_exit_setup(
        [side], 4, mcfg.hidden_size, mcfg.rms_norm_eps, model=model, base=tiny_varied_dir
    )
    assert got == cfg and got.base_delta is None and heads is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    (side / CONFIG_NAME).write_text(json.dumps({"format": "eeserve-exit-heads/9", **v1}))
    with pytest.raises(ValueError, match="unsupported exit sidecar format"):
        load_sidecar(side)


def _train(
    folder: Path, cache: Path | None, n: int = 12, **kw: Any
) -> tuple[BaseDelta, dict[str, Any]]:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    opts = _opts(folder, cache or folder, **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    delta, stats = train_base_delta(model, _groups(n), LAYERS, opts, cache)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "model changed"
    return delta, stats


def test_training_is_deterministic_and_resumes(
    tiny_varied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, stats = _train(tiny_varied_dir, None)
    assert stats["steps"] == 3
    assert any(float(v.abs().max()) > 0 for k, v in a.tensors.items() if k.endswith("lora_B"))
    b, _ = _train(tiny_varied_dir, None)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    # Interrupted in its third step (two checkpoints written), then rerun: the same delta.
    calls = []
    real = base_delta_mod.step_loss

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(base_delta_mod, "step_loss", failing)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_varied_dir, tmp_path / "ckpt", checkpoint_every=1)
    monkeypatch.setattr(base_delta_mod, "step_loss", real)
    c, _ = _train(tiny_varied_dir, tmp_path / "ckpt", checkpoint_every=1)
    assert all(torch.equal(a.tensors[k], c.tensors[k]) for k in a.tensors)
    # A finished run is loaded from its checkpoint, not retrained (no step runs again).
    monkeypatch.setattr(base_delta_mod, "step_loss", failing)
    d, _ = _train(tiny_varied_dir, tmp_path / "ckpt", checkpoint_every=1)
    assert len(calls) == 3
    assert all(torch.equal(a.tensors[k], d.tensors[k]) for k in a.tensors)


def test_training_lowers_the_exit_loss_and_holds_the_final(tiny_varied_dir: Path) -> None:
    """Four groups seen 15 times (random tokens: nothing to generalise from), 30 steps: the
    exits' KL falls, the variant's final layer stays near the original's."""
    model, _ = load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))
    opts = _opts(tiny_varied_dir, tiny_varied_dir, base_batch_tokens=64)
    _, stats = train_base_delta(model, _groups(4) * 15, LAYERS, opts, None)
    first, last = stats["exit_kl_first"], stats["exit_kl_last"]
    assert stats["steps"] == 30
    assert sum(last.values()) < 0.85 * sum(first.values()), stats
    assert stats["final_kl_last"] < 0.25 * min(first.values()), stats
    assert stats["final_kl_max"] < min(first.values()), stats


def test_training_curve_and_the_frozen_base_baseline(tiny_varied_dir: Path) -> None:
    """With held-out groups a curve point is measured before the first step, every
    ``eval_every`` steps and after the last; ``lora_lr=0`` trains the heads alone (zero delta,
    full depth the original's at every point) on the same data."""
    heldout = _groups(3, seed=7)
    points = {}
    for lr in (3e-3, 0.0):
        model, _ = load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))
        opts = _opts(tiny_varied_dir, tiny_varied_dir, base_batch_tokens=64, lora_lr=lr)
        opts = replace(opts, eval_every=4)
        delta, stats = train_base_delta(model, _groups(4) * 5, LAYERS, opts, None, heldout)
        curve = stats["curve"]
        assert [c["tokens"] for c in curve] == [0, 4 * 64, 8 * 64, 10 * 64]
        assert all(c["positions"] == 3 * 29 for c in curve)
        assert curve[0]["full_depth_agreement_with_original"] == 1.0  # B starts at zero
        zero = all(float(v.abs().max()) == 0 for k, v in delta.tensors.items() if "lora_B" in k)
        assert zero == (lr == 0)
        points[lr] = curve
    assert all(c["full_depth_agreement_with_original"] == 1.0 for c in points[0.0])
    assert points[0.0][0] == points[3e-3][0], "same heads, same model at step 0"
    assert points[0.0][-1]["exit_agreement"] != points[0.0][0]["exit_agreement"], "heads trained"


@pytest.mark.slow
def test_tune_with_train_base_writes_a_v2_sidecar_and_report(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_varied_dir, folder)
    report = tune(_opts(folder, tmp_path / "cache"))
    v = report["variant"]
    assert 0 <= v["full_depth_agreement_with_original"] <= 1
    assert set(v["perplexity"]) == {"original", "variant"}
    assert all("agreement_original" in row for row in report["layers"])
    assert v["training"]["curve"][0]["tokens"] == 0
    md = (folder / "tune_report.md").read_text()
    assert "with the original's final" in md and "Training curve" in md
    found = load_sidecar(folder)
    assert found is not None and found[0].base_delta is not None
    assert found[0].base_delta["base_model_hash"] == weights_hash(folder)
    llm = make_llm(folder, enable_prefix_caching=False)  # loads and merges the delta
    assert llm.engine.exit_config.base_delta is not None


def test_variant_name_without_its_sidecar_fails_before_any_fetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A checkout without the packaged sidecar (here: an empty package data folder)."""

    def no_fetch() -> Path:
        raise AssertionError("fetched the default model before resolving the name")

    monkeypatch.setattr(loader, "fetch_default_model", no_fetch)
    real = loader.variant_sidecar
    monkeypatch.setattr(loader, "variant_sidecar", lambda data=tmp_path: real(data))
    with pytest.raises(ValueError, match=r"smollm2-ee.*not in this package yet.*tune-default-ee"):
        make_llm("smollm2-ee")
    with pytest.raises(ValueError, match="tune-default-ee"):
        loader.packaged_sidecar("smollm2-ee", data=tmp_path)


def test_cli_parses_train_base(tmp_path: Path) -> None:
    argv = ["tune-exits", "smollm2", "--exit-layers", "6,10", "--out", str(tmp_path)]
    more = ["--train-base", "lora", "--lora-rank", "8", "--final-weight", "4"]
    args = _build_parser().parse_args([*argv, *more, "--layer-weights", "1,2"])
    assert (args.train_base, args.lora_rank, args.final_weight) == ("lora", 8, 4.0)
    assert args.layer_weights == "1,2"


def test_layer_weights_are_checked(tiny_varied_dir: Path) -> None:
    with pytest.raises(ValueError, match="layer_weights"):
        _train(tiny_varied_dir, None, layer_weights=[1.0])


def test_heads_only_key_unchanged_by_the_new_options(tmp_path: Path) -> None:
    opts = tiny_tune_options(tmp_path, tmp_path, LAYERS)
    assert opts.key() == replace(opts, lora_rank=99, base_tokens=7).key()
    assert opts.key() != replace(opts, train_base="lora").key()
