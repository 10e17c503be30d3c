"""Teacher-forced exit quality (``tuning.teacher_forced``) on a tiny model with tuned heads.

With no exit the perplexity is full depth's exactly; every token exiting at the first exit layer
gives that head's own perplexity; and with ``recompute`` (whose cache is full depth's, so every
decode token sees what teacher forcing sees) the engine's exit layers and logprobs are the ones
the teacher-forced pass computes for the engine's own output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine.plan import ExitPlan
from eeserve.exit_params import ExitMode, ExitParams
from eeserve.sampling_params import SamplingParams
from eeserve.tuning.teacher_forced import (
    ScoredText,
    collect_scores,
    continuation_texts,
    evaluate,
    passage_texts,
    token_exits,
)
from tests.tiny_model import TINY_KV_BYTES, make_llm, random_prompt, with_random_tuned_heads

LAYERS = [1, 2, 3]
MEASURES = ["classifier", "softmax_margin", "max_prob", "hidden_cosine", "shortlist_margin"]


@pytest.fixture(scope="module")
def tuned(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The varied tiny model with random tuned (linear adapter) heads and probes at 1, 2, 3 and a
    vocabulary shortlist."""
    dst = tmp_path_factory.mktemp("tf") / "tuned"
    # the shortlist: the ``shortlist_*`` measures' vocabulary rows
    return with_random_tuned_heads(tiny_varied_dir, dst, LAYERS, 3, list(range(3, 67)))


@pytest.fixture(scope="module")
def llm(tuned: Path):  # type: ignore[no-untyped-def]
    return make_llm(tuned, exit_policy="per_sequence", kv_fill="recompute")


def _texts(engine: LLMEngine) -> list[ScoredText]:
    vocab = engine.model_config.vocab_size
    return passage_texts([random_prompt(40, s, vocab) for s in range(3)], 32)


def test_no_exit_is_full_depth_exactly(llm) -> None:  # type: ignore[no-untyped-def]
    engine = llm.engine
    scores = collect_scores(engine, _texts(engine), MEASURES)
    assert scores.tokens == 3 * 31 and scores.layers == LAYERS
    for measure in MEASURES:
        plan = engine.exit_plan(ExitParams(threshold=1.01, measure=measure))
        q = evaluate(scores, plan)
        assert q.perplexity == q.full_perplexity and q.ratio == 1.0
        assert q.mean_exit_layer == 4 and q.exited == 0 and q.argmax_agreement == 1.0
    assert evaluate(scores, None).perplexity == evaluate(scores, plan).full_perplexity
    # Every token at the first exit: that head's own perplexity, not full depth's.
    q = evaluate(scores, engine.exit_plan(ExitParams(threshold=0.0, measure="max_prob")))
    assert q.exited == 1.0 and q.mean_exit_layer == 1
    assert q.perplexity == pytest.approx(math.exp(-float(scores.logprob[0].mean())))
    assert q.ratio != 1.0 and q.argmax_agreement < 1.0


def test_full_depth_scores_are_the_models(tuned: Path, llm) -> None:  # type: ignore[no-untyped-def]
    """Full-depth log-probabilities equal those of HF's forward pass over the same text."""
    from tests.tiny_model import hf_logprobs, load_hf

    engine = llm.engine
    texts = _texts(engine)
    scores = collect_scores(engine, texts, ["max_prob"])
    hf = load_hf(tuned)
    ref = torch.cat(
        [hf_logprobs(hf, t.ids)[:-1].gather(1, torch.tensor(t.ids[1:])[:, None])[:, 0]
         for t in texts]
    )  # fmt: skip
    torch.testing.assert_close(scores.full_logprob.float(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "measure", ["classifier", "softmax_margin", "hidden_cosine", "shortlist_max_prob"]
)
def test_engine_exits_where_teacher_forcing_says(llm, measure: str) -> None:  # type: ignore[no-untyped-def]
    engine = llm.engine
    prompts = [random_prompt(12, 10 + s, engine.model_config.vocab_size) for s in range(3)]
    probe = collect_scores(engine, passage_texts(prompts, 12), [measure])
    # A threshold that some tokens pass and others miss at the first exit layer.
    threshold = float(probe.confidence[measure][0].median())
    params = ExitParams(threshold=threshold, measure=measure)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False, exit_params=params)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    scores = collect_scores(engine, continuation_texts(prompts, outputs), [measure])
    layer, logp, _ = token_exits(scores, engine.exit_plan(params))
    served = [x for o in outs for x in o.outputs[0].exit_layers[1:]]
    chosen = [
        lp[t] for o, t in zip(outs, outputs) for lp, t in zip(o.outputs[0].logprobs[1:], t[1:])
    ]
    conf = scores.confidence[measure]
    clear = [
        i
        for i in range(scores.tokens)
        if all(abs(float(conf[e, i]) - threshold) > 1e-4 for e in range(len(LAYERS)))
    ]
    assert len(clear) > scores.tokens // 2
    assert [served[i] for i in clear] == [int(layer[i]) for i in clear]
    assert len({served[i] for i in clear}) > 1  # not all at one layer
    for i in clear:
        assert chosen[i] == pytest.approx(float(logp[i]), abs=1e-4)


def test_a_plan_it_cannot_score_is_an_error(llm) -> None:  # type: ignore[no-untyped-def]
    engine = llm.engine
    scores = collect_scores(engine, _texts(engine), ["max_prob"], layers=[2])
    with pytest.raises(ValueError, match="the plan needs"):
        evaluate(scores, ExitPlan(measure="max_prob", thresholds={1: 0.5, 2: 0.5}))
    with pytest.raises(ValueError, match="the plan needs"):
        evaluate(scores, ExitPlan(measure="classifier", thresholds={2: 0.5}))
    with pytest.raises(ValueError, match="full depth's"):
        evaluate(
            scores, ExitPlan(measure="max_prob", thresholds={2: 0.5}, mode=ExitMode.SPECULATIVE)
        )
    with pytest.raises(ValueError, match="no text"):
        collect_scores(engine, [ScoredText([1, 2], 2)], ["max_prob"])


def _prompt_file(path: Path, n: int) -> Path:
    words = ["fox", "capital", "def", "return", "exit", "layer", "one", "two", "three", "dog"]
    gen = torch.Generator().manual_seed(0)
    lines = [
        " ".join(words[int(i)] for i in torch.randint(0, len(words), (4 + k % 5,), generator=gen))
        for k in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("texts", ["generated", "prompts"])
def test_calibrate_perplexity_picks_the_loosest_within_the_bound(
    tuned: Path, tmp_path: Path, texts: str
) -> None:
    from eeserve.cli import main as cli_main
    from eeserve.engine.plan import resolve_exit_plan
    from eeserve.models.exit_heads import load_sidecar

    out, report = tmp_path / "sidecar", tmp_path / "r.json"
    argv = ["calibrate", str(tuned), "--prompts", str(_prompt_file(tmp_path / "p.txt", 12))]
    argv += ["--n", "12", "--max-tokens", "8", "--loss", "perplexity", "--measure", "max_prob"]
    argv += ["--max-ppl-increase", "0.2", "--candidates", "1.01", "0.9", "0.5", "0.3", "0.1", "0"]
    argv += ["--ppl-texts", texts, "--out-config", str(out), "--json", str(report)]
    argv += ["--full-table", "--check-n", "3", "--kv-cache-memory", str(TINY_KV_BYTES)]
    assert cli_main(argv) == 0
    r = json.loads(report.read_text())
    rows = r["rows"]
    assert [x["candidate"] for x in rows] == [1.01, 0.9, 0.5, 0.3, 0.1, 0.0]
    first = rows[0]["quality"]
    assert first["ratio"] == 1.0 and first["perplexity"] == r["full_perplexity"]
    within = [x["quality"]["ratio"] <= 1.2 for x in rows]
    lead = within.index(False) if False in within else len(within)
    assert lead < len(rows), "every candidate within the bound: weak test"
    assert r["threshold"] == rows[lead - 1]["candidate"]
    assert [x["within"] for x in rows] == [True] * lead + [False] * (len(rows) - lead)
    assert [x["tested"] for x in rows] == [True] * (lead + 1) + [False] * (len(rows) - lead - 1)
    assert r["check"]["tokens"] > 0
    found = load_sidecar(out)
    assert found is not None
    cfg = found[0]
    (entry,) = cfg.calibration
    assert entry["loss"] == "perplexity" and entry["delta"] == 0.2 and entry["policy"] is None
    assert entry["threshold"] == r["threshold"] and entry["epsilon"] is None
    plan = resolve_exit_plan(ExitParams(tolerance=0.2, measure="max_prob"), cfg, "batch_all")
    assert plan is not None and set(plan.thresholds.values()) == {r["threshold"]}
