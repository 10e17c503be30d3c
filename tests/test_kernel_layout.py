"""The named hand-offs to the kernels (``kernels.stack_layout``) match the C++ side: the layer and
check dataclasses' fields are, in order, the tensors the kernels read (``stack_layout()``, from
``csrc/stack_layout.h``) and the layer ops' argument names; the measure and layer-type codes are
their positions there; and a decoder refuses to build on kernels that disagree."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from eeserve.exit_params import MEASURES
from eeserve.kernels.fused import FusedDecoder
from eeserve.kernels.native import NativeOps, load
from eeserve.kernels.stack_layout import (
    STACK_MEASURES,
    Gemma3LayerWeights,
    LlamaLayerWeights,
    StackArch,
    StackCheck,
    StackMeasure,
    check_layout,
)
from eeserve.models.config import ModelConfig
from eeserve.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    native = load()
    if native is None:
        pytest.skip("CPU kernels unavailable")
    return native


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def test_the_dataclasses_and_codes_are_the_kernels_tables(ops: NativeOps) -> None:
    archs, llama, gemma3, check, measures = ops.ops.stack_layout()
    assert _names(LlamaLayerWeights) == llama
    assert _names(Gemma3LayerWeights) == gemma3
    assert [n for n in _names(StackCheck) if n != "eps"] == check  # eps travels apart
    assert [StackArch(i).name for i in range(len(archs))] == archs
    assert [StackMeasure(i).name for i in range(len(measures))] == measures
    assert len(StackArch) == len(archs) and len(StackMeasure) == len(measures)


def test_the_layer_dataclasses_name_their_ops_arguments(ops: NativeOps) -> None:
    """``run`` calls decoder_layer / gemma3_layer with the fields as keyword arguments."""
    for name, cls in (("decoder_layer", LlamaLayerWeights), ("gemma3_layer", Gemma3LayerWeights)):
        args = [a.name for a in getattr(ops.ops, name).default._schema.arguments]
        assert [a for a in args if a in _names(cls)] == _names(cls)


def test_kernel_measures_are_engine_measures_by_name() -> None:
    """``measure in STACK_MEASURES`` is asked with the engine's measure names."""
    assert set(STACK_MEASURES) <= set(MEASURES)
    assert {name: int(code) for name, code in STACK_MEASURES.items()} == {
        m.name: m.value for m in StackMeasure
    }
    assert "hidden_cosine" not in STACK_MEASURES


def _model() -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("table", range(5))
def test_a_decoder_does_not_build_on_kernels_that_disagree(ops: NativeOps, table: int) -> None:
    """Each of stack_layout()'s tables, with two of its names swapped."""
    layout = [list(names) for names in ops.ops.stack_layout()]
    layout[table][0], layout[table][1] = layout[table][1], layout[table][0]
    real = ops.ops
    fake = SimpleNamespace(
        stack_layout=lambda: tuple(layout),
        decoder_layer=real.decoder_layer,
        gemma3_layer=real.gemma3_layer,
    )
    with pytest.raises(RuntimeError, match="disagree on"):
        FusedDecoder.build(_model(), NativeOps(fake))
    check_layout(ops)  # the real kernels agree


def test_a_layer_op_whose_arguments_differ_is_refused(ops: NativeOps) -> None:
    schema = SimpleNamespace(arguments=[SimpleNamespace(name=n) for n in ("h", "norm2", "norm1")])
    renamed = SimpleNamespace(default=SimpleNamespace(_schema=schema))
    fake = SimpleNamespace(
        stack_layout=ops.ops.stack_layout,
        decoder_layer=renamed,
        gemma3_layer=ops.ops.gemma3_layer,
    )
    with pytest.raises(RuntimeError, match="LlamaLayerWeights in decoder_layer"):
        check_layout(NativeOps(fake))
