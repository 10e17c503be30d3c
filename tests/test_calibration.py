"""Threshold calibration: p-values, Learn-then-Test, and ``eeserve calibrate`` end to end.

The statistical tests simulate many calibration runs with a fixed seed on synthetic losses of
known mean; the end-to-end test calibrates a tiny random model and checks that the engine then
exits with the calibrated threshold by default and for ``ExitParams(tolerance=delta)``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest

from eeserve.cli import main as cli_main
from eeserve.engine.layer_cost import LayerCost
from eeserve.engine.plan import calibrated_threshold, resolve_exit_plan
from eeserve.exit_params import ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import load_sidecar
from eeserve.sampling_params import SamplingParams
from eeserve.tuning import calibration_store
from eeserve.tuning.calibration_store import target_folder, with_calibration
from eeserve.tuning.ltt import (
    bentkus_pvalue,
    binom_cdf,
    check_candidate,
    hoeffding_bentkus_pvalue,
    hoeffding_kl_pvalue,
    hoeffding_pvalue,
    learn_then_test,
)
from tests.tiny_model import TINY_KV_BYTES, make_llm

KV = str(TINY_KV_BYTES)  # the tiny model's KV pool, for the commands' --kv-cache-memory

# -- p-values ----------------------------------------------------------------------------------


def test_hoeffding_pvalue_sanity() -> None:
    assert hoeffding_pvalue(0.05, 100, 0.05) == 1.0
    assert hoeffding_pvalue(0.3, 100, 0.05) == 1.0
    assert hoeffding_pvalue(0.0, 100, 0.1) == pytest.approx(math.exp(-2 * 100 * 0.01))
    # Smaller with more data and with a smaller observed loss.
    assert hoeffding_pvalue(0.01, 400, 0.05) < hoeffding_pvalue(0.01, 100, 0.05)
    assert hoeffding_pvalue(0.0, 100, 0.05) < hoeffding_pvalue(0.02, 100, 0.05)
    for r in (0.0, 0.01, 0.03, 0.05, 0.5, 1.0):
        for n in (1, 10, 200):
            for fn in (hoeffding_pvalue, hoeffding_kl_pvalue, bentkus_pvalue):
                assert 0.0 <= fn(r, n, 0.05) <= 1.0
            hb = hoeffding_bentkus_pvalue(r, n, 0.05)
            assert hb <= hoeffding_kl_pvalue(r, n, 0.05) <= hoeffding_pvalue(r, n, 0.05) + 1e-12
    # The KL form with no observed loss is exactly (1 - delta)^n.
    assert hoeffding_kl_pvalue(0.0, 50, 0.05) == pytest.approx(0.95**50)
    with pytest.raises(ValueError):
        hoeffding_pvalue(1.5, 10, 0.05)
    with pytest.raises(ValueError):
        hoeffding_pvalue(0.1, 0, 0.05)


def test_binom_cdf_matches_direct_sum() -> None:
    for n, p in ((10, 0.3), (40, 0.05), (7, 0.9)):
        for k in range(-1, n + 2):
            direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, k + 1))
            assert binom_cdf(k, n, p) == pytest.approx(min(1.0, direct), abs=1e-12)


@pytest.mark.parametrize("name", ["hoeffding", "hb"])
def test_pvalues_are_valid_at_the_null_boundary(name: str) -> None:
    """Losses with true mean exactly delta: P(p <= u) <= u (simulated)."""
    rng = random.Random(0)
    delta, n, trials = 0.2, 60, 3000
    ps = []
    for _ in range(trials):
        losses = [1.0 if rng.random() < delta else 0.0 for _ in range(n)]
        ps.append(check_candidate(0.5, losses, delta, 0.1, name).p_value)
    for u in (0.05, 0.1, 0.2):
        frac = sum(p <= u for p in ps) / trials
        assert frac <= u + 3 * math.sqrt(u * (1 - u) / trials), (u, frac)


# -- Learn-then-Test ---------------------------------------------------------------------------

# Candidate thresholds (most conservative first) and the true mean loss of each.
TRUE_MEANS = {0.99: 0.0, 0.95: 0.01, 0.9: 0.03, 0.8: 0.04, 0.7: 0.06, 0.5: 0.12, 0.3: 0.3}


def _draw(rng: random.Random, mean: float, n: int) -> list[float]:
    """Losses in [0, 1] with the given mean: a mixture of exact agreement and Beta losses."""
    if mean == 0.0:
        return [0.0] * n
    # Loss is Beta(2, 2) (mean 0.5) with probability 2*mean, else 0: mean = mean.
    return [rng.betavariate(2, 2) if rng.random() < 2 * mean else 0.0 for _ in range(n)]


def _trial(rng: random.Random, n: int, delta: float, epsilon: float) -> tuple[float | None, float]:
    losses = {c: _draw(rng, m, n) for c, m in TRUE_MEANS.items()}
    ltt = learn_then_test(losses, delta, epsilon).threshold
    safe = [c for c in sorted(losses, reverse=True) if sum(losses[c]) / n <= delta]
    naive = safe[-1] if safe else max(losses)  # most aggressive with empirical mean <= delta
    return ltt, naive


def test_ltt_risk_is_controlled_over_repeated_trials() -> None:
    """P(the returned threshold has true mean loss > delta) <= epsilon over repeated runs; the
    naive rule (most aggressive empirical mean <= delta) breaks that on the same data."""
    rng = random.Random(1234)
    delta, epsilon, n, trials = 0.05, 0.1, 100, 1500
    bad_ltt = bad_naive = chosen = 0
    for _ in range(trials):
        ltt, naive = _trial(rng, n, delta, epsilon)
        if ltt is not None:
            chosen += 1
            bad_ltt += TRUE_MEANS[ltt] > delta
        bad_naive += TRUE_MEANS[naive] > delta
    assert chosen > trials // 2  # the test is not vacuous: LTT usually returns a threshold
    assert bad_ltt / trials <= epsilon
    assert bad_naive / trials > epsilon  # the setting is hard enough for the bound to matter


def test_ltt_risk_at_the_boundary() -> None:
    """An aggressive candidate just above delta (Bernoulli losses, the worst case for the bound)
    is returned sometimes, but in at most an epsilon fraction of the trials."""
    rng = random.Random(5)
    delta, epsilon, n, trials = 0.05, 0.2, 500, 1000
    bad = 0
    for _ in range(trials):
        aggressive = [1.0 if rng.random() < delta + 0.001 else 0.0 for _ in range(n)]
        bad += learn_then_test({0.9: [0.0] * n, 0.5: aggressive}, delta, epsilon).threshold == 0.5
    assert 0 < bad / trials <= epsilon


def test_ltt_picks_the_most_aggressive_safe_candidate_with_plenty_of_data() -> None:
    rng = random.Random(7)
    delta, epsilon = 0.05, 0.05
    for _ in range(3):
        losses = {c: _draw(rng, m, 20000) for c, m in TRUE_MEANS.items()}
        result = learn_then_test(losses, delta, epsilon)
        assert result.threshold == 0.8  # true mean 0.04 <= 0.05 < 0.06
        assert [r.rejected for r in result.rows] == [True] * 4 + [False] * 3
        assert [r.tested for r in result.rows] == [True] * 5 + [False] * 2


def test_ltt_stops_at_the_first_non_rejection() -> None:
    """A later candidate that would pass on its own is not tested once the sequence stopped."""
    losses = {0.9: [0.0] * 200, 0.8: [1.0] * 200, 0.5: [0.0] * 200}
    result = learn_then_test(losses, 0.1, 0.05)
    assert result.threshold == 0.9
    assert [(r.candidate, r.rejected, r.tested) for r in result.rows] == [
        (0.9, True, True),
        (0.8, False, True),
        (0.5, False, False),
    ]
    nothing = learn_then_test({0.9: [0.5] * 10}, 0.1, 0.05)
    assert nothing.threshold is None
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_candidate(0.9, [0.0, 1.5], 0.1, 0.05)


# -- the exit config ---------------------------------------------------------------------------


def _entry(delta: float, threshold: float, policy: str = "per_sequence") -> dict[str, object]:
    return {
        "measure": "softmax_margin",
        "delta": delta,
        "epsilon": 0.05,
        "threshold": threshold,
        "policy": policy,
        "loss": "rouge",
        "n": 100,
    }


def test_with_calibration_replaces_the_same_entry_and_sets_the_default() -> None:
    cfg = ExitConfig(4, [1, 2, 3], thresholds={"max_prob": 0.9}, default_measure="max_prob")
    cfg = with_calibration(cfg, _entry(0.05, 0.9))
    cfg = with_calibration(cfg, _entry(0.1, 0.7))
    cfg = with_calibration(cfg, _entry(0.05, 0.8))  # recalibrated: replaces the first
    assert [(c["delta"], c["threshold"]) for c in cfg.calibration] == [(0.05, 0.8), (0.1, 0.7)]
    assert cfg.thresholds == {"max_prob": 0.9, "softmax_margin": 0.8}
    assert cfg.default_measure == "softmax_margin" and cfg.enabled_by_default
    assert calibrated_threshold(cfg, 0.05, "softmax_margin") == 0.8
    assert calibrated_threshold(cfg, 0.2, "softmax_margin") == 0.7
    with pytest.raises(ValueError, match=r"no calibration for tolerance 0\.01"):
        calibrated_threshold(cfg, 0.01, "softmax_margin")


def test_a_calibration_beside_the_default_keeps_the_default() -> None:
    cfg = ExitConfig(4, [1, 2, 3], thresholds={"classifier": 0.9}, default_measure="classifier")
    cfg = with_calibration(cfg, _entry(0.05, 0.8), make_default=False)
    assert cfg.default_measure == "classifier" and not cfg.enabled_by_default
    assert cfg.thresholds == {"classifier": 0.9, "softmax_margin": 0.8}
    assert calibrated_threshold(cfg, 0.05, "softmax_margin") == 0.8


def test_default_model_needs_its_packaged_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration_store, "packaged_sidecar", lambda spec: None)
    with pytest.raises(ValueError, match="--out-config"):
        target_folder("smollm2", None)
    assert target_folder("smollm2", "/some/dir") == Path("/some/dir")


# -- end to end on a tiny model ----------------------------------------------------------------

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "Paris",
    "capital",
    "France",
    "one",
    "two",
    "three",
]


def _prompt_file(path: Path, n: int) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


DELTA = 0.3


@pytest.fixture(scope="module")
def calibrated(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model (the session fixture stays without a sidecar), calibrated."""
    tmp = tmp_path_factory.mktemp("calibrated")
    model = tmp / "model"
    shutil.copytree(tiny_varied_dir, model)
    prompts = _prompt_file(tmp / "prompts.txt", 40)
    argv = ["calibrate", str(model), "--prompts", str(prompts), "--n", "40", "--max-tokens", "6"]
    argv += ["--delta", str(DELTA), "--epsilon", "0.2", "--json", str(tmp / "r.json")]
    argv += ["--candidates", "0.99", "0.45", "0.3", "0.2", "0.1", "--kv-cache-memory", KV]
    assert cli_main(argv) == 0
    return model


def test_calibrate_command_writes_the_config(calibrated: Path) -> None:
    cfg = json.loads((calibrated / "exit_config.json").read_text())
    (entry,) = cfg["calibration"]
    chosen = entry["threshold"]
    assert entry["measure"] == "softmax_margin" and entry["delta"] == DELTA
    assert entry["epsilon"] == 0.2 and entry["policy"] == "per_sequence"
    assert entry["loss"] == "rouge" and entry["n"] == 40
    assert cfg["thresholds"] == {"softmax_margin": chosen} and cfg["enabled_by_default"] is True
    report = json.loads((calibrated.parent / "r.json").read_text())
    assert report["threshold"] == chosen
    prov = report["provenance"]  # what tests/test_docs.py asks of a result file
    assert all(prov[k] for k in ("command", "commit", "date", "machine"))
    first = report["rows"][0]["test"]
    assert first["candidate"] == 0.99 and first["rejected"] and first["p_value"] <= 0.2


def test_engine_exits_with_the_calibrated_threshold(calibrated: Path) -> None:
    chosen = json.loads((calibrated / "exit_config.json").read_text())["thresholds"][
        "softmax_margin"
    ]
    llm = make_llm(calibrated, exit_policy="per_sequence")  # the policy it was calibrated under
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    texts = (calibrated.parent / "prompts.txt").read_text().splitlines()
    default = llm.generate(texts, sp, use_tqdm=False)
    explicit = llm.generate(texts, sp, use_tqdm=False, exit_params=ExitParams(threshold=chosen))
    tolerant = llm.generate(texts, sp, use_tqdm=False, exit_params=ExitParams(tolerance=DELTA))
    for a, b, c in zip(default, explicit, tolerant):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.outputs[0].exit_layers == b.outputs[0].exit_layers == c.outputs[0].exit_layers
    layers = llm.engine.model_config.num_layers
    assert any(x < layers for o in default for x in o.outputs[0].exit_layers)  # it does exit
    for params in (None, ExitParams(tolerance=DELTA), ExitParams(tolerance=0.5)):
        plan = resolve_exit_plan(params, llm.engine.exit_config)
        assert plan is not None and set(plan.thresholds.values()) == {chosen}
    with pytest.raises(ValueError, match="no calibration for tolerance"):
        llm.generate(texts[:1], sp, use_tqdm=False, exit_params=ExitParams(tolerance=DELTA / 2))


def test_auto_engines_use_per_sequence_calibrations_row_by_row(calibrated: Path) -> None:
    """Under ``auto`` (no calibration of its own) a tolerance takes ``per_sequence``'s threshold
    and its rows leave as they would there, even where ``auto`` would hold them."""
    per = make_llm(calibrated, exit_policy="per_sequence")
    auto = make_llm(calibrated, exit_policy="auto")
    # A layer that costs the same with fewer rows: ``auto`` alone would keep every row running.
    auto.engine.runner.exit_loop.cost = LayerCost((1, 64), (1.0, 1.0), (0.1, 0.1))
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    texts = (calibrated.parent / "prompts.txt").read_text().splitlines()
    want = per.generate(texts, sp, use_tqdm=False, exit_params=ExitParams(tolerance=DELTA))
    got = auto.generate(texts, sp, use_tqdm=False, exit_params=ExitParams(tolerance=DELTA))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].exit_layers for o in got] == [o.outputs[0].exit_layers for o in want]


def test_server_passes_tolerance_through(calibrated: Path) -> None:
    pytest.importorskip("fastapi")
    from eeserve.server.prepare import to_exit_params
    from eeserve.server.protocol import EarlyExitOptions

    cfg = load_sidecar(calibrated)
    assert cfg is not None
    ep = to_exit_params(EarlyExitOptions.model_validate({"tolerance": DELTA}), cfg[0].num_layers)
    assert ep is not None and ep.tolerance == DELTA
    chosen = cfg[0].thresholds["softmax_margin"]
    assert resolve_exit_plan(ep, cfg[0]) == resolve_exit_plan(ExitParams(threshold=chosen), cfg[0])


@pytest.mark.slow
def test_calibrate_into_out_config_leaves_the_model_alone(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    prompts = _prompt_file(tmp_path / "prompts.jsonl", 12)
    prompts.write_text(
        "".join(json.dumps({"prompt": ln}) + "\n" for ln in prompts.read_text().splitlines())
    )
    out = tmp_path / "sidecar"
    argv = ["calibrate", str(tiny_varied_dir), "--prompts", str(prompts), "--n", "12"]
    argv += ["--max-tokens", "4", "--delta", "0.3", "--epsilon", "0.2", "--loss", "tokens"]
    argv += ["--candidates", "0.99", "0.5", "--out-config", str(out), "--policy", "batch_all"]
    argv += ["--kv-cache-memory", KV]
    assert cli_main(argv) == 0
    assert not (tiny_varied_dir / "exit_config.json").exists()
    (entry,) = json.loads((out / "exit_config.json").read_text())["calibration"]
    assert entry["loss"] == "tokens" and entry["policy"] == "batch_all" and entry["n"] == 12
    default = json.loads((out / "exit_config.json").read_text())["default_measure"]
    # A second measure beside it: its threshold and entry, the default stays.
    assert cli_main([*argv, "--measure", "max_prob", "--keep-default"]) == 0
    cfg = json.loads((out / "exit_config.json").read_text())
    assert cfg["default_measure"] == default != "max_prob"
    assert [c["measure"] for c in cfg["calibration"]] == ["max_prob", default]
    assert cfg["thresholds"]["max_prob"] == cfg["calibration"][0]["threshold"]
    # Nothing passes: exit status 1 and nothing written.
    argv = ["calibrate", str(tiny_varied_dir), "--prompts", str(prompts), "--n", "3"]
    argv += ["--max-tokens", "4", "--candidates", "0.99", "--out-config", str(tmp_path / "none")]
    argv += ["--kv-cache-memory", KV]
    assert cli_main(argv) == 1
    assert not (tmp_path / "none").exists()


def test_constrained_calibration_sets_the_constrained_threshold_only(
    calibrated: Path, tmp_path: Path
) -> None:
    """``--structured``: the threshold goes to ``constrained_thresholds``; constrained requests
    that state no threshold use it, free-text ones keep theirs."""
    out = tmp_path / "sidecar"
    free = json.loads((calibrated / "exit_config.json").read_text())["thresholds"]
    argv = ["calibrate", str(calibrated), "--structured", "classification", "--loss", "fields"]
    argv += ["--n", "12", "--max-tokens", "8", "--delta", "0.5", "--epsilon", "0.5"]
    argv += ["--candidates", "0.999", "0.3", "--out-config", str(out), "--kv-cache-memory", KV]
    argv += ["--check-n", "4"]
    assert cli_main(argv) == 0
    cfg = json.loads((out / "exit_config.json").read_text())
    entry = cfg["calibration"][0]
    assert entry["structured"] == "classification" and entry["loss"] == "fields"
    chosen = cfg["constrained_thresholds"]["softmax_margin"]
    assert chosen == entry["threshold"] and cfg["thresholds"] == free
    exit_cfg = ExitConfig(**{k: v for k, v in cfg.items() if k != "format"})
    rule = ExitParams(mode="exit")
    constrained = resolve_exit_plan(rule, exit_cfg, constrained=True)
    plain = resolve_exit_plan(rule, exit_cfg)
    assert constrained is not None and set(constrained.thresholds.values()) == {chosen}
    assert plain is not None and set(plain.thresholds.values()) == {free["softmax_margin"]}
    # A tolerance resolves against free-text calibrations only.
    assert calibrated_threshold(exit_cfg, 0.5, "softmax_margin") == free["softmax_margin"]
