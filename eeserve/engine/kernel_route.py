"""Which kernel computes a pass's layers, and whether the exit checks run inside it: the one
place that decides, and says why not.

Contract: ``route_pass(fused, meta)`` returns a ``Route``: ``DECODE_STACK`` (every layer of the
range in one ``decode_stack`` call: decode rows only), ``LAYER_KERNELS`` (one fused kernel call
per layer: prompts and prompt chunks too) or ``MODULES`` (the model's modules with the cache's
``attend``), with the attention layouts the kernels read and, below ``DECODE_STACK``, the reason.
``route_checks`` says whether a pass's exit checks run inside the stack kernel
(``decode_stack_checked``): a ``CheckRoute`` with the one measure and the kernel's check per
exit layer, or the reason they run apart. ``LayerStack`` and ``ExitLoop`` act on these routes and
decide nothing of their own; tests/test_fused.py holds every route to the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from eeserve.engine.attention import AttnMeta
from eeserve.engine.exit_checks import ExitChecks
from eeserve.engine.exit_state import ExitBatch
from eeserve.kernels.fused import FusedDecoder, PassAttention
from eeserve.kernels.stack_layout import STACK_MEASURES, StackCheck


class Kernel(StrEnum):
    DECODE_STACK = "decode_stack"  # the layer range in one call
    LAYER_KERNELS = "layer_kernels"  # one call per layer
    MODULES = "modules"  # the model's modules, layer by layer


@dataclass(frozen=True, kw_only=True)
class Route:
    kernel: Kernel
    attention: PassAttention | None = None  # how the rows attend in global layers (kernels)
    local_attention: PassAttention | None = None  # ... and in local (sliding-window) layers
    why_not_stack: str = ""  # why the pass runs below DECODE_STACK ("" when it does not)


def route_pass(fused: FusedDecoder | None, meta: AttnMeta) -> Route:
    """The kernel of a pass over the rows of ``meta``."""
    if fused is None:
        why = "a projection or norm is off the engine's kernels (or no kernels, or not float32)"
        return Route(kernel=Kernel.MODULES, why_not_stack=why)
    attention = meta.pass_attention()
    if attention is None:
        why = "a span's rows are not consecutive (an exit loop's subset)"
        return Route(kernel=Kernel.MODULES, why_not_stack=why)
    local = attention if fused.window is None else meta.window_pass_attention(fused.window)
    if local is None:
        why = "a prompt span reaches past the sliding window"
        return Route(kernel=Kernel.MODULES, why_not_stack=why)
    why = ""
    if fused.arch is None:
        why = "the layers are not all of one architecture that decode_stack computes"
    elif not fused.stacks(attention, local):
        why = "prompt rows in the pass (decode_stack takes one query per row)"
    return Route(
        kernel=Kernel.LAYER_KERNELS if why else Kernel.DECODE_STACK,
        attention=attention,
        local_attention=local,
        why_not_stack=why,
    )


@dataclass(frozen=True, kw_only=True)
class CheckRoute:
    """The exit checks inside ``decode_stack_checked``: their one measure and, per exit layer
    below the last, the kernel's check (empty with a reason when they run apart)."""

    measure: str | None = None
    kernel_checks: dict[int, StackCheck] = field(default_factory=dict)
    why_not: str = ""


def route_checks(
    *, route: Route, batch: ExitBatch, exit_checks: ExitChecks, layer_heads: bool, num_layers: int
) -> CheckRoute:
    """Whether the checks of ``batch``'s plans run inside the stack kernel of a pass routed
    ``route``: decode rows only, with no replayed, owed or draft rows, one measure that the kernel
    computes, and a kernel check for each of the plans' exit layers."""
    layers = {lay for p in batch.plans if p is not None for lay in p.thresholds}
    if not layers:
        return CheckRoute(why_not="no row is checked")
    if layer_heads:
        return CheckRoute(why_not="layer heads check inside a layer, between its halves")
    if batch.forced_depth or batch.passengers or batch.speculative:
        return CheckRoute(why_not="replayed, owed or draft rows in the pass")
    if batch.allowed:
        return CheckRoute(why_not="constrained rows judged over their allowed tokens")
    if route.kernel is not Kernel.DECODE_STACK:
        return CheckRoute(why_not=route.why_not_stack)
    measures = {p.measure for p in batch.plans if p is not None}
    if len(measures) != 1:
        return CheckRoute(why_not="the rows' plans use several measures")
    (measure,) = measures
    if measure not in STACK_MEASURES:
        return CheckRoute(why_not=f"decode_stack_checked does not compute {str(measure)!r}")
    checks: dict[int, StackCheck] = {}
    for layer in sorted(c for c in layers if c < num_layers):
        check = exit_checks.stack_check(measure, layer)
        if check is None:
            return CheckRoute(why_not=f"the check at exit {layer} is off the engine's kernels")
        checks[layer] = check
    return CheckRoute(measure=measure, kernel_checks=checks)
