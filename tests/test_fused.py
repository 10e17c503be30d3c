"""Whole decoder layers in one kernel call (``kernels.fused``) equal the module path exactly."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from eeserve import LLM
from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.kernels.fused import FusedDecoder
from eeserve.kernels.native import NativeOps, load
from eeserve.kernels.packing import PackedLinear, pack_for_cpu, use_native_ops
from eeserve.kernels.quant import quantize_model
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.llama import LlamaForCausalLM, Rotary

CFG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=True,  # the fused QKV's bias goes through too
)


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    native = load()
    if native is None:
        pytest.skip("CPU kernels unavailable")
    return native


def _model(ops: NativeOps, kind: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    use_native_ops(model, ops)
    if kind == "int8":
        quantize_model(model, ops)
    else:
        pack_for_cpu(model, ops)
    return model


def _cache(ops: NativeOps) -> PagedKVCache:
    kv = PagedKVCache(CFG.num_layers, 64, CFG.num_kv_heads, CFG.head_dim, torch.float32,
                      torch.device("cpu"), ops)  # fmt: skip
    torch.manual_seed(1)
    kv.k.normal_()
    kv.v.normal_()
    return kv


def _decode_rows() -> AttnMeta:
    """Two decode rows: positions 5 and 9 of sequences whose contexts sit at slots 0.. and 40..."""
    spans = [
        SeqSpan([0], [5], torch.arange(0, 6), False),
        SeqSpan([1], [9], torch.arange(40, 50), False),
    ]
    meta = AttnMeta.build(spans, torch.tensor([5, 49]), max_rows=8)
    assert meta.rowwise == [True, True]
    return meta


def _mixed() -> AttnMeta:
    """A decode row, a 12-row chunk (positions 4..15 after a cached prefix, slots 20..35), a
    fresh 10-row prompt (slots 50..59) and a 3-row span attended row by row (positions 7..9)."""
    chunk = torch.arange(20, 36)
    spans = [
        SeqSpan([0], [5], torch.arange(0, 6), False),
        SeqSpan(list(range(1, 13)), list(range(4, 16)), chunk, False),
        SeqSpan(list(range(13, 23)), list(range(10)), torch.arange(50, 60), True),
        SeqSpan([23, 24, 25], [7, 8, 9], torch.arange(40, 50), False),
    ]
    slots = torch.cat([torch.tensor([5]), chunk[4:], torch.arange(50, 60), torch.arange(47, 50)])
    meta = AttnMeta.build(spans, slots, max_rows=8)
    assert meta.rowwise is not None and sum(meta.rowwise) == 4
    return meta


def _prompt() -> AttnMeta:
    """A fresh prompt alone: one span over every row."""
    return AttnMeta.build([SeqSpan(list(range(10)), list(range(10)), torch.arange(50, 60), True)],
                          torch.arange(50, 60), max_rows=8)  # fmt: skip


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("pass_", [_decode_rows, _mixed, _prompt])
def test_fused_layers_equal_the_module_path(ops: NativeOps, kind: str, pass_: object) -> None:
    model = _model(ops, kind)
    fused = FusedDecoder.build(model, ops)
    assert fused is not None
    meta = pass_()  # type: ignore[operator]
    plan = meta.pass_attention()
    assert plan is not None
    pos = torch.tensor([p for s in meta.spans for p in s.q_positions])
    cos, sin = (t[pos] for t in rope_tables(CFG, 16))
    h = torch.randn(len(pos), CFG.hidden_size)
    ref_kv, got_kv = _cache(ops), _cache(ops)
    with torch.inference_mode():
        ref = h
        for layer in model.layers:
            ref = layer(ref, Rotary(cos, sin), partial(ref_kv.attend, meta=meta))
        got = fused.run(h, cos, sin, got_kv.k, got_kv.v, plan)
        part = fused.run(h, cos, sin, _cache(ops).k, _cache(ops).v, plan, start=0, end=2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(got_kv.k, ref_kv.k, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_kv.v, ref_kv.v, rtol=0, atol=1e-6)
    assert not torch.equal(part, got)  # a layer range stops where asked


def test_reordered_span_rows_take_the_module_path() -> None:
    """An exit loop's subset may list a span's rows out of order: no plan for the kernel."""
    spans = [SeqSpan([0, 2, 1, 3, *range(4, 12)], list(range(12)), torch.arange(12), True)]
    assert AttnMeta.build(spans, torch.arange(12), max_rows=8).pass_attention() is None


def test_no_fused_decoder_without_the_engine_kernels(ops: NativeOps) -> None:
    torch.manual_seed(0)
    plain = LlamaForCausalLM(CFG)  # dense nn.Linear projections, PyTorch norms
    assert FusedDecoder.build(plain, ops) is None
    assert FusedDecoder.build(_model(ops, "float32"), None) is None


def test_engine_runs_tiny_float32_models_through_the_fused_decoder(
    ops: NativeOps, tiny_varied_dir: Path
) -> None:
    """With the engine's kernels a float32 model of any size takes the float32 kernel and the
    whole-layer calls, so the tiny models of the suite test the same path as the real one."""
    runner = LLM(str(tiny_varied_dir), enable_prefix_caching=False).engine.runner
    assert runner.stack.fused is not None
    assert isinstance(runner.model.layers[0].mlp.down_proj, PackedLinear)
    plain = LLM(str(tiny_varied_dir), enable_prefix_caching=False, cpu_kernels=False)
    assert plain.engine.runner.stack.fused is None
