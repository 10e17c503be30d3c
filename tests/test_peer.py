"""The llama.cpp peer benchmark's parts that run without llama-cpp-python (CI does not build it):
the F32 GGUF export and the section's skip. With the package installed, the export is also
checked end to end: llama.cpp's greedy tokens on the GGUF equal this engine's."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eeserve import LLM, SamplingParams
from eeserve.bench import llamacpp, peer
from eeserve.bench.gguf_export import write_gguf_f32


def test_gguf_export_holds_every_weight_in_llamacpp_layout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import gguf

    out = write_gguf_f32(tiny_model_dir, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    embed = hf.get("model.embed_tokens.weight", hf.get("lm_head.weight"))
    assert embed is not None
    np.testing.assert_array_equal(tensors["token_embd.weight"], embed.numpy())
    np.testing.assert_array_equal(
        tensors["blk.1.ffn_down.weight"], hf["model.layers.1.mlp.down_proj.weight"].numpy()
    )
    # Q rows permuted per head from rotate-half to interleaved pairs: row 1 of a head is its
    # second half's first row.
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    head_dim = q.shape[0] // 4  # tiny model: 4 heads
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"][1], q[head_dim // 2].numpy())
    assert "output.weight" not in tensors  # tied: llama.cpp reuses the embedding
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == 2


def test_peer_section_is_skipped_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert peer.bench_peer(argparse.Namespace()) == {"skipped": "llama-cpp-python not installed"}
    assert "eeserve[peer]" in capsys.readouterr().out


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python not installed ([peer])")
def test_llamacpp_on_the_exported_gguf_decodes_like_the_engine(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    gguf_path = write_gguf_f32(tiny_varied_dir, tmp_path / "m.gguf")
    llm = LLM(str(tiny_varied_dir), enable_prefix_caching=False)
    prompts = [llm.tokenizer(p).input_ids for p in ["The quick brown fox", "def add(a, b):"]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llamacpp.LlamaCpp(gguf_path, torch.get_num_threads(), 2, 64)
    try:
        assert runner.run(prompts, 8).outputs == ours
    finally:
        runner.close()
