"""CPU weight packing keeps every projection's output (up to float rounding)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eeserve.kernels.native import load
from eeserve.kernels.packing import PackedLinear, can_pack, pack_linears


@pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32, 1024), reason="no oneDNN on this CPU build"
)
@pytest.mark.parametrize("kernel", ["engine", "onednn"])
def test_pack_linears_packs_big_layers_only_and_keeps_outputs(kernel: str) -> None:
    ops = load() if kernel == "engine" else None
    if kernel == "engine" and ops is None:
        pytest.skip("CPU kernels unavailable")
    torch.manual_seed(0)
    inner = nn.ModuleList([nn.Linear(1024, 768), nn.Linear(16, 16)])
    model = nn.ModuleDict({"big": nn.Linear(768, 1024, bias=False), "inner": inner})
    ref = copy.deepcopy(model)
    pack_linears(model, ops)
    assert isinstance(model["big"], PackedLinear)
    assert isinstance(model["inner"][0], PackedLinear)
    assert isinstance(model["inner"][1], nn.Linear)  # below the size bound: stays dense
    for rows in (1, 5):
        x = torch.randn(rows, 768)
        with torch.inference_mode():
            torch.testing.assert_close(model["big"](x), ref["big"](x), rtol=1e-5, atol=1e-5)
            y = torch.randn(rows, 1024)
            got, want = model["inner"][0](y), ref["inner"][0](y)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 12, 13, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [(40, 72), (96, 33), (1000, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_engine_float32_kernel_equals_f_linear(
    rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Every register-tile size (1-12 rows and the rest), channels past a multiple of 32, any K."""
    ops = load()
    if ops is None:
        pytest.skip("CPU kernels unavailable")
    w = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    lin = PackedLinear(w, b, ops)
    assert lin.ops is not None  # the engine's kernel, not oneDNN
    x = torch.randn(rows, in_features)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(lin(x), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
