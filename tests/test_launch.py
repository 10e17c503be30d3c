"""``eeserve serve`` prepares its process before it serves."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import pytest

from eeserve.server import launch


def test_serve_freezes_the_startup_heap(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What startup left (torch, the model) is out of the collector's reach by the time the
    server runs: a full collection of it stalled every stream (~220 ms on the default model)."""
    frozen: list[int] = []
    monkeypatch.setattr(
        launch._GracefulServer, "run", lambda self: frozen.append(gc.get_freeze_count())
    )
    parser = argparse.ArgumentParser()
    launch.add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", str(tiny_model_dir), "--kv-cache-memory", "8000000"])
    assert gc.get_freeze_count() == 0
    try:
        assert launch.run_serve(args) == 0
    finally:
        gc.unfreeze()
    assert len(frozen) == 1 and frozen[0] > 10_000


def test_replicas_log_like_the_single_process() -> None:
    """A line per request only at debug (uvicorn's access log there; Ray's here)."""
    from eeserve.server.replicas import replica_logging

    assert replica_logging("info") == {"log_level": "INFO", "enable_access_log": False}
    assert replica_logging("debug") == {"log_level": "DEBUG", "enable_access_log": True}
