"""Whole decoder layers in one kernel call (``kernels.fused``) equal the module path exactly; a
pass of decode rows runs its layers in one call (``csrc/decode_stack.cpp``) with the same numbers
whatever the layer range, context length or thread count, and bad rows raise; exit checks between
the layers (``run_checked``) score as the check computed apart, leave the layers' output as it
is, and stop the pass at the first check where a row reaches its threshold. The kernel's
confidence of each measure it computes is held against ``measures.confidence``, the engine's."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from eeserve import LLM
from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.engine.kernel_route import Kernel, route_pass
from eeserve.engine.measures import confidence
from eeserve.kernels.fused import CheckedSpan, FusedCall, FusedDecoder, PassAttention, StackCheck
from eeserve.kernels.gguf_linear import GGUFLinear
from eeserve.kernels.native import NativeOps, load
from eeserve.kernels.packing import NativeRMSNorm, PackedLinear, pack_for_cpu, use_native_ops
from eeserve.kernels.quant import Int8Linear, quantize_model
from eeserve.kernels.stack_layout import StackArch, StackMeasure
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.gguf_weights import BlockWeight, GGMLType
from eeserve.models.llama import LlamaForCausalLM, RMSNorm, Rotary

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
    elif kind == "gguf":
        gguf_projections(model, ops)
    else:
        pack_for_cpu(model, ops)
    return model


# The formats of a gguf model's parts: qkv mixes three (one kernel call over the parts), the
# rest one each; every block format whose block is 32 weights (the tiny widths are 32k).
QKV_TYPES = (GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0)
OTHER_TYPES = {"o": GGMLType.Q5_0, "gate_up": GGMLType.Q5_1, "down": GGMLType.Q8_0}


def _blocks(weight: torch.Tensor, kind: GGMLType) -> BlockWeight:
    """``weight`` [N, K] quantized by the gguf package into ``kind``'s blocks."""
    blocks = quantize(weight.detach().numpy(), GGMLQuantizationType(int(kind)))
    return BlockWeight(ggml_type=kind, blocks=torch.from_numpy(blocks), in_features=weight.shape[1])


def gguf_projections(model: LlamaForCausalLM, ops: NativeOps) -> None:
    """The model's projections on GGUF blocks of its own weights; the head stays float32."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w = attn.qkv_proj.weight
        cuts = (attn.q_size, attn.q_size + (w.shape[0] - attn.q_size) // 2, w.shape[0])
        rows = [w[a:b] for a, b in zip((0, *cuts[:2]), cuts)]
        qkv = GGUFLinear([_blocks(r, t) for r, t in zip(rows, QKV_TYPES)], ops)
        attn.qkv_proj = qkv  # type: ignore[assignment]
        attn.kv_proj = GGUFLinear(qkv.rows_from(attn.q_size), ops)
        attn.o_proj = GGUFLinear([_blocks(attn.o_proj.weight, OTHER_TYPES["o"])], ops)  # type: ignore[assignment]
        gate_up = _blocks(mlp.gate_up_proj.weight, OTHER_TYPES["gate_up"])
        mlp.gate_up_proj = GGUFLinear([gate_up], ops)  # type: ignore[assignment]
        down = _blocks(mlp.down_proj.weight, OTHER_TYPES["down"])
        mlp.down_proj = GGUFLinear([down], ops)  # type: ignore[assignment]


def _cache(ops: NativeOps, slots: int = 64) -> PagedKVCache:
    kv = PagedKVCache(CFG.num_layers, slots, CFG.num_kv_heads, CFG.head_dim, torch.float32,
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


@pytest.mark.parametrize("kind", ["float32", "int8", "gguf"])
@pytest.mark.parametrize(
    ("pass_", "call"),
    [
        (_decode_rows, FusedCall.STACK),
        (_decode_rows, FusedCall.LAYERS),
        (_mixed, FusedCall.LAYERS),
        (_prompt, FusedCall.LAYERS),
    ],
)
def test_fused_layers_equal_the_module_path(
    ops: NativeOps, kind: str, pass_: object, call: FusedCall
) -> None:
    model = _model(ops, kind)
    fused = FusedDecoder.build(model, ops)
    assert fused is not None
    meta = pass_()  # type: ignore[operator]
    plan = meta.pass_attention()
    assert plan is not None
    assert fused.stacks(plan) == (pass_ is _decode_rows)
    pos = torch.tensor([p for s in meta.spans for p in s.q_positions])
    cos, sin = (t[pos] for t in rope_tables(CFG, 16))
    h = torch.randn(len(pos), CFG.hidden_size)
    ref_kv, got_kv = _cache(ops), _cache(ops)
    with torch.inference_mode():
        ref = h
        for layer in model.layers:
            ref = layer(ref, Rotary(cos, sin), partial(ref_kv.attend, meta=meta))
        got = fused.run(call, h, cos, sin, got_kv.k, got_kv.v, plan)
        part = fused.run(call, h, cos, sin, _cache(ops).k, _cache(ops).v, plan, start=0, end=2)
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


SLOTS = 256  # room for a 75-position context scattered over the pool


def _long_decode_rows() -> AttnMeta:
    """Three decode rows with contexts of 6, 40 and 75 positions (one, two and three attention
    tasks of 32 positions), the last one's context scattered over the pool."""
    scattered = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(2))[:75]
    spans = [
        SeqSpan([0], [5], torch.arange(0, 6), False),
        SeqSpan([1], [39], torch.arange(100, 140), False),
        SeqSpan([2], [74], scattered, False),
    ]
    slots = torch.stack([torch.tensor(5), torch.tensor(139), scattered[-1]])
    meta = AttnMeta.build(spans, slots, max_rows=8)
    assert meta.rowwise == [True, True, True]
    return meta


def _inputs(meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pos = torch.tensor([p for s in meta.spans for p in s.q_positions])
    cos, sin = (t[pos] for t in rope_tables(CFG, CFG.max_position_embeddings))
    torch.manual_seed(3)
    return torch.randn(len(pos), CFG.hidden_size), cos, sin


@pytest.mark.parametrize("kind", ["float32", "int8", "gguf"])
@pytest.mark.parametrize("call", list(FusedCall))
@pytest.mark.parametrize(("start", "end"), [(0, 3), (1, 3), (1, 2)])
def test_a_layer_range_of_decode_rows_equals_the_module_path(
    ops: NativeOps, kind: str, call: FusedCall, start: int, end: int
) -> None:
    model = _model(ops, kind)
    fused = FusedDecoder.build(model, ops)
    assert fused is not None
    meta = _long_decode_rows()
    plan = meta.pass_attention()
    assert plan is not None and plan.row_idx is None and not plan.span_starts
    h, cos, sin = _inputs(meta)
    ref_kv, got_kv = _cache(ops, SLOTS), _cache(ops, SLOTS)
    with torch.inference_mode():
        ref = h
        for layer in model.layers[start:end]:
            ref = layer(ref, Rotary(cos, sin), partial(ref_kv.attend, meta=meta))
        got = fused.run(call, h, cos, sin, got_kv.k, got_kv.v, plan, start, end)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(got_kv.k, ref_kv.k, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_kv.v, ref_kv.v, rtol=0, atol=1e-6)


def _decode_pass(
    ops: NativeOps, kind: str
) -> tuple[FusedDecoder, PassAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused decoder of a ``kind`` model, the three long decode rows' pass (one call for
    its layers) and their inputs (h, cos, sin)."""
    fused = FusedDecoder.build(_model(ops, kind), ops)
    assert fused is not None
    meta = _long_decode_rows()
    plan = meta.pass_attention()
    assert plan is not None and fused.stacks(plan)
    return (fused, plan, *_inputs(meta))


Args = dict[str, object]  # an op's keyword arguments


def _stack_args(ops: NativeOps, kv: PagedKVCache, kind: str = "int8") -> Args:
    """decode_stack's keyword arguments for the ``kind`` model's three layers over the long
    decode rows, writing to ``kv``."""
    fused, plan, h, cos, sin = _decode_pass(ops, kind)
    return fused._stack_args(h, cos, sin, kv.k, kv.v, plan, None, 0, CFG.num_layers)


@pytest.mark.parametrize("kind", ["int8", "gguf"])
def test_the_output_does_not_depend_on_the_thread_count(ops: NativeOps, kind: str) -> None:
    """Threads claim tiles and attention tasks as they come; each is computed by the same code
    whoever claims it, so one thread and several give the same bits."""
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            kv = _cache(ops, SLOTS)
            args = _stack_args(ops, kv, kind)
            with torch.inference_mode():
                outs.append((ops.ops.decode_stack(**args), kv.k.clone(), kv.v.clone()))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        for got, ref in zip(out, outs[0]):
            assert torch.equal(got, ref)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {"row_lens": torch.tensor([1, 0, 1])}, "row length 0 outside"),
        (lambda a: {"slot_mapping": torch.tensor([5, SLOTS, 3])}, f"slot {SLOTS} outside the pool"),
        (lambda a: {"weights": a["weights"][:10]}, "11 tensors per layer"),
        (lambda a: {"first_layer": 2}, "layers past the pool"),
        (lambda a: {"h": a["h"][:, :32]}, "decode_stack"),
        (lambda a: {"arch": 2}, "arch 0 \\(Llama\\) or 1 \\(Gemma 3\\)"),
        (lambda a: {"local_layers": [0, 1, 0]}, "one local flag per Gemma 3 layer, none for"),
        (lambda a: {"arch": StackArch.gemma3.value}, "14 tensors per layer"),
    ],
)
def test_bad_rows_raise_and_write_nothing(
    ops: NativeOps, change: Callable[[Args], Args], message: str
) -> None:
    kv = _cache(ops, SLOTS)
    args = _stack_args(ops, kv)
    args.update(change(args))
    before = kv.k.clone()
    with pytest.raises(RuntimeError, match=message), torch.inference_mode():
        ops.ops.decode_stack(**args)
    assert torch.equal(kv.k, before)


K = 24  # shortlist rows of the checks below


Reference = Callable[[torch.Tensor], torch.Tensor]


def _check(
    ops: NativeOps, kind: str, measure: str, with_pre: bool, seed: int
) -> tuple[StackCheck, Reference]:
    """A random check, and the confidence it must give the rows h [R, D]: the engine's
    ``measures.confidence`` of the check's logits (or probe logit) computed apart."""
    gen = torch.Generator().manual_seed(seed)
    d = CFG.hidden_size
    if measure == "classifier":
        w, b = torch.randn(d, generator=gen), torch.randn(1, generator=gen)
        return StackCheck.classifier(w, b), lambda h: confidence(measure, None, h, h, h @ w + b)

    def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
        return Int8Linear(weight, bias, ops) if kind == "int8" else PackedLinear(weight, bias, ops)

    pre = linear(torch.randn(d, d, generator=gen) * 0.2, torch.randn(d, generator=gen))
    norm = NativeRMSNorm(RMSNorm(d, 1e-5).requires_grad_(False), ops)
    rows = linear(torch.randn(K, d, generator=gen), None)

    def reference(h: torch.Tensor) -> torch.Tensor:
        logits = rows(norm(pre(h) if with_pre else h))
        return confidence(measure, logits, h, h, None)

    check = StackCheck.shortlist(pre if with_pre else None, norm, rows)
    assert check is not None
    return check, reference


# Every measure the kernel computes (a shortlist with its adapter for the margin, without for the
# top probability), so that the test below holds each one against ``measures.confidence``.
CHECKS = [(m.name, m is StackMeasure.shortlist_margin) for m in StackMeasure]


def _span(
    checks: list[StackCheck],
    measure: str,
    thresholds: torch.Tensor,
    layers: list[int] | None = None,
) -> CheckedSpan:
    """The checks after layers 1 and 2 (or ``layers``) of the K-row shortlist or the probe."""
    return CheckedSpan(
        layers=layers or [1, 2],
        checks=checks,
        measure=measure,
        shortlist_rows=K,
        thresholds=thresholds,
    )


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize(("measure", "with_pre"), CHECKS)
def test_checks_between_layers_score_as_the_check_apart(
    ops: NativeOps, kind: str, measure: str, with_pre: bool
) -> None:
    fused, plan, h, cos, sin = _decode_pass(ops, kind)
    made = [_check(ops, kind, measure, with_pre, seed) for seed in (4, 5)]
    never = torch.full((2, 3), float("inf"))
    span = _span([c for c, _ in made], measure, never)
    ref_kv, got_kv = _cache(ops, SLOTS), _cache(ops, SLOTS)
    with torch.inference_mode():
        got, conf, stopped = fused.run_checked(h, cos, sin, got_kv.k, got_kv.v, plan, 0, 3, span)
        ref = fused.run(FusedCall.STACK, h, cos, sin, ref_kv.k, ref_kv.v, plan, 0, 3)
        assert stopped == -1
        assert torch.equal(got, ref) and torch.equal(got_kv.k, ref_kv.k)
        for c, (layer, (_, reference)) in enumerate(zip(span.layers, made)):
            kv_c = _cache(ops, SLOTS)
            h_c = fused.run(FusedCall.STACK, h, cos, sin, kv_c.k, kv_c.v, plan, 0, layer)
            torch.testing.assert_close(conf[c], reference(h_c), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("measure", "with_pre"), CHECKS)
def test_a_row_at_its_threshold_stops_the_pass_there(
    ops: NativeOps, measure: str, with_pre: bool
) -> None:
    """Row 1 reaches its threshold at the first check (exactly its confidence: >= counts):
    the pass returns layer 1's output, the second check and layers 2-3 never run."""
    fused, plan, h, cos, sin = _decode_pass(ops, "float32")
    checks = [_check(ops, "float32", measure, with_pre, seed)[0] for seed in (4, 5)]
    never = torch.full((2, 3), float("inf"))
    first_kv, kv = _cache(ops, SLOTS), _cache(ops, SLOTS)
    with torch.inference_mode():
        span = _span(checks, measure, never)
        _, conf, _ = fused.run_checked(h, cos, sin, _cache(ops, SLOTS).k, _cache(ops, SLOTS).v,
                                       plan, 0, 3, span)  # fmt: skip
        at = never.clone()
        at[0, 1] = conf[0, 1]
        span = _span(checks, measure, at)
        got, got_conf, stopped = fused.run_checked(h, cos, sin, kv.k, kv.v, plan, 0, 3, span)
        ref = fused.run(FusedCall.STACK, h, cos, sin, first_kv.k, first_kv.v, plan, 0, 1)
    assert stopped == 0
    assert torch.equal(got, ref) and torch.equal(kv.k, first_kv.k) and torch.equal(kv.v, first_kv.v)
    assert torch.equal(got_conf[0], conf[0]) and got_conf[1].isnan().all()


@pytest.mark.parametrize(
    ("layers", "rows", "message"),
    [([1, 2], 2, r"thresholds \[checks, R\]"), ([2, 1], 3, "check layers increasing")],
)
def test_bad_checks_raise_and_write_nothing(
    ops: NativeOps, layers: list[int], rows: int, message: str
) -> None:
    fused, plan, h, cos, sin = _decode_pass(ops, "float32")
    checks = [_check(ops, "float32", "shortlist_margin", True, seed)[0] for seed in (4, 5)]
    span = _span(checks, "shortlist_margin", torch.zeros(2, rows), layers)
    kv = _cache(ops, SLOTS)
    before = kv.k.clone()
    with pytest.raises(RuntimeError, match=message), torch.inference_mode():
        fused.run_checked(h, cos, sin, kv.k, kv.v, plan, 0, 3, span)
    assert torch.equal(kv.k, before)


def test_the_route_names_the_kernel_and_why_not() -> None:
    """``kernel_route.route_pass`` is the one decision: decode rows alone take decode_stack, a
    pass with prompt rows one kernel call per layer, no fused decoder the modules; below
    decode_stack it says why."""
    ops = load()
    assert ops is not None
    fused = FusedDecoder.build(_model(ops, "float32"), ops)
    assert fused is not None
    decode = route_pass(fused, _decode_rows())
    assert decode.kernel is Kernel.DECODE_STACK and not decode.why_not_stack
    for meta in (_mixed(), _prompt()):
        route = route_pass(fused, meta)
        assert route.kernel is Kernel.LAYER_KERNELS and "prompt rows" in route.why_not_stack
    plain = route_pass(None, _decode_rows())
    assert plain.kernel is Kernel.MODULES and plain.attention is None and plain.why_not_stack
