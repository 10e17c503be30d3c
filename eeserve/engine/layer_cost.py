"""What one decoder layer costs against the rows it runs: the cost model of the ``auto`` policy.

Contract: ``LayerCost`` gives the seconds of one decoder layer for n decode rows and of one
layer's ``fill`` K/V projection for m rows (piecewise linear between the measured row counts,
linear beyond the last two); ``shrink_pays`` says whether letting m of n running rows leave (the
others run on, the leavers get fill) costs less per remaining layer than keeping all n.
``measure_layer_cost`` times the loaded model's layers with their own modules (so the engine's
kernels, packed or int8 weights), attention left out: at decode a row's attention is small next
to the projections, and it shrinks with the rows anyway. ``layer_cost`` keeps a measurement per
machine under ``eeserve_home()/layer_costs`` (keyed by the model's shape, dtype, weight format
and thread count), so that the policy decides alike from one run to the next; delete the file
to measure again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from eeserve.config import eeserve_home
from eeserve.models.llama import AttentionFn, LlamaDecoderLayer, Rotary

ROWS = (1, 2, 4, 8, 16, 32, 64)
# Rows leave only when that saves at least this share of a layer: below it, the measured
# difference is within the timing noise and keeping the rows costs nothing measurable.
MIN_SAVING = 0.05


@dataclass(frozen=True)
class LayerCost:
    rows: tuple[int, ...]
    layer_s: tuple[float, ...]  # one decoder layer for that many decode rows
    fill_s: tuple[float, ...]  # one layer's fill (K/V from an exit hidden state) for that many

    def layer(self, n: int) -> float:
        return _interpolate(self.rows, self.layer_s, n)

    def fill(self, n: int) -> float:
        return _interpolate(self.rows, self.fill_s, n)

    def shrink_pays(self, running: int, leaving: int, fill: bool = True) -> bool:
        """Is a layer cheaper with ``leaving`` of ``running`` rows gone (and, with ``fill``, their
        K/V filled) than with all of them?"""
        if leaving <= 0:
            return False
        if leaving >= running:
            return True
        saved = self.layer(running) - self.layer(running - leaving)
        if fill:
            saved -= self.fill(leaving)
        return saved > MIN_SAVING * self.layer(running)


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], n: int) -> float:
    if n <= 0:
        return 0.0
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if n <= x1 or x1 == xs[-1]:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return ys[0]


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls: other work on the machine only ever adds time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _run_layers(
    layers: list[LlamaDecoderLayer], h: torch.Tensor, rot: Rotary, attend: AttentionFn
) -> None:
    for layer in layers:
        layer(h.clone(), rot, attend)


def _fill_layers(layers: list[LlamaDecoderLayer], h: torch.Tensor, rot: Rotary) -> None:
    for layer in layers:
        layer.kv_from_hidden(h, rot)


@torch.inference_mode()
def measure_layer_cost(
    layers: list[LlamaDecoderLayer],
    hidden: Callable[[int], torch.Tensor],
    rotary: Callable[[int], Rotary],
    repeats: int = 7,
) -> LayerCost:
    """Times ``layers`` (their modules, with a pass-through attention) and their K/V fill on
    ``hidden(n)`` [n, D] with ``rotary(n)``, for each row count of ``ROWS``, per layer. Every
    timed call runs all the layers, so that their weights stream from memory as in a decode step
    (one layer timed alone stays in the caches and looks faster than it is). Both curves are
    made non-decreasing (more rows never cost less; a dip is timing noise)."""

    def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.reshape(q.shape[0], -1)

    layer_s, fill_s = [], []
    for n in ROWS:
        h, rot = hidden(n), rotary(n)
        run = best_time(partial(_run_layers, layers, h, rot, attend), repeats)
        layer_s.append(run / len(layers))
        fill_s.append(best_time(partial(_fill_layers, layers, h, rot), repeats) / len(layers))
    for curve in (layer_s, fill_s):
        for i in range(1, len(curve)):
            curve[i] = max(curve[i], curve[i - 1])
    return LayerCost(ROWS, tuple(layer_s), tuple(fill_s))


def measure_model_layers(
    layers: list[LlamaDecoderLayer], d: int, cos: torch.Tensor, sin: torch.Tensor
) -> LayerCost:
    """``measure_layer_cost`` on seeded random hidden states [n, d] at positions 0..n-1; cos
    and sin [positions, head_dim] are the model's rotary tables (on its device and dtype)."""

    def hidden(n: int) -> torch.Tensor:
        h = torch.randn(n, d, generator=torch.Generator().manual_seed(n))
        return h.to(cos.device, cos.dtype)

    def rotary(n: int) -> Rotary:
        return Rotary(cos[:n], sin[:n])

    return measure_layer_cost(layers, hidden, rotary)


def layer_cost(key: str, measure: Callable[[], LayerCost]) -> LayerCost:
    """The kept measurement for ``key``, measured (and kept) on first use."""
    path = eeserve_home() / "layer_costs" / f"{key}.json"
    if path.exists():
        raw = json.loads(path.read_text())
        return LayerCost(tuple(raw["rows"]), tuple(raw["layer_s"]), tuple(raw["fill_s"]))
    cost = measure()
    _write_atomic(path, json.dumps(asdict(cost)))
    return cost


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(text)}")
    tmp.write_text(text)
    tmp.replace(path)
