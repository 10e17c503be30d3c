"""Batch policies (``auto`` and its layer cost model) and the cheap shortlist checks.

What docs/design.md promises: ``auto`` keeps confident rows running where the layer cost model
says a layer costs the same with fewer rows, and lets them leave where it does not; every policy
keeps the invariants (an unreachable threshold is full depth; without exits, policies agree);
a shortlist measure over the whole vocabulary is the full-vocabulary measure.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from eeserve import LLM, SamplingParams
from eeserve.cli import main
from eeserve.engine.layer_cost import ROWS, LayerCost, layer_cost
from eeserve.engine.policy import decide
from eeserve.exit_params import DraftSource, ExitParams
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import load_sidecar, save_sidecar
from eeserve.tuning.prompts import prompt_texts
from tests.tiny_model import make_llm, run_together

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "Once upon"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
L = 4  # layers of the tiny model
# A layer whose time hardly depends on its rows (memory-bound), and one that grows with them.
FLAT = LayerCost(ROWS, tuple(1.0 + 0.001 * n for n in ROWS), tuple(0.05 for _ in ROWS))
LINEAR = LayerCost(ROWS, tuple(0.1 * n for n in ROWS), tuple(0.001 * n for n in ROWS))


# -- the decision ---------------------------------------------------------------------------


def test_per_sequence_and_batch_all() -> None:
    marked = [False, False]
    assert decide("per_sequence", [True, False], marked, True) == [True, False]
    assert decide("batch_all", [True, False], marked, True) == [False, False]
    assert marked == [True, False]  # sticky
    assert decide("batch_all", [False, True], marked, True) == [True, True]


@pytest.mark.parametrize(("cost", "leaves"), [(FLAT, False), (LINEAR, True)])
def test_auto_follows_its_cost_model(cost: LayerCost, leaves: bool) -> None:
    """8 running rows, 3 confident: they leave only where a layer is cheaper without them."""
    marked = [False] * 8
    confident = [True, True, True, False, False, False, False, False]
    go = decide("auto", confident, marked, True, lambda m: cost.shrink_pays(8, m))
    assert go == ([True] * 3 + [False] * 5 if leaves else [False] * 8)
    assert marked == confident
    # Everyone confident: all stop, whatever the cost.
    assert decide("auto", [True] * 8, marked, True, lambda m: False) == [True] * 8


def test_auto_eager_rows_leave_when_confident() -> None:
    """Speculative drafts leave whenever confident (a draft is verified later anyway)."""
    go = decide(
        "auto", [True, True, False], [False] * 3, True, lambda m: False, [True, False, False]
    )
    assert go == [True, False, False]


def test_layer_cost_interpolates_and_counts_the_fill() -> None:
    assert FLAT.layer(8) == pytest.approx(1.008)
    assert LINEAR.layer(3) == pytest.approx(0.3)
    assert LINEAR.layer(100) == pytest.approx(10.0)  # linear beyond the last point
    assert not FLAT.shrink_pays(8, 3)
    assert LINEAR.shrink_pays(8, 3)
    expensive_fill = LayerCost(ROWS, LINEAR.layer_s, tuple(1.0 for _ in ROWS))
    assert not expensive_fill.shrink_pays(8, 3)  # the fill costs more than the rows save
    assert FLAT.shrink_pays(8, 8)


def test_layer_cost_is_measured_once_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EESERVE_HOME", str(tmp_path))
    calls = []

    def measure() -> LayerCost:
        calls.append(1)
        return LINEAR

    assert layer_cost("k", measure) == LINEAR
    assert layer_cost("k", measure) == LINEAR
    assert len(calls) == 1
    assert (tmp_path / "layer_costs" / "k.json").exists()


# -- the engine -----------------------------------------------------------------------------


def _run(llm: LLM, params: ExitParams | list[ExitParams]) -> list:
    per_prompt = params if isinstance(params, list) else [params] * len(PROMPTS)
    return run_together(llm, PROMPTS, GREEDY, per_prompt)


@pytest.fixture(scope="module")
def mixed() -> list[ExitParams]:
    """Rows that want different depths in one batch."""
    return [
        ExitParams(threshold=0.0, exit_layers=[1]),
        ExitParams(threshold=0.0, exit_layers=[2]),
        ExitParams(enabled=False),
        ExitParams(threshold=0.0, exit_layers=[1]),
    ]


@pytest.mark.parametrize(("cost", "like"), [(LINEAR, "per_sequence"), (FLAT, "batch_all")])
def test_auto_in_the_engine_acts_as_its_cost_model_says(
    tiny_varied_dir: Path, mixed: list[ExitParams], cost: LayerCost, like: str
) -> None:
    auto = make_llm(tiny_varied_dir, exit_policy="auto", enable_prefix_caching=False)
    auto.engine.runner.exit_loop.cost = cost
    ref = make_llm(tiny_varied_dir, exit_policy=like, enable_prefix_caching=False)
    got, want = _run(auto, mixed), _run(ref, mixed)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.exit_layers for c in got] == [c.exit_layers for c in want]
    if like == "per_sequence":
        assert {1, 2, L} <= {x for c in got for x in c.exit_layers[1:]}


@pytest.mark.parametrize("policy", ["auto", "per_sequence", "batch_all"])
def test_every_policy_keeps_full_depth_without_exits(tiny_varied_dir: Path, policy: str) -> None:
    llm = make_llm(tiny_varied_dir, exit_policy=policy, enable_prefix_caching=False)
    none = make_llm(tiny_varied_dir, exit_policy="none", enable_prefix_caching=False)
    full = [c.token_ids for c in _run(none, ExitParams(enabled=False))]
    unreachable = ExitParams(threshold=1.5, measure="max_prob", exit_layers=[1, 2, 3])
    for params in (ExitParams(enabled=False), unreachable):
        outs = _run(llm, params)
        assert [c.token_ids for c in outs] == full
        assert all(x == L for c in outs for x in c.exit_layers)


def test_stats_count_what_the_passes_ran(tiny_varied_dir: Path) -> None:
    llm = make_llm(tiny_varied_dir, exit_policy="per_sequence", enable_prefix_caching=False)
    stats = llm.engine.stats
    _run(llm, ExitParams(enabled=False))
    assert stats.layer_passes == L * stats.passes
    before = (stats.passes, stats.layer_passes)
    _run(llm, ExitParams(threshold=0.0, exit_layers=[1]))
    passes, layer_passes = stats.passes - before[0], stats.layer_passes - before[1]
    assert layer_passes < L * passes  # decode passes stop after layer 1


# -- shortlist checks -----------------------------------------------------------------------


def _with_shortlist(src: Path, dst: Path, ids: list[int], size: int) -> Path:
    shutil.copytree(src, dst)
    cfg = ExitConfig(L, [1, 2, 3], shortlist=ids, shortlist_size=size)
    save_sidecar(dst, cfg, None)
    return dst


@pytest.mark.parametrize(
    "pair", [("shortlist_max_prob", "max_prob"), ("shortlist_margin", "softmax_margin")]
)
def test_a_whole_vocabulary_shortlist_is_the_full_measure(
    tiny_varied_dir: Path, tmp_path: Path, pair: tuple[str, str]
) -> None:
    plain = make_llm(tiny_varied_dir, exit_policy="per_sequence", enable_prefix_caching=False)
    vocab = plain.engine.model_config.vocab_size
    ids = list(reversed(range(vocab)))  # any order: the softmax is over the same rows
    folder = _with_shortlist(tiny_varied_dir, tmp_path / "sl", ids, vocab)
    llm = make_llm(folder, exit_policy="per_sequence", enable_prefix_caching=False)
    for threshold in (0.05, 0.2, 0.5):
        short, full = (ExitParams(threshold=threshold, measure=m) for m in pair)
        a, b = _run(llm, short), _run(plain, full)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.exit_layers for c in a] == [c.exit_layers for c in b]


def test_a_short_shortlist_checks_less_and_the_token_comes_from_the_full_head(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    """A token that exits on a shortlist check is the full head's argmax at its exit layer."""
    folder = _with_shortlist(tiny_varied_dir, tmp_path / "sl", list(range(16)), 0)
    llm = make_llm(folder, exit_policy="per_sequence", enable_prefix_caching=False)
    assert llm.engine.runner.exit_loop.checks.shortlist_rows == 16
    outs = _run(llm, ExitParams(threshold=0.0, measure="shortlist_max_prob", exit_layers=[1]))
    shared = make_llm(tiny_varied_dir, exit_policy="per_sequence", enable_prefix_caching=False)
    ref = _run(shared, ExitParams(threshold=0.0, measure="max_prob", exit_layers=[1]))
    assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
    assert any(t >= 16 for c in outs for t in c.token_ids)  # not confined to the shortlist


def test_shortlist_measures_need_a_shortlist(tiny_varied_dir: Path) -> None:
    llm = make_llm(tiny_varied_dir, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="shortlist"):
        llm.generate(["x"], GREEDY, exit_params=ExitParams(measure="shortlist_max_prob"))


def test_speculative_drafts_from_shortlist_checks_are_lossless(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    folder = _with_shortlist(tiny_varied_dir, tmp_path / "sl", list(range(32)), 0)
    llm = make_llm(folder, enable_prefix_caching=False, speculative_draft="exits")
    full = [c.token_ids for c in _run(llm, ExitParams(enabled=False))]
    spec = ExitParams(mode="speculative", measure="shortlist_max_prob", threshold=0.0)
    outs = _run(llm, spec)
    assert [c.token_ids for c in outs] == full
    assert any(x is not None for c in outs for x in (c.draft_layers or []))


def test_shortlist_command_ranks_what_the_model_produces(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_varied_dir, folder)
    argv = ["shortlist", str(folder), "--out", str(folder), "--size", "24", "--prompts", "6"]
    assert main([*argv, "--int8-draft-vocab", "25"]) == 2  # more than the shortlist holds
    kv = str(16 * 2**20)
    assert (
        main([*argv, "--max-tokens", "8", "--kv-cache-memory", kv, "--int8-draft-vocab", "16"]) == 0
    )
    found = load_sidecar(folder)
    assert found is not None
    ids = found[0].shortlist
    assert len(ids) == len(set(ids)) == 24
    assert found[0].draft_ids(10**6, DraftSource.INT8) == ids[:16]
    llm = make_llm(folder, exit_policy="per_sequence", enable_prefix_caching=False)
    texts = prompt_texts(6, 0, "tune")
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    outs = [llm.chat([{"role": "user", "content": t}], sp, use_tqdm=False)[0] for t in texts]
    counts = Counter(t for o in outs for t in o.outputs[0].token_ids)
    assert ids[0] == min(counts, key=lambda t: (-counts[t], t))
    exits = ExitParams(threshold=0.0, measure="shortlist_max_prob", exit_layers=[1])
    out = llm.generate(["x"], GREEDY, use_tqdm=False, exit_params=exits)[0].outputs[0]
    assert set(out.exit_layers[1:]) == {1}
