"""The peer section's native pair: this engine on a model's own GGUF blocks (``weights="native"``)
against llama.cpp on that very file (``bench.peer_runners``, ``bench.peer``).

Without llama.cpp: the runners' order and pairs, a mode added by composition alone, the format
names. Where llama.cpp's tools are built (``eeserve bench --sections peer`` builds them once):
the whole section on the tiny model's exported GGUF quantised to Q4_1 by ``llama-quantize``, with
a stand-in bench (fast), and with the real ``llama-batched-bench`` (slow).
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from eeserve.bench import llamacpp, llamacpp_build, peer
from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.peer_runners import (
    ENGINE_RUNNERS,
    PeerFile,
    PeerFormat,
    Reads,
    pairs,
    round_order,
    runners_for,
)
from eeserve.bench.roofline import gguf_bytes_per_token
from eeserve.config import ExitPolicy, Weights
from eeserve.kernels.native import load as load_native
from tests.peer_tools import FAKE_BATCHED_BENCH

FILES = [
    PeerFile(source=PeerFormat.F32, name="F32", path=Path("f32.gguf")),
    PeerFile(source=PeerFormat.Q8_0, name="Q8_0", path=Path("q8.gguf")),
    PeerFile(source=PeerFormat.OWN, name="Q4_1", path=Path("own.gguf")),
]


def test_each_engine_runs_right_after_the_llamacpp_file_it_is_held_to() -> None:
    assert round_order(FILES, ENGINE_RUNNERS) == [
        "llama.cpp F32", "eeserve float32",
        "llama.cpp Q8_0", "eeserve int8", "eeserve default",
        "llama.cpp Q4_1", "eeserve native", "eeserve native default",
    ]  # fmt: skip
    assert pairs(FILES, ENGINE_RUNNERS) == [
        ("eeserve float32", "llama.cpp F32"),
        ("eeserve int8", "llama.cpp Q8_0"),
        ("eeserve default", "llama.cpp Q8_0"),
        ("eeserve native", "llama.cpp Q4_1"),
        ("eeserve native default", "llama.cpp Q4_1"),
        ("eeserve int8", "llama.cpp Q4_1"),  # for reference: fewer bytes than int8 reads
    ]
    # No own file (a model folder): no native runner, no pair with it.
    folder_only = FILES[:2]
    assert [r.label for r in runners_for(folder_only, ENGINE_RUNNERS)] == [
        "eeserve float32", "eeserve int8", "eeserve default",
    ]  # fmt: skip
    assert ("eeserve int8", "llama.cpp Q4_1") not in pairs(folder_only, ENGINE_RUNNERS)


def test_a_mode_added_to_the_runners_is_ordered_and_paired_with_no_other_change() -> None:
    """How another mode on native weights slots in."""
    native = next(r for r in ENGINE_RUNNERS if r.overrides.get("weights") is Weights.NATIVE)
    later = replace(
        native,
        label="eeserve native exits",
        overrides=MappingProxyType(
            {"weights": Weights.NATIVE, "exit_policy": ExitPolicy.PER_SEQUENCE}
        ),
        reads=Reads.VARIES,
    )
    runners = (*ENGINE_RUNNERS, later)
    assert round_order(FILES, runners)[-4:] == [
        "llama.cpp Q4_1", "eeserve native", "eeserve native default", "eeserve native exits",
    ]  # fmt: skip
    assert ("eeserve native exits", "llama.cpp Q4_1") in pairs(FILES, runners)


def test_unknown_formats_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown \['Q4_1'\]"):
        peer._formats("F32,Q4_1")
    f32 = write_gguf_f32(tiny_model_dir, tmp_path / "m.gguf")
    assert llamacpp.file_format(f32) == "F32"
    assert llamacpp.model_file(str(f32), tiny_model_dir) == ("F32", f32.resolve())
    assert llamacpp.model_file(str(tiny_model_dir), tiny_model_dir) is None


def _quantize() -> Path | None:
    # Collection must never start a build: a missing or stale cache skips the tests.
    return llamacpp_build.native_tools().quantize if llamacpp_build.is_built() else None


needs_llamacpp = pytest.mark.skipif(
    _quantize() is None, reason="llama.cpp's tools not built (eeserve bench --sections peer)"
)


@pytest.fixture
def tiny_q4_1(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """(the tiny model as a Q4_1 GGUF, made by llama-quantize from its F32 export; the folder
    for llama.cpp's F32 and Q8_0 files). EESERVE_HOME is a temporary folder (the .gguf model is
    converted there), with the engine's kernels and llama.cpp's tools taken beforehand from the
    real one (neither is built again)."""
    quantize = _quantize()
    assert quantize is not None
    assert load_native() is not None, "the native pair needs the engine's CPU kernels"
    tools = llamacpp_build.native_tools()
    monkeypatch.setattr(peer, "native_tools", lambda: tools)
    f32 = write_gguf_f32(tiny_model_dir, tmp_path / "tiny.f32.gguf")
    q4_1 = tmp_path / "tiny.q4_1.gguf"
    subprocess.run([str(quantize), str(f32), str(q4_1), "Q4_1"], check=True, capture_output=True)
    monkeypatch.setenv("EESERVE_HOME", str(tmp_path / "home"))
    (tmp_path / "made").mkdir()
    monkeypatch.setattr(llamacpp, "gguf_dir", lambda folder: tmp_path / "made")
    monkeypatch.setattr(peer, "_SETTLE_S", 0.0)
    return q4_1, tmp_path


def _args(model: Path, formats: str, repeats: int, batches: str = "1,2") -> argparse.Namespace:
    return argparse.Namespace(
        model=str(model), batch_sizes=batches, peer_formats=formats, threads=1, prompt_len=8,
        max_tokens=6, repeats=repeats, seed=0,
    )  # fmt: skip


@needs_llamacpp
def test_native_weights_run_beside_llamacpp_on_the_same_file(
    tiny_q4_1: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The section on the tiny Q4_1 file with a stand-in bench that reports 50 tok/s."""
    q4_1, tmp = tiny_q4_1
    bench = tmp / "bench"
    bench.write_text(FAKE_BATCHED_BENCH)
    bench.chmod(0o755)
    real = peer.native_tools()  # the fixture's: the real tools, not built again
    monkeypatch.setattr(peer, "native_tools", lambda: replace(real, batched_bench=bench))
    monkeypatch.setattr(peer, "read_bandwidth", lambda threads: 1e9)
    res = peer.bench_peer(_args(q4_1, "F32,own", repeats=2))
    assert res["ggufs"]["Q4_1"] == str(q4_1.resolve())
    assert list(res["rounds"][0]["1"]) == [
        "llama.cpp F32", "eeserve float32", "llama.cpp Q4_1", "eeserve native",
        "eeserve native default",
    ]  # fmt: skip
    for row in res["rows"]:
        r = row["ratios"]["eeserve native / llama.cpp Q4_1"]
        tps = [rnd[str(row["batch"])]["eeserve native"] for rnd in res["rounds"]]
        assert r["per_round"] == pytest.approx([t / 50.0 for t in tps])
        assert r["min"] <= r["median"] <= r["max"]
    # The roofline at batch 1 counts the file's blocks for both, not float32's bytes.
    nbytes = res["bytes_per_token"]
    assert nbytes["eeserve native"] == nbytes["llama.cpp Q4_1"] == gguf_bytes_per_token(q4_1)
    assert nbytes["eeserve native"] < 0.3 * nbytes["eeserve float32"]
    assert {r["runner"] for r in res["roofline_batch1"]} >= {"eeserve native", "llama.cpp Q4_1"}
    assert res["engine_runners"]["eeserve native"]["held_to"] == "llama.cpp Q4_1"
    # The same float weights as float32's folder, converted from this file: the same text.
    assert res["quality"]["2"]["native_vs_float32"]["token_agreement"] == 1.0
    machine = res["provenance"]["machine"]
    assert machine["kernel_path"] in ("avx512", "avx2", "portable") and "isa" in machine


@pytest.mark.slow
@needs_llamacpp
def test_native_pair_with_the_real_batched_bench(tiny_q4_1: tuple[Path, Path]) -> None:
    q4_1, _ = tiny_q4_1
    # Batch 2 only: at batch 1 the context this size asks (13 cells) is too small for the tool.
    res: dict[str, Any] = peer.bench_peer(_args(q4_1, "own", repeats=1, batches="2"))
    assert list(res["ggufs"]) == ["Q4_1"]
    (row,) = res["rows"]
    assert set(row["ratios"]) == {
        "eeserve native / llama.cpp Q4_1",
        "eeserve native default / llama.cpp Q4_1",
    }
    assert all(v > 0 for v in row["decode_tok_s_median"].values())
