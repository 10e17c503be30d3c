"""The screened LM head (eeserve/kernels/screened_head.py): its argmax is the float head's, ties
included, its kept logits are the float head's bit for bit, and the engine's greedy tokens do not
change with it. The real models' HF oracles (tests/test_real_model.py, tests/test_gemma3_real.py)
run greedy requests through it too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eeserve.kernels import screened_head
from eeserve.kernels.native import NativeOps, load
from eeserve.kernels.packing import PackedLinear
from eeserve.kernels.quant import Int8Linear, quantize_int8
from eeserve.kernels.screened_head import ScreenedHead, head_logits
from eeserve.sampling_params import SamplingParams
from tests.tiny_model import make_llm, random_prompt

if os.environ.get("EESERVE_NATIVE") == "0":
    pytest.skip("CPU kernels switched off (EESERVE_NATIVE=0)", allow_module_level=True)


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    native = load()
    assert native is not None, "the CPU kernels did not build (see the log for the error)"
    return native


def head_pair(
    ops: NativeOps, vocab: int, dim: int, seed: int
) -> tuple[torch.Tensor, PackedLinear, ScreenedHead]:
    g = torch.Generator().manual_seed(seed)
    # Rows of different norms, like a trained head: some ids stand out for a given direction.
    w = torch.randn(vocab, dim, generator=g) * torch.rand(vocab, 1, generator=g) * 0.2
    head = PackedLinear(w, None, ops)
    return w, head, ScreenedHead(head, w)


def peaked_inputs(w: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """Hidden states that point at some rows of ``w``, as a confident model's do."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, w.shape[0], (rows,), generator=g)
    return w[ids] * 30 + torch.randn(rows, w.shape[1], generator=g)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 16, 40])
@pytest.mark.parametrize("dim", [64, 72])  # 72: not a multiple of 32, one scale per row
def test_top_keeps_the_float_heads_argmax_and_bits(ops: NativeOps, rows: int, dim: int) -> None:
    w, head, screened = head_pair(ops, 8000, dim, seed=rows)
    x = peaked_inputs(w, rows, seed=dim)
    full, top = head(x), screened.top(x)
    assert torch.equal(top.argmax(-1), full.argmax(-1))
    kept = torch.isfinite(top)
    assert torch.equal(top[kept], full[kept])
    assert (kept.sum(-1) < 8000).all(), "the screen kept every id"


def test_ties_resolve_to_the_first_id_as_the_float_head(ops: NativeOps) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(640, 64, generator=g) * 0.1
    w[500] = w[37]  # an exact tie with a later id
    w[38] = w[37] * (1 + 1e-7)  # and near-ties around it
    w[600] = w[37] * (1 - 1e-7)
    head = PackedLinear(w, None, ops)
    screened = ScreenedHead(head, w)
    x = w[[37, 37, 500]] * 25
    full, top = head(x), screened.top(x)
    assert torch.equal(top.argmax(-1), full.argmax(-1))
    kept = torch.isfinite(top)
    assert kept[:, [37, 38, 500, 600]].all()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_bound_covers_the_screens_error(ops: NativeOps, scale: float) -> None:
    _, head, screened = head_pair(ops, 1024, 96, seed=3)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)) * scale
    x[:, :7] *= 100  # one group far larger than the rest
    err = (head(x) - screened.screen(x)).abs()
    assert (err <= screened.bound(x)).all()


@pytest.mark.parametrize(("vocab", "rows"), [(8010, 1), (8010, 7), (1000, 13), (40, 2)])
def test_screen_kernel_reduces_the_screens_logits_and_bound(
    ops: NativeOps, vocab: int, rows: int
) -> None:
    """int8_screen's per-tile max(a + b) and per-row max(a - b) are those of the int8 logits a
    and the bound b computed in full (a partial last tile, a partial last task of 16 tiles)."""
    w, _, screened = head_pair(ops, vocab, 64, seed=vocab + rows)
    x = peaked_inputs(w, rows, seed=rows)
    s = screened.screen
    hi, floor = ops.int8_screen(x, s.qweight, s.scale, vocab, screened.coeff(x), screened.row_scale)
    a, b = s(x), screened.bound(x)
    tiles = -(-vocab // 32)
    up = torch.nn.functional.pad(a + b, (0, tiles * 32 - vocab), value=float("-inf"))
    torch.testing.assert_close(hi, up.view(rows, tiles, 32).amax(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(floor, (a - b).amax(-1), rtol=1e-6, atol=1e-6)


def test_whole_head_when_the_screen_keeps_too_many_tiles(ops: NativeOps) -> None:
    _, head, screened = head_pair(ops, 512, 64, seed=5)
    x = torch.zeros(3, 64)  # every logit 0: every tile can hold the maximum
    assert torch.equal(screened.top(x), head(x))
    assert torch.equal(head_logits(screened, x, argmax_only=False), head(x))


def test_engine_greedy_tokens_do_not_change_with_the_screen(tiny_model_dir: Path) -> None:
    prompts = [random_prompt(9 + i, seed=i, vocab_size=320) for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = {}
    for screen in (False, True):
        llm = make_llm(tiny_model_dir, screen_head=screen)
        outs[screen] = [
            [c.outputs[0].token_ids for c in llm.generate(prompts, p, use_tqdm=False)]
            for p in (greedy, with_logprobs)
        ]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("kernel", [True, False])
def test_row_scales_are_each_rows_largest_scale_in_either_layout(
    ops: NativeOps, kernel: bool
) -> None:
    w = torch.randn(1000, 96, generator=torch.Generator().manual_seed(7))
    linear = Int8Linear(w, None, ops if kernel else None)
    assert torch.equal(linear.row_scales(), quantize_int8(w)[1].amax(dim=1))


def test_top_after_top_holds_only_the_second_calls_logits(ops: NativeOps) -> None:
    """``top`` writes one buffer kept across calls: a call after a larger one still has -inf
    everywhere but its own kept tiles (those of the earlier call are reset)."""
    w, head, screened = head_pair(ops, 4000, 64, seed=9)
    first, second = peaked_inputs(w, 6, seed=1), peaked_inputs(w, 3, seed=2)
    screened.top(first)
    again = screened.top(second)
    fresh = ScreenedHead(head, w).top(second)
    assert torch.equal(again, fresh)
    assert torch.equal(again.argmax(-1), head(second).argmax(-1))


def test_steps_above_keep_rows_leave_the_kept_buffer_alone(
    ops: NativeOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(screened_head, "KEEP_ROWS", 4)
    w, head, screened = head_pair(ops, 4000, 64, seed=10)
    small, large = peaked_inputs(w, 3, seed=3), peaked_inputs(w, 6, seed=4)
    screened.top(small)
    big = screened.top(large)  # a fresh tensor: the buffer still holds the small call's columns
    assert torch.equal(big, ScreenedHead(head, w).top(large))
    again = screened.top(peaked_inputs(w, 2, seed=5))
    assert torch.equal(again, ScreenedHead(head, w).top(peaked_inputs(w, 2, seed=5)))


def test_tiles_at_an_index_outside_the_weight_raise(ops: NativeOps) -> None:
    _, head, _ = head_pair(ops, 100, 64, seed=3)  # 4 tiles
    x = torch.randn(2, 64)
    assert torch.equal(ops.f32_tiles_at(x, head.packed, torch.tensor([3, 0])), torch.cat(
        [head(x)[:, 96:100], torch.zeros(2, 28), head(x)[:, :32]], 1))  # fmt: skip
    with pytest.raises(RuntimeError, match="tile 4 of 4"):
        ops.f32_tiles_at(x, head.packed, torch.tensor([0, 4]))


def _masks(full: torch.Tensor, seed: int) -> list[torch.Tensor | None]:
    """Per row: unconstrained; the row's maximum allowed; everything but the top 5 ids; three
    ids far from the maximum; one id; ids whose tiles hold none of the unmasked top."""
    g = torch.Generator().manual_seed(seed)
    v = full.shape[1]
    order = full.argsort(-1, descending=True)
    masks: list[torch.Tensor | None] = [None]
    rows = full.shape[0]
    for r in range(1, rows):
        ok = torch.zeros(v, dtype=torch.bool)
        kind = r % 5
        if kind == 0:
            ok[:] = True
        elif kind == 1:
            ok[:] = True
            ok[order[r, :5]] = False
        elif kind == 2:
            ok[order[r, -3:]] = True
        elif kind == 3:
            ok[int(torch.randint(0, v, (1,), generator=g))] = True
        else:
            ok[torch.randint(0, v, (40,), generator=g)] = True
            ok[order[r, :64]] = False
        masks.append(ok)
    return masks


@pytest.mark.parametrize("rows", [2, 6, 11])
def test_top_with_allowed_ids_keeps_the_masked_heads_argmax_and_bits(
    ops: NativeOps, rows: int
) -> None:
    """A constrained row's maximum over its allowed ids is the full head's, wherever the
    allowed ids lie against the unmasked maximum; the kept logits are the full head's bits."""
    w, head, screened = head_pair(ops, 8000, 64, seed=20 + rows)
    x = peaked_inputs(w, rows, seed=rows)
    full = head(x)
    masks = _masks(full, seed=rows)
    top = screened.top(x, masks).clone()
    for r, ok in enumerate(masks):
        want = full[r] if ok is None else full[r].masked_fill(~ok, float("-inf"))
        got = top[r] if ok is None else top[r].masked_fill(~ok, float("-inf"))
        assert int(got.argmax()) == int(want.argmax())
    kept = torch.isfinite(top)
    assert torch.equal(top[kept], full[kept])


def test_a_mask_off_the_top_ids_still_reads_few_tiles(ops: NativeOps) -> None:
    """Where the grammar refuses the row's favourite tokens but allows most others (a string's
    body refusing a quote), the floor from the kept tiles keeps the screen paying."""
    g = torch.Generator().manual_seed(31)
    w = torch.randn(8000, 64, generator=g) * 0.02
    d = torch.randn(4, 64, generator=g)
    w[[100, 4000, 7000, 7999]] = d  # each row's favourite token ...
    w[[2000, 5000, 300, 6100]] = d * 0.9  # ... and its runner-up, in another tile
    head = PackedLinear(w, None, ops)
    screened = ScreenedHead(head, w)
    x = d * 20
    full = head(x)
    masks: list[torch.Tensor | None] = []
    for r in range(4):
        ok = torch.ones(8000, dtype=torch.bool)
        ok[full[r].argmax()] = False  # the grammar refuses the favourite
        masks.append(ok)
    top = screened.top(x, masks)
    for r, ok in enumerate(masks):
        assert ok is not None
        got = top[r].masked_fill(~ok, float("-inf")).argmax()
        assert int(got) == int(full[r].masked_fill(~ok, float("-inf")).argmax())
    assert (torch.isfinite(top).sum(-1) < 8000 * screened_head.MAX_TILE_SHARE).all()


def test_a_tie_among_allowed_ids_resolves_to_the_first_as_the_masked_head(ops: NativeOps) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4000, 64, generator=g) * 0.1
    w[3100] = w[1200]  # two allowed ids that tie, far apart, neither the row's maximum
    head = PackedLinear(w, None, ops)
    screened = ScreenedHead(head, w)
    x = (w[7] * 40 + w[1200] * 20)[None]
    ok = torch.zeros(4000, dtype=torch.bool)
    ok[[3100, 1200, 3999]] = True
    got = screened.top(x, [ok])[0].masked_fill(~ok, float("-inf"))
    assert int(head(x)[0].argmax()) == 7
    assert int(got.argmax()) == 1200
