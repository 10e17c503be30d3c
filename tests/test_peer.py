"""The llama.cpp peer benchmark's parts that run without llama.cpp built: the F32 GGUF export,
the parsing of ``llama-batched-bench``'s output from recorded samples, the interleaved ratios'
arithmetic, and the build's error without cmake. With llama.cpp's native tools already built
(``eeserve bench --sections peer`` builds them once), a slow test runs them on a tiny GGUF; with
llama-cpp-python installed, llama.cpp's greedy tokens on the GGUF are checked to equal this
engine's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eeserve import LLM, SamplingParams
from eeserve.bench import llamacpp, llamacpp_build, peer
from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.llamacpp_native import (
    RUNS_FOR_ROWS,
    BatchedBenchRow,
    batched_bench_command,
    parse_batched_bench,
    run_batched_bench,
)
from eeserve.bench.peer_summary import round_ratios, spread, summarise
from eeserve.bench.roofline import engine_bytes_per_token, gguf_bytes_per_token
from eeserve.kernels.native import load as load_native
from tests.peer_tools import FAKE_BATCHED_BENCH
from tests.tiny_model import TINY_KV_BYTES


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


# What llama-batched-bench printed (tools/batched-bench, llama-cpp-python 0.3.36's llama.cpp).
_JSONL = """main: n_kv_max = 3072, n_batch = 2048, n_ubatch = 512, flash_attn = -1
{"n_kv_max": 3072, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 63, "pl": 1, \
"n_kv": 95, "t_pp": 0.081000, "speed_pp": 395.061737, "t_tg": 0.792000, "speed_tg": 79.545456, \
"t": 0.873000, "speed": 108.820160}
{"n_kv_max": 3072, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 63, "pl": 8, \
"n_kv": 760, "t_pp": 0.412000, "speed_pp": 621.359222, "t_tg": 2.141000, "speed_tg": 235.404007, \
"t": 2.553000, "speed": 297.689789}
"""
_TABLE = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     63 |   32 |   3040 |    1.602 |   639.20 |    5.187 |   388.66 |    6.789 |   447.79 |
"""


def test_batched_bench_output_parses_as_jsonl_and_as_its_table() -> None:
    rows = parse_batched_bench(_JSONL)
    assert [r.batch for r in rows] == [1, 8]
    assert rows[0] == BatchedBenchRow(32, 63, 1, 0.081, 0.792, 79.545456)
    (row,) = parse_batched_bench(_TABLE)
    assert (row.prompt_len, row.new_tokens, row.batch, row.decode_s) == (32, 63, 32, 5.187)
    assert row.decode_tok_s == 388.66


def test_batched_bench_command_times_what_the_engine_times(tmp_path: Path) -> None:
    cmd = batched_bench_command(Path("bb"), tmp_path / "m.gguf", 2, 32, 63, [1, 8, 32])
    arg = dict(zip(cmd[1::2], cmd[2::2]))
    assert (arg["-t"], arg["-tb"], arg["-npp"], arg["-ntg"]) == ("2", "2", "32", "63")
    assert arg["-npl"] == "1,8,32" and arg["--output-format"] == "jsonl"
    assert int(arg["-c"]) >= 32 * (32 + 63)  # no batch size is skipped for want of context


def test_a_tool_that_prints_no_row_for_a_batch_is_an_error(tmp_path: Path) -> None:
    fake = tmp_path / "bb"
    fake.write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="unable to load model"):
        run_batched_bench(fake, tmp_path / "m.gguf", 1, 8, 7, [1])


def _counting_tool(folder: Path, body: str) -> tuple[Path, Path]:
    """A stand-in tool that appends a line to a count file per run, then runs ``body``."""
    fake, count = folder / "bb", folder / "runs"
    fake.write_text(f"#!/bin/sh\necho run >> {count}\n{body}\n")
    fake.chmod(0o755)
    return fake, count


def test_a_clean_exit_that_lost_a_row_is_run_again(tmp_path: Path) -> None:
    row = '{"pp": 8, "tg": 7, "pl": %s, "t_pp": 0.1, "t_tg": 1.0, "speed_tg": 50.0}'
    # The first run prints batch 1's row only, the second both.
    body = (
        f"echo '{row % 1}'\n"
        f"if [ \"$(wc -l < {tmp_path / 'runs'})\" -ge 2 ]; then echo '{row % 2}'; fi"
    )
    fake, count = _counting_tool(tmp_path, body)
    rows = run_batched_bench(fake, tmp_path / "m.gguf", 1, 8, 7, [1, 2])
    assert sorted(rows) == [1, 2] and len(count.read_text().splitlines()) == 2


def test_rows_lost_on_every_run_or_a_crash_are_errors(tmp_path: Path) -> None:
    fake, count = _counting_tool(tmp_path, "true")
    with pytest.raises(RuntimeError, match=r"rows for batches \[\] of \[1\]"):
        run_batched_bench(fake, tmp_path / "m.gguf", 1, 8, 7, [1])
    assert len(count.read_text().splitlines()) == RUNS_FOR_ROWS
    (tmp_path / "c").mkdir()
    crash, crashes = _counting_tool(tmp_path / "c", "kill -SEGV $$")
    with pytest.raises(RuntimeError, match="exit -11"):
        run_batched_bench(crash, tmp_path / "m.gguf", 1, 8, 7, [1])
    assert len(crashes.read_text().splitlines()) == 1  # a crash is not run again


def test_ratios_are_taken_within_each_round_then_summarised() -> None:
    pairs = [("e", "p"), ("e", "q")]
    rounds = [
        {1: {"p": 100.0, "e": 110.0, "q": 50.0}},
        {1: {"p": 60.0, "e": 54.0, "q": 50.0}},  # a load swing that hits both halves of a pair
        {1: {"p": 80.0, "e": 96.0, "q": 50.0}},
    ]
    assert round_ratios(rounds[1], pairs) == {1: {"e / p": 0.9, "e / q": 1.08}}
    (row,) = summarise(rounds, pairs)
    r = row["ratios"]["e / p"]
    assert (r["median"], r["min"], r["max"]) == pytest.approx((1.1, 0.9, 1.2))
    assert r["per_round"] == pytest.approx([1.1, 0.9, 1.2])
    # the median of per-round ratios, not the ratio of medians (96 / 80 = 1.2)
    assert row["decode_tok_s_median"] == {"p": 80.0, "e": 96.0, "q": 50.0}
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    with pytest.raises(ValueError):
        spread([])


def test_a_cached_build_with_other_cmake_flags_is_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EESERVE_HOME", str(tmp_path))
    home = llamacpp_build.tools_dir()
    (home / "bin").mkdir(parents=True)
    assert not llamacpp_build.is_built()
    for target in llamacpp_build.TARGETS:
        (home / "bin" / target).write_text("")
    assert not llamacpp_build.is_built()  # no build.json: flags unknown
    flags = list(llamacpp_build.CMAKE_FLAGS)
    (home / "build.json").write_text(json.dumps({"cmake_flags": flags[:-2]}))
    assert not llamacpp_build.is_built()  # built before AMX was compiled out
    (home / "build.json").write_text(json.dumps({"cmake_flags": flags}))
    assert llamacpp_build.is_built()
    assert any("-mno-amx-int8" in f for f in flags)


def test_without_cmake_the_build_says_what_is_missing_and_the_section_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert len(llamacpp_build.missing_tools()) == 3
    with pytest.raises(llamacpp_build.BuildToolMissing, match="cmake"):
        llamacpp_build.native_tools()
    assert not (tmp_path / "home" / "llamacpp").exists()  # nothing half-built left behind
    skipped = peer.bench_peer(argparse.Namespace())
    assert "cmake" in skipped["skipped"] and "C++ compiler" in skipped["skipped"]
    assert "peer section skipped" in capsys.readouterr().out


def test_the_peer_section_interleaves_rounds_and_prints_ratios_and_the_roofline(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole section on the tiny model, with stand-ins for llama.cpp's two tools (a bench
    that reports 50 tok/s, a quantiser that copies)."""
    bench, quantize = tmp_path / "bench", tmp_path / "quantize"
    bench.write_text(FAKE_BATCHED_BENCH)
    quantize.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    for tool in (bench, quantize):
        tool.chmod(0o755)
    tools = llamacpp_build.NativeTools(
        batched_bench=bench, quantize=quantize, server=bench, version="test"
    )
    (tmp_path / "gguf").mkdir()
    monkeypatch.setattr(llamacpp, "gguf_dir", lambda folder: tmp_path / "gguf")
    monkeypatch.setattr(peer, "native_tools", lambda: tools)
    monkeypatch.setattr(peer, "read_bandwidth", lambda threads: 1e9)
    monkeypatch.setattr(peer, "_SETTLE_S", 0.0)
    args = argparse.Namespace(
        model=str(tiny_model_dir), batch_sizes="1,2", peer_formats="F32,Q8_0,own", threads=1,
        prompt_len=8, max_tokens=6, repeats=2, seed=0,
    )  # fmt: skip
    res = peer.bench_peer(args)
    assert set(res["ggufs"]) == {"F32", "Q8_0"}  # "own": a named model's file only
    assert len(res["rounds"]) == 2 and res["decode_steps"] == 5
    first = res["rounds"][0]["1"]
    assert list(first) == [
        "llama.cpp F32", "eeserve float32", "llama.cpp Q8_0", "eeserve int8", "eeserve default",
    ]  # fmt: skip
    for row in res["rows"]:
        ratios = row["ratios"]
        assert set(ratios) == {
            "eeserve float32 / llama.cpp F32",
            "eeserve int8 / llama.cpp Q8_0",
            "eeserve default / llama.cpp Q8_0",
        }
        r = ratios["eeserve int8 / llama.cpp Q8_0"]
        assert r["min"] <= r["median"] <= r["max"]
        tps = [rnd[str(row["batch"])]["eeserve int8"] for rnd in res["rounds"]]
        assert r["per_round"] == pytest.approx([t / 50.0 for t in tps])
    runners = {r["runner"] for r in res["roofline_batch1"]}
    assert runners == {"eeserve float32", "eeserve int8", "llama.cpp F32", "llama.cpp Q8_0"}
    # The same weights as the F32 file, but greedy float32 steps read the head through its int8
    # screen where the engine's kernels are built, so the engine counts its screened head there.
    nbytes = res["bytes_per_token"]
    screened = load_native() is not None
    assert nbytes["llama.cpp F32"] == engine_bytes_per_token(tiny_model_dir, "float32")
    assert nbytes["eeserve float32"] == engine_bytes_per_token(tiny_model_dir, "float32", screened)
    assert res["quality"]["2"]["default_vs_float32"]["token_agreement"] == 1.0  # lossless
    assert "int8_vs_float32" in res["quality"]["1"]
    assert res["provenance"]["commit"] is None or res["provenance"]["commit"]


def _built_tools() -> llamacpp_build.NativeTools | None:
    # Collection must never start a build: a missing or stale cache skips the test.
    if not llamacpp_build.is_built():
        return None
    return llamacpp_build.native_tools()


@pytest.mark.slow
@pytest.mark.skipif(_built_tools() is None, reason="llama.cpp's tools not built (--sections peer)")
def test_native_tools_quantise_and_bench_the_exported_gguf(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = _built_tools()
    assert tools is not None
    monkeypatch.setattr(llamacpp, "gguf_dir", lambda folder: tmp_path)
    f32 = llamacpp.f32_gguf(tiny_model_dir)
    q8 = llamacpp.q8_0_gguf(tiny_model_dir, tools.quantize)
    rows = run_batched_bench(tools.batched_bench, q8, 1, 8, 7, [1, 2])
    assert set(rows) == {1, 2} and all(r.decode_tok_s > 0 for r in rows.values())
    assert all((r.prompt_len, r.new_tokens) == (8, 7) for r in rows.values())
    # Q8_0: 34 bytes per 32 weights (an fp16 scale per block) where F32 has 128
    assert gguf_bytes_per_token(q8) < 0.4 * gguf_bytes_per_token(f32)


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python not installed ([peer])")
def test_llamacpp_on_the_exported_gguf_decodes_like_the_engine(
    tiny_varied_dir: Path, tmp_path: Path
) -> None:
    gguf_path = write_gguf_f32(tiny_varied_dir, tmp_path / "m.gguf")
    llm = LLM(str(tiny_varied_dir), kv_cache_memory=TINY_KV_BYTES, enable_prefix_caching=False)
    prompts = [llm.tokenizer(p).input_ids for p in ["The quick brown fox", "def add(a, b):"]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llamacpp.LlamaCpp(gguf_path, torch.get_num_threads(), 2, 64)
    try:
        assert runner.run(prompts, 8).outputs == ours
    finally:
        runner.close()
