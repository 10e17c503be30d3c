"""``layer`` exit heads (EE-Tuning's layer head): layer l + 1's shared attention, then a tuned copy
of its MLP half. Checked against HF transformers hidden states and plain reference arithmetic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from eeserve import ExitParams, SamplingParams
from eeserve.cli import main as cli_main
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.exit_config import ExitConfig
from eeserve.models.exit_heads import ExitHeads, load_exit_setup, load_sidecar, save_sidecar
from eeserve.models.llama import apply_rotary
from eeserve.models.loader import load_model
from eeserve.tuning.data import collect
from eeserve.tuning.groups import Group
from eeserve.tuning.heads import init_heads, tune_layers
from eeserve.tuning.options import TuneOptions
from eeserve.tuning.tune import tune
from tests.tiny_model import (
    assert_cache_matches_hf,
    base_weight_hashes,
    kv_block_bytes,
    load_hf,
    make_llm,
    random_prompt,
    step_until_debt,
    tiny_tune_options,
)

L = 4  # layers of the tiny model; layer heads serve exit layers 1..L-2
LAYERS = [1, 2]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):"]


def _cfg(mcfg: ModelConfig, layers: list[int] = LAYERS) -> ExitConfig:
    return ExitConfig(
        mcfg.num_layers,
        layers,
        head="tuned",
        adapter="layer",
        adapter_rank=mcfg.intermediate_size,
        classifier=True,
    )


@pytest.fixture(scope="module")
def layered(tiny_varied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with a layer-head sidecar whose heads are perturbed away from
    their initialisation (so they differ from the shared head at every layer)."""
    folder = tmp_path_factory.mktemp("layered") / "model"
    shutil.copytree(tiny_varied_dir, folder)
    model, mcfg = load_model(folder, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    cfg = _cfg(mcfg)
    heads = init_heads(cfg, model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() == 2 else 0.3))
    save_sidecar(folder, cfg, heads)
    return folder


# -- reference arithmetic (HF modules and plain tensor math only) -------------------------------


def _hf_states(hf: Any, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] h_l (HF's hidden state after 1-based layer ``layer``) and h_mid of layer l + 1
    (h_l plus that layer's attention output), for a full-depth forward over ``ids``."""
    seen: dict[str, torch.Tensor] = {}

    def grab(_m: torch.nn.Module, _a: Any, out: Any) -> None:
        seen["attn"] = out[0][0]

    hook = hf.model.layers[layer].self_attn.register_forward_hook(grab)  # 0-based: layer l + 1
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    h = out.hidden_states[layer][0]
    return h, h + seen["attn"]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _ref_logits(
    w: dict[str, torch.Tensor], layer: int, h_mid: torch.Tensor, lm: torch.Tensor
) -> torch.Tensor:
    """norm(h_mid + down(silu(gate x) * up x)), x = post_norm(h_mid), then the LM head."""
    p = f"heads.{layer}."
    x = _rms(h_mid, w[p + "adapter.post_attention_layernorm.weight"])
    gate, up = w[p + "adapter.mlp.gate_up_proj.weight"].chunk(2)
    y = h_mid + (F.silu(x @ gate.T) * (x @ up.T)) @ w[p + "adapter.mlp.down_proj.weight"].T
    return _rms(y, w[p + "norm.weight"]) @ lm.T


def _generate(folder: Path, prompts: list[str], params: ExitParams | list[ExitParams], **kw: Any):
    kw.setdefault("exit_policy", "per_sequence")  # rows of one batch exit at their own layers
    llm = make_llm(folder, enable_prefix_caching=False, **kw)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    if isinstance(params, ExitParams):
        params = [params] * len(prompts)
    engine = llm.engine
    ids = [engine.add_request(p, greedy, exit_params=e) for p, e in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return llm, [done[i] for i in ids]


# -- the head -----------------------------------------------------------------------------------


def test_untrained_layer_head_is_the_shared_head_one_layer_up(tiny_varied_dir: Path) -> None:
    model, mcfg = load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))
    heads = init_heads(_cfg(mcfg), model)
    hf = load_hf(tiny_varied_dir)
    ids = random_prompt(24, seed=3, vocab_size=mcfg.vocab_size)
    data = collect(model, [Group(ids, [])], LAYERS, topk=4, rows="prompt", mid=True, lens=True)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        for layer in LAYERS:
            h_l, h_mid = _hf_states(hf, ids, layer)
            torch.testing.assert_close(data.hidden[layer], h_mid, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(data.lens[layer], h_l, atol=1e-5, rtol=1e-4)
            shared_up = hf.lm_head(hf.model.norm(out.hidden_states[layer + 1][0]))
            got = model.lm_head(heads.normed(layer, data.hidden[layer]))
            torch.testing.assert_close(got, shared_up, atol=1e-4, rtol=1e-4)
            cos = F.cosine_similarity(h_mid, h_l, dim=-1)
            torch.testing.assert_close(data.cosine[layer], cos, atol=1e-5, rtol=1e-4)


def test_bad_exit_layers_are_rejected(layered: Path, tmp_path: Path) -> None:
    _, mcfg = load_model(layered, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"exit layers \[3\].*\[1, 2\].*layer l \+ 1"):
        ExitHeads(_cfg(mcfg, [1, L - 1]), mcfg.hidden_size, mcfg.rms_norm_eps)
    side = tmp_path / "side"
    save_sidecar(side, _cfg(mcfg, [L - 1]), None)
    with pytest.raises(ValueError, match="exit layers"):
        load_exit_setup([side], L, mcfg.hidden_size, mcfg.rms_norm_eps)
    opts = TuneOptions(str(layered), [2, L - 1], tmp_path / "out", adapter="layer")
    with pytest.raises(ValueError, match=r"exit layers must be in \[1, 2\]"):
        tune(opts)  # rejected before any data is generated
    llm = make_llm(layered)
    with pytest.raises(ValueError, match="no tuned exit head"):
        llm.generate(
            PROMPTS[:1],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            exit_params=ExitParams(threshold=0.0, exit_layers=[L - 1]),
        )


# -- the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("measure", "threshold"),
    [("softmax_margin", 0.0), ("classifier", 0.0), ("hidden_cosine", -1.0)],
)
def test_every_decode_token_exits_through_the_layer_head(
    layered: Path, measure: str, threshold: float
) -> None:
    """Threshold 0 at layers 1, 2: every decode token exits at 1 and is the argmax of the head
    on h_mid of layer 2; the confidences are the measure on the head's input (h_mid, h_1)."""
    params = ExitParams(threshold=threshold, measure=measure, exit_layers=LAYERS)
    _, (res,) = _generate(layered, PROMPTS[:1], params)
    c = res.outputs[0]
    assert c.exit_layers == [L] + [1] * 11
    found = load_sidecar(layered)
    assert found is not None
    w = found[1]
    hf = load_hf(layered)
    ids = list(res.prompt_token_ids) + c.token_ids
    p0 = len(res.prompt_token_ids)
    # Layers <= 1 of every position are exact under early exit, and so is layer 2's attention:
    # the K/V it reads at layer 2 for exited tokens were written from their exact h_1.
    h_l, h_mid = _hf_states(hf, ids, 1)
    with torch.no_grad():
        logits = _ref_logits(w, 1, h_mid, hf.lm_head.weight)[p0 : p0 + 11]
        shared = hf.lm_head(hf.model.norm(h_l))[p0 : p0 + 11]
    assert c.token_ids[1:] == logits.argmax(-1).tolist()
    assert c.token_ids[1:] != shared.argmax(-1).tolist(), "layer head = shared head: weak test"
    top = logits.softmax(-1).topk(2, -1).values
    expected = {
        "softmax_margin": top[:, 0] - top[:, 1],
        "classifier": torch.sigmoid(
            h_mid[p0 : p0 + 11] @ w["heads.1.classifier.weight"][0] + w["heads.1.classifier.bias"]
        ),
        "hidden_cosine": F.cosine_similarity(h_mid, h_l, dim=-1)[p0 : p0 + 11],
    }[measure]
    torch.testing.assert_close(
        torch.tensor(c.exit_confidences[1:]), expected.float(), atol=1e-4, rtol=1e-4
    )


def test_fill_after_a_layer_head_exit_writes_the_reference_kv(layered: Path) -> None:
    """Rows exit at layers 1, 2 and L in one decode step; for every layer above its exit the
    cache holds norm -> K/V projection -> rotary of h_l (layer l + 1's written by its own
    attention, the rest by ``fill``)."""
    llm = make_llm(layered, enable_prefix_caching=False, exit_policy="per_sequence")
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    exits = [
        ExitParams(threshold=0.0, exit_layers=[1]),
        ExitParams(threshold=0.0, exit_layers=[2]),
        ExitParams(enabled=False),
    ]
    for p, e in zip(PROMPTS, exits):
        engine.add_request(p, params, exit_params=e)
    engine.step()  # prefill
    engine.step()  # one decode step
    seqs = list(engine.scheduler.running)
    assert [s.exit_layers[1] for s in seqs] == [1, 2, L]
    hf = load_hf(layered)
    cfg = engine.model_config
    cos, sin = rope_tables(cfg, 64)
    bs = engine.block_manager.block_size
    for seq, exit_layer in zip(seqs, [1, 2]):
        pos = seq.num_prompt_tokens
        slot = seq.block_table[pos // bs] * bs + pos % bs
        h, _ = _hf_states(hf, seq.token_ids[: pos + 1], exit_layer)
        with torch.no_grad():
            for j in range(exit_layer, L):  # 0-based layers above the exit
                layer = hf.model.layers[j]
                x = layer.input_layernorm(h[pos : pos + 1])
                k = layer.self_attn.k_proj(x).view(1, cfg.num_kv_heads, cfg.head_dim)
                v = layer.self_attn.v_proj(x).view(1, cfg.num_kv_heads, cfg.head_dim)
                rot = type("R", (), {"cos": cos[pos : pos + 1], "sin": sin[pos : pos + 1]})
                k = apply_rotary(k, rot)  # type: ignore[arg-type]
                torch.testing.assert_close(engine.runner.kv.k[j, slot], k[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(engine.runner.kv.v[j, slot], v[0], atol=1e-5, rtol=1e-4)
    while engine.has_unfinished_requests():
        engine.step()


def test_policies_with_layer_heads(layered: Path) -> None:
    rows = [
        ExitParams(threshold=0.0, exit_layers=LAYERS),  # confident at 1
        ExitParams(threshold=[2.0, 0.0], exit_layers=LAYERS),  # confident at 2
    ]
    _, outs = _generate(layered, PROMPTS[:2], rows, exit_policy="per_sequence")
    assert [o.outputs[0].exit_layers[1:] for o in outs] == [[1] * 11, [2] * 11]
    _, outs = _generate(layered, PROMPTS[:2], rows, exit_policy="batch_all")
    assert [o.outputs[0].exit_layers[1:] for o in outs] == [[2] * 11, [2] * 11]
    never = [*rows, ExitParams(threshold=2.0, exit_layers=LAYERS)]
    _, outs = _generate(layered, PROMPTS, never, exit_policy="batch_all")
    assert all(o.outputs[0].exit_layers[1:] == [L] * 11 for o in outs)


MIXED = ExitParams(threshold=0.1, measure="softmax_margin", exit_layers=LAYERS)


@pytest.mark.parametrize("kv_fill", ["fill", "recompute"])
def test_preemption_keeps_layer_head_outputs(layered: Path, kv_fill: str) -> None:
    """Replays after preemption (forced depths with ``fill``, full-depth recompute with
    ``recompute``; passengers carry the debt otherwise) give the same tokens and exits."""
    llm, ref = _generate(layered, PROMPTS, MIXED, kv_fill=kv_fill)
    layers = [x for o in ref for x in o.outputs[0].exit_layers[1:]]
    assert {1, 2, L} <= set(layers), f"want a mix of exits: {layers}"
    memory = kv_block_bytes(llm, 4) * 9
    tight, got = _generate(
        layered, PROMPTS, MIXED, kv_fill=kv_fill, block_size=4, kv_cache_memory=memory
    )
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    if kv_fill == "fill":  # recompute replays at full depth: exits may differ there
        assert [o.outputs[0].exit_layers for o in got] == [o.outputs[0].exit_layers for o in ref]


def test_recompute_debt_with_layer_heads(layered: Path) -> None:
    """Every position's K/V equals a full-depth pass up to its depth, and one layer more for an
    owed position: layer l + 1's attention wrote it from the exact h_l."""
    llm = make_llm(layered, kv_fill="recompute", enable_prefix_caching=False)
    engine = llm.engine
    seq = step_until_debt(engine, PROMPTS[0], MIXED)
    # An owed position has one layer more: layer l + 1's attention wrote it from the exact h_l.
    assert_cache_matches_hf(engine, seq, layered, owed_extra=1)
    engine.abort_request(seq.request_id)


# -- tuning -------------------------------------------------------------------------------------


def _opts(folder: Path, cache: Path, **kw: Any) -> TuneOptions:
    layer: dict[str, Any] = dict(adapter="layer", layer_lr=1e-3)
    return tiny_tune_options(folder, cache, LAYERS, **(layer | kw))


@pytest.mark.slow
def test_tune_exits_with_layer_heads(tiny_varied_dir: Path, tmp_path: Path) -> None:
    """``eeserve tune-exits --adapter layer`` end to end: trained heads that beat the logit lens,
    the sidecar and report written into the model folder, the base untouched, the engine using
    it."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_varied_dir, folder)
    before = base_weight_hashes(folder)
    argv = [
        "tune-exits", str(folder), "--exit-layers", "1,2", "--out", str(folder),
        "--adapter", "layer", "--layer-lr", "1e-3", "--tokens", "600", "--heldout-tokens", "300",
        "--steps", "60", "--batch-size", "64", "--lr", "3e-3", "--max-tokens", "24",
        "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    report = json.loads((folder / "tune_report.json").read_text())
    assert (report["options"]["adapter"], report["options"]["layer_lr"]) == ("layer", 1e-3)
    assert base_weight_hashes(folder) == before
    for stats in report["training"].values():
        assert stats["last_loss"] < stats["first_loss"], stats
    for row in report["layers"]:  # the layer head beats the logit lens at its exit layer
        assert row["kl_tuned"] < row["kl_shared"], row
    found = load_sidecar(folder)
    assert found is not None
    cfg, weights = found
    assert (cfg.adapter, cfg.adapter_rank, cfg.exit_layers) == ("layer", 128, LAYERS)
    assert "heads.2.adapter.mlp.gate_up_proj.weight" in weights
    assert "Layer heads:" in (folder / "tune_report.md").read_text()
    # The engine loads and uses it.
    _, (out,) = _generate(folder, PROMPTS[:1], ExitParams(threshold=0.0, exit_layers=[2]))
    assert out.outputs[0].exit_layers[1:] == [2] * 11


def test_layer_head_training_and_sidecar_round_trip(tiny_varied_dir: Path, tmp_path: Path) -> None:
    model, mcfg = load_model(tiny_varied_dir, torch.float32, torch.device("cpu"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = _cfg(mcfg)
    heads = init_heads(cfg, model)
    init = {k: v.clone() for k, v in heads.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    groups = [
        Group([1, 2], [torch.randint(3, 300, (40,), generator=gen).tolist()]) for _ in range(12)
    ]
    data = collect(model, groups, LAYERS, topk=8, mid=True)
    stats = tune_layers(model, heads, data, data, _opts(tiny_varied_dir, tmp_path, steps=20))
    assert all(s["last_loss"] < s["first_loss"] for s in stats.values()), stats
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    trained = heads.state_dict()
    assert not torch.equal(
        trained["heads.1.adapter.mlp.down_proj.weight"],
        init["heads.1.adapter.mlp.down_proj.weight"],
    )
    save_sidecar(tmp_path / "side", cfg, heads)
    cfg2, heads2 = load_exit_setup([tmp_path / "side"], L, mcfg.hidden_size, mcfg.rms_norm_eps)
    assert cfg2 == cfg and heads2 is not None
    h = torch.randn(5, mcfg.hidden_size)
    with torch.no_grad():
        for layer in LAYERS:
            assert torch.equal(
                model.lm_head(heads.normed(layer, h)), model.lm_head(heads2.normed(layer, h))
            )
            assert torch.equal(heads.probe(layer, h), heads2.probe(layer, h))
