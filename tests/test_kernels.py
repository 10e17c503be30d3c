"""CPU weight packing keeps every projection's output (up to float rounding)."""

import copy

import pytest
import torch
from torch import nn

from eeserve.kernels.packing import PackedLinear, can_pack, pack_linears


@pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32, 1024), reason="no oneDNN on this CPU build"
)
def test_pack_linears_packs_big_layers_only_and_keeps_outputs() -> None:
    torch.manual_seed(0)
    inner = nn.ModuleList([nn.Linear(1024, 768), nn.Linear(16, 16)])
    model = nn.ModuleDict({"big": nn.Linear(768, 1024, bias=False), "inner": inner})
    ref = copy.deepcopy(model)
    pack_linears(model)
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
