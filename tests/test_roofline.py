"""The batch-1 roofline: bytes read per token, the fraction of the ceiling, and the probe runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eeserve.bench.gguf_export import write_gguf_f32
from eeserve.bench.peer_summary import roofline_rows
from eeserve.bench.roofline import (
    INT8_BYTES_PER_WEIGHT,
    engine_bytes_per_token,
    fraction_of_roofline,
    gguf_bytes_per_token,
    read_bandwidth,
    weights_per_token,
)

# SmolLM2-135M's shape (config.json of the default model)
SMOLLM2 = {
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
}  # fmt: skip


def test_smollm2_reads_about_540_mb_in_float32_and_150_in_int8(tmp_path: Path) -> None:
    matrices, norms = weights_per_token(SMOLLM2)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert matrices == 30 * per_layer + 49152 * 576  # 134.5M: projections + the LM head
    assert norms == 61 * 576
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    f32, int8 = (engine_bytes_per_token(tmp_path, s) for s in ("float32", "int8"))
    assert 535e6 < f32 < 540e6
    assert int8 == round(matrices * INT8_BYTES_PER_WEIGHT) + 4 * norms
    assert 150e6 < int8 < 152e6
    # Greedy float32 steps read the head through its int8 screen: the int8 head, a scale per id.
    screened = engine_bytes_per_token(tmp_path, "float32", screened_head=True)
    head = 49152 * 576
    assert (
        screened
        == round((matrices - head) * 4 + head * INT8_BYTES_PER_WEIGHT + 4 * 49152) + 4 * norms
    )
    with pytest.raises(ValueError, match="scheme"):
        engine_bytes_per_token(tmp_path, "int4")


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_untied_dir"])
def test_an_f32_gguf_reads_what_the_float32_engine_reads(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two countings of the same weights agree: tied, the embedding is read once as the head;
    untied, the head is read and the embedding table is not."""
    folder: Path = request.getfixturevalue(fixture)
    gguf = write_gguf_f32(folder, tmp_path / "m.gguf")
    assert gguf_bytes_per_token(gguf) == engine_bytes_per_token(folder, "float32")


def test_fraction_of_roofline_and_its_rows() -> None:
    # 10 GB/s over 500 MB a token: a ceiling of 20 tok/s; 15 tok/s is 75% of it
    assert fraction_of_roofline(15.0, 10e9, 500_000_000) == pytest.approx(0.75)
    rounds = [{1: {"a": 15.0}, 8: {"a": 90.0}}, {1: {"a": 10.0}, 8: {"a": 80.0}}]
    (row,) = roofline_rows(rounds, [10e9, 5e9], {"a": 500_000_000, "not run": 1})
    assert row["fraction"] == {"median": pytest.approx(0.875), "min": 0.75, "max": 1.0}
    assert row["ceiling_tok_s_median"] == pytest.approx(15.0)
    assert row["decode_tok_s_median"] == pytest.approx(12.5)


def test_read_bandwidth_measures_a_finite_rate() -> None:
    bw = read_bandwidth(1, repeats=2, size_bytes=1 << 22)
    assert math.isfinite(bw) and bw > 0
