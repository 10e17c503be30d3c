"""GGUF block formats in the engine's kernels (``csrc/gguf_ops.cpp``, ``kernels.gguf_linear``).

- De-quantization equals the ``gguf`` package's reference (``gguf.quants.dequantize``, what the
  loader's conversion runs) bit for bit, for every supported format, on random blocks.
- The linear op equals F.linear on the de-quantized weights within float tolerance, through
  both of its loops (few rows decoded in registers, more rows from a decoded tile), at 1, 2 and 3
  threads, into a column slice of a wider output.
- A projection of parts stacked along the output (mixed formats) is one flat buffer and a parts
  table; a table that does not fit its bytes, or names a format the kernels do not decode, is
  refused.
- A type the kernels do not decode is refused with its name; the Llama q/k row order equals
  transformers' own un-permutation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize

from eeserve.kernels.gguf_linear import GGUFEmbedding, GGUFLinear
from eeserve.kernels.native import NativeOps, load
from eeserve.models.config import ModelConfig
from eeserve.models.gguf_weights import (
    BlockWeight,
    GGMLType,
    UnsupportedBlockType,
    hf_row_order,
    read_block_weights,
)

# (weights per block, bytes per block, byte offsets of the block's fp16 scales)
GEOMETRY = {
    GGMLType.Q4_0: (32, 18, (0,)),
    GGMLType.Q4_1: (32, 20, (0, 2)),
    GGMLType.Q5_0: (32, 22, (0,)),
    GGMLType.Q5_1: (32, 24, (0, 2)),
    GGMLType.Q8_0: (32, 34, (0,)),
    GGMLType.Q4_K: (256, 144, (0, 2)),
    GGMLType.Q6_K: (256, 210, (208,)),
}


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    native = load()
    assert native is not None, "the CPU kernels did not build (see the log for the error)"
    return native


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def random_blocks(kind: GGMLType, rows: int, k: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quants and scales, the fp16 scales finite (the reference
    computes in numpy, whose inf/nan warnings are no part of the test)."""
    qk, size, scales = GEOMETRY[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // qk, size), dtype=np.uint8)
    for off in scales:
        half = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(kind: GGMLType, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType(int(kind))))


def assert_float_sum_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w^T up to float32 summation order: within K float32 roundings of the sum of
    the products' magnitudes (the bound on any order's error)."""
    ref = F.linear(x.double(), w.double())
    bound = F.linear(x.double().abs(), w.double().abs()) * x.shape[1] * 2.0**-24 + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"error {float((err / bound).max()):.2f}x the bound"


@pytest.mark.parametrize("kind", list(GGMLType), ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_reference_bit_for_bit(ops: NativeOps, kind: GGMLType) -> None:
    for seed, (rows, k) in enumerate([(1, 256), (37, 512), (64, 1536)]):
        blocks = random_blocks(kind, rows, k, seed)
        got = ops.gguf_dequantize(torch.from_numpy(blocks), int(kind), k)
        ref = reference(kind, blocks)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), kind.name


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("kind", list(GGMLType), ids=lambda t: t.name)
def test_linear_equals_f_linear_on_the_dequantized_weights(
    ops: NativeOps, kind: GGMLType, threads: int
) -> None:
    n, k = 75, 512  # 75 channels: whole tiles and a ragged end
    blocks = random_blocks(kind, n, k, seed=3)
    w = reference(kind, blocks)
    gen = torch.Generator().manual_seed(threads)
    for m in (1, 2, 3, 4, 5, 8, 13, 32):
        x = torch.randn(m, k, generator=gen)
        out = torch.full((m, n + 7), float("nan"))
        ops.gguf_linear(x, torch.from_numpy(blocks), int(kind), out[:, 3 : 3 + n])
        assert_float_sum_close(out[:, 3 : 3 + n], x, w)
        assert out[:, :3].isnan().all() and out[:, 3 + n :].isnan().all(), "wrote outside"


def test_modules_stack_parts_of_mixed_formats(ops: NativeOps) -> None:
    """A fused projection whose parts differ in format (Q4_K_M keeps some in Q6_K); the
    embedding and ``weight[ids]`` give de-quantized rows bit for bit."""
    k = 256
    parts = [
        BlockWeight(
            ggml_type=kind, blocks=torch.from_numpy(random_blocks(kind, n, k, i)), in_features=k
        )
        for i, (kind, n) in enumerate(
            [(GGMLType.Q4_K, 40), (GGMLType.Q6_K, 24), (GGMLType.Q6_K, 8)]
        )
    ]
    w = torch.cat([reference(p.ggml_type, p.blocks.numpy()) for p in parts])
    lin = GGUFLinear(parts, ops)
    assert [p.ggml_type for p in lin.parts] == [GGMLType.Q4_K, GGMLType.Q6_K]  # one call a format
    x = torch.randn(6, k)
    assert_float_sum_close(lin(x), x, w)
    tail = GGUFLinear(lin.rows_from(30), ops)  # a K/V-only projection's rows, as views
    assert tail.parts[0].blocks.data_ptr() == lin.parts[0].blocks[30:].data_ptr()
    assert_float_sum_close(tail(x), x, w[30:])
    ids = torch.tensor([0, 39, 40, 63, 5])
    assert torch.equal(lin.weight[ids], w[ids])
    emb = GGUFEmbedding(parts[1], ops)
    assert torch.equal(emb(torch.tensor([[3, 1]])), w[40:][torch.tensor([[3, 1]])])


def test_a_parts_table_that_does_not_fit_its_blocks_is_refused(ops: NativeOps) -> None:
    blocks = torch.from_numpy(random_blocks(GGMLType.Q8_0, 8, 64, 0)).reshape(-1)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    ops.gguf_stacked_linear(x, blocks, torch.tensor([[int(GGMLType.Q8_0), 8]]), out)
    with pytest.raises(RuntimeError, match="the parts' rows are 612 bytes, blocks has 544"):
        ops.gguf_stacked_linear(x, blocks, torch.tensor([[int(GGMLType.Q8_0), 9]]), out)
    with pytest.raises(RuntimeError, match="ggml type 11 is not supported"):
        ops.gguf_stacked_linear(x, blocks, torch.tensor([[11, 8]]), out)
    with pytest.raises(RuntimeError, match=r"parts int64 \[P, 2\]"):
        ops.gguf_stacked_linear(x, blocks, torch.tensor([int(GGMLType.Q8_0), 8]), out)


def test_an_unsupported_type_is_refused_by_name(ops: NativeOps, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="ggml type 11 is not supported"):
        ops.gguf_dequantize(torch.zeros(1, 110, dtype=torch.uint8), 11, 256)  # Q3_K
    path = tmp_path / "q3.gguf"
    writer = GGUFWriter(str(path), "llama")
    q3 = GGMLQuantizationType.Q3_K
    writer.add_tensor("token_embd.weight", np.zeros((4, 110), np.uint8), raw_dtype=q3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 4,
        }
    )
    with pytest.raises(UnsupportedBlockType, match=r"token_embd\.weight is stored as Q3_K"):
        read_block_weights(path, cfg)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_llama_rows_are_put_back_in_transformers_order(heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = heads * 8
    gguf_rows = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    proc = LlamaTensorProcessor(config={"num_attention_heads": heads})
    hf = proc._reverse_permute_weights(gguf_rows, heads, heads)
    assert np.array_equal(gguf_rows[hf_row_order(rows, heads).numpy()], hf)
