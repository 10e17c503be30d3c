from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny_model import assert_engine_clean, build_tiny_model, live_llms


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    """The suite runs torch single-threaded. Tiny models gain nothing from more threads, and with
    two threads on a shared 2-core machine a step was measured 10-40x slower (spinning OpenMP
    threads), against about 1.3x faster for the real model on an idle one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_varied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama whose greedy output varies from token to token (and non-unit norms)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "varied", weight_std=0.2, norm_noise=0.1
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2: random q/k/v biases."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "qwen2",
        arch="qwen2",
        seed=1,
        weight_std=0.2,
        norm_noise=0.1,
    )


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with its own lm_head (untied from the embeddings), MHA (no GQA)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "untied",
        tie=False,
        seed=2,
        kv_heads=4,
        weight_std=0.2,
        norm_noise=0.1,
    )


@pytest.fixture(autouse=True)
def _engines_left_clean() -> Iterator[None]:
    """After every test, every engine built with ``make_llm`` holds no request and no block."""
    yield
    for llm in live_llms():
        assert_engine_clean(llm)
