"""``fill`` in one projection writes what paying layer by layer writes (Llama and Qwen2 biases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eeserve.engine.attention import PagedKVCache
from eeserve.engine.kv_fill import KVFiller
from eeserve.models.config import rope_tables
from eeserve.models.llama import Rotary
from eeserve.models.loader import load_model


@pytest.mark.parametrize("fixture", ["tiny_varied_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("first", [1, 2, 4])
def test_one_projection_equals_layer_by_layer(
    request: pytest.FixtureRequest, fixture: str, first: int
) -> None:
    folder: Path = request.getfixturevalue(fixture)
    model, cfg = load_model(folder, torch.float32, torch.device("cpu"))
    filler = KVFiller.build(model)
    assert filler is not None
    layers, slots = cfg.num_layers, torch.tensor([3, 7, 11])
    caches = [
        PagedKVCache(layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
        for _ in range(2)
    ]
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(cfg, 32)
    pos = torch.tensor([5, 9, 20])
    rot = Rotary(cos[pos], sin[pos])
    filler.pay(h, rot, first, caches[0], slots)
    for j, layer in enumerate(model.layers[first - 1 :], start=first):
        k, v = layer.kv_from_hidden(h, rot)
        caches[1].write(j - 1, slots, k, v)
    for pool in ("k", "v"):
        a, b = getattr(caches[0], pool), getattr(caches[1], pool)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        assert a[first - 1 :, slots].abs().sum() > 0  # something was written
        assert a[: first - 1].abs().sum() == 0  # and nothing below the first layer paid


def test_layers_it_cannot_fold_pay_layer_by_layer(tiny_varied_dir: Path) -> None:
    model, _ = load_model(tiny_varied_dir, torch.bfloat16, torch.device("cpu"))
    assert KVFiller.build(model) is None
