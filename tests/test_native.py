"""The engine's CPU kernels (eeserve/csrc/cpu_ops.cpp) against the PyTorch arithmetic they replace.

They must build here: CI has gcc and installs ninja, so a build failure fails these tests rather
than silently falling back. ``EESERVE_NATIVE=0`` (kernels deliberately off) skips them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eeserve.engine import attention
from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.kernels.native import NativeOps, load
from eeserve.models.gemma3 import gelu_tanh_and_mul
from eeserve.models.llama import Rotary, apply_rotary, silu_and_mul
from tests.tiny_model import make_llm

if os.environ.get("EESERVE_NATIVE") == "0":
    pytest.skip("CPU kernels switched off (EESERVE_NATIVE=0)", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    native = load()
    assert native is not None, "the CPU kernels did not build (see the log for the error)"
    return native


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    err = (a.float() - b.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, b.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rms_norm(ops: NativeOps, dtype: torch.dtype, rows: int) -> None:
    x = torch.randn(rows, 72).to(dtype) * 3
    w = (1 + 0.3 * torch.randn(72)).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # HF
    close(ops.rms_norm(x, w, 1e-6), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_a_strided_view_in_place(ops: NativeOps, dtype: torch.dtype) -> None:
    n, heads, rotated, hd = 7, 10, 6, 32
    fused = torch.randn(n, heads, hd).to(dtype)  # like q|k|v of one fused projection
    angles = torch.rand(n, hd // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    ref = apply_rotary(fused[:, :rotated], Rotary(cos, sin))
    out = fused.clone()
    ops.rotary_(out[:, :rotated], cos, sin)
    close(out[:, :rotated], ref, dtype)
    assert torch.equal(out[:, rotated:], fused[:, rotated:])  # the v heads are untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops: NativeOps, dtype: torch.dtype) -> None:
    gate_up = torch.randn(9, 2 * 40).to(dtype) * 4
    close(ops.silu_mul(gate_up), silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul(ops: NativeOps, dtype: torch.dtype) -> None:
    gate_up = torch.randn(9, 2 * 40).to(dtype) * 4
    close(ops.gelu_mul(gate_up), gelu_tanh_and_mul(gate_up), dtype)


def _reference_decode(q, k_pool, v_pool, slots, lens):  # type: ignore[no-untyped-def]
    out = []
    for s in range(q.shape[0]):
        ctx = slots[s, : lens[s]]
        k = k_pool[ctx].transpose(0, 1)  # [Hkv, T, hd]
        v = v_pool[ctx].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[s, :, None].float(), k.float(), v.float(), enable_gqa=True
        )
        out.append(o.squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize(("seqs", "heads", "kv_heads"), [(1, 4, 2), (6, 9, 3), (3, 4, 4)])
def test_decode_attention_reads_the_pool_in_place(
    ops: NativeOps, dtype: torch.dtype, hd: int, seqs: int, heads: int, kv_heads: int
) -> None:
    """Padded slot rows, contexts of different lengths (one of them 1, others split into several
    32-position tasks), GQA and plain MHA, one sequence and several, q rows strided as in a
    fused projection."""
    torch.manual_seed(hd + seqs)
    pool = 400
    k_pool = torch.randn(pool, kv_heads, hd).to(dtype)
    v_pool = torch.randn(pool, kv_heads, hd).to(dtype)
    lens = torch.tensor([1 + (137 * (s + 1)) % 300 for s in range(seqs)])
    t = int(lens.max())
    slots = torch.zeros(seqs, t, dtype=torch.long)
    for s in range(seqs):
        slots[s, : lens[s]] = torch.randperm(pool)[: int(lens[s])]
    fused = torch.randn(seqs, heads + 2 * kv_heads, hd).to(dtype)
    q = fused[:, :heads]
    out = ops.decode_attention(q, k_pool, v_pool, slots, lens, hd**-0.5)
    close(out, _reference_decode(q, k_pool, v_pool, slots, lens), dtype)


def test_a_decode_rows_attention_does_not_depend_on_its_batch(ops: NativeOps) -> None:
    """A row's tasks follow its own length: alone or among other rows, the same bits (so a
    verification's rows equal the positions decoded one by one)."""
    torch.manual_seed(3)
    k_pool, v_pool = torch.randn(300, 3, 64), torch.randn(300, 3, 64)
    lens = torch.tensor([150, 7, 290, 33])
    slots = torch.stack([torch.randperm(300)[:290] for _ in range(4)])
    q = torch.randn(4, 9, 64)
    together = ops.decode_attention(q, k_pool, v_pool, slots, lens, 0.125)
    for s in range(4):
        alone = ops.decode_attention(
            q[s : s + 1], k_pool, v_pool, slots[s : s + 1], lens[s : s + 1], 0.125
        )
        assert torch.equal(alone[0], together[s])


@pytest.mark.parametrize("max_rows", [64, 2])
def test_paged_cache_rowwise_paths_match_per_span_attention(
    ops: NativeOps, max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One decode-shaped step, one sequence also carrying owed positions (``recompute``): the
    kernel, the gathered-SDPA fallback and plain per-span attention give the same output, also
    for the exit loop's subset of rows. With ``max_rows`` 2 the 3-row span goes per span while
    the others go row by row, in the same step."""
    monkeypatch.setattr(attention, "ROWWISE_MAX_ROWS", max_rows)
    torch.manual_seed(0)
    caches = [
        PagedKVCache(2, 64, 2, 16, torch.float32, torch.device("cpu"), n) for n in (ops, None, None)
    ]
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
    ctx = [torch.randperm(64)[:n] for n in (5, 12, 1)]
    spans = [
        SeqSpan([0], [4], ctx[0], False),
        SeqSpan([1, 2, 3], [7, 9, 11], ctx[1], False),  # owed positions 7 and 9, then 11
        SeqSpan([4], [0], ctx[2], False),
    ]
    new_slots = torch.stack([ctx[0][4], ctx[1][7], ctx[1][9], ctx[1][11], ctx[2][0]])
    rowwise = AttnMeta.build(spans, new_slots)
    per_span = AttnMeta(new_slots, spans)
    assert rowwise.rowwise == [True, *([max_rows >= 3] * 3), True]
    assert per_span.row_slots is None
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    metas = (rowwise, rowwise, per_span)
    outs = [c.attend(1, q, k, v, m) for c, m in zip(caches, metas)]
    torch.testing.assert_close(outs[0], outs[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], atol=1e-6, rtol=1e-5)
    keep = [3, 0, 2]  # rows in any order, a sequence losing one of its rows
    subs = (rowwise.subset(keep), rowwise.subset(keep), per_span.subset(keep))
    outs = [c.attend(1, q[keep], k[keep], v[keep], m) for c, m in zip(caches, subs)]
    torch.testing.assert_close(outs[0], outs[2], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[2], atol=1e-6, rtol=1e-5)


def test_engine_switch(tiny_varied_dir: Path) -> None:
    """``cpu_kernels`` selects the path; both give the same greedy tokens (the HF oracle in
    test_engine_tiny runs both paths too)."""
    from eeserve.sampling_params import SamplingParams

    outs = []
    for on in (True, False):
        llm = make_llm(tiny_varied_dir, kv_cache_memory=16 * 2**20, cpu_kernels=on)
        assert (llm.engine.runner.kv.native is not None) is on
        params = SamplingParams(max_tokens=12, temperature=0.0)
        outs.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate(["a b c", "hello"], params, use_tqdm=False)
            ]
        )
    assert outs[0] == outs[1]


def _reference_span(q, k_pool, v_pool, slots, positions):  # type: ignore[no-untyped-def]
    ctx = len(slots)
    k = k_pool[slots].transpose(0, 1)[None].float()  # [1, Hkv, T, hd]
    v = v_pool[slots].transpose(0, 1)[None].float()
    hidden = torch.arange(ctx)[None, :] > positions[:, None]
    bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[None, None]
    qs = q.transpose(0, 1)[None].float()  # [1, H, n, hd]
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=bias, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize(
    ("start", "n", "ctx"),
    [
        (0, 150, 150),  # a whole prompt (several query tiles, last key block partial)
        (70, 37, 107),  # a chunk over a cached prefix that ends mid key block
        (0, 1, 1),  # one position seeing only itself
        (None, 3, 90),  # positions that are not consecutive (the exit loop's subset)
    ],
)
def test_span_attention_matches_causal_sdpa(
    ops: NativeOps,
    dtype: torch.dtype,
    hd: int,
    heads: int,
    kv_heads: int,
    start: int | None,
    n: int,
    ctx: int,
) -> None:
    """One sequence's queries over its context, read in place from a shuffled pool; query rows
    strided as in a fused projection; GQA and plain MHA; head sizes with and without the
    vector tiles."""
    torch.manual_seed(hd + n)
    pool = 300
    k_pool = torch.randn(pool, kv_heads, hd).to(dtype)
    v_pool = torch.randn(pool, kv_heads, hd).to(dtype)
    slots = torch.randperm(pool)[:ctx]
    positions = torch.tensor([5, 40, 89]) if start is None else torch.arange(start, start + n)
    fused = torch.randn(n, heads + 2 * kv_heads, hd).to(dtype)
    q = fused[:, :heads]
    out = ops.span_attention(q, k_pool, v_pool, slots, positions, hd**-0.5)
    close(out, _reference_span(q, k_pool, v_pool, slots, positions), dtype)


def test_span_attention_refuses_a_position_outside_the_context(ops: NativeOps) -> None:
    q, pool = torch.randn(2, 4, 16), torch.randn(10, 2, 16)
    with pytest.raises(RuntimeError, match="outside its context"):
        ops.span_attention(q, pool, pool, torch.arange(4), torch.tensor([2, 4]), 0.25)


def test_paged_cache_spans_through_the_kernel_match_sdpa(ops: NativeOps) -> None:
    """A pass with a whole prompt, a prompt chunk over its cached prefix and a decode row: the
    cache with the kernels (spans through ``span_attention``, the decode row row by row) gives
    SDPA's output, also for a subset of the rows."""
    caches = [
        PagedKVCache(2, 128, 2, 16, torch.float32, torch.device("cpu"), n) for n in (ops, None)
    ]
    for c in caches:
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
    perm = torch.randperm(128)
    ctx = [perm[:20], perm[20:70], perm[70:80]]
    spans = [
        SeqSpan(list(range(20)), list(range(20)), ctx[0], True),  # a whole prompt
        SeqSpan(list(range(20, 32)), list(range(38, 50)), ctx[1][:50], False),  # a chunk
        SeqSpan([32], [9], ctx[2], False),  # a decode row
    ]
    new_slots = torch.cat([ctx[0], ctx[1][38:50], ctx[2][9:10]])
    metas = [AttnMeta.build(spans, new_slots, max_rows=c.rowwise_max_rows) for c in caches]
    assert metas[0].rowwise == [False] * 32 + [True]  # 12 rows: per span with the kernel
    q, k, v = torch.randn(33, 4, 16), torch.randn(33, 2, 16), torch.randn(33, 2, 16)
    outs = [c.attend(1, q, k, v, m) for c, m in zip(caches, metas)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    # A subset keeps each row's output; [0, 2, 1, 3] lists the prompt's first rows out of order
    # (the exit loop may), which a span must not read as the slice 0:4.
    for keep in ([32, 25, 3, 4, 30], [0, 2, 1, 3]):
        subs = [m.subset(keep) for m in metas]
        for c, m, full in zip(caches, subs, outs):
            torch.testing.assert_close(
                c.attend(1, q[keep], k[keep], v[keep], m), full[keep], atol=1e-6, rtol=1e-5
            )
