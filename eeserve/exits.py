"""Early-exit logic: per-request exit parameters, confidence measures, batch policies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExitParams:
    enabled: bool = True
    threshold: float | list[float] | None = None
    measure: str | None = None
    min_layer: int = 1
    exit_layers: list[int] | None = None
