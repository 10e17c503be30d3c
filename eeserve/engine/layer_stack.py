"""The decoder layers over the paged KV cache, without exits.

Contract: ``LayerStack.run(h, rot, meta, start, end)`` computes layers [start, end) (0-based)
for the rows of ``meta``, writing their K/V, on the kernel that ``kernel_route.route_pass``
chooses: through ``kernels.fused`` (the whole range in one ``decode_stack`` call for decode rows,
else one kernel call per layer) or through the model's modules with the cache's ``attend``. Every
route gives the same numbers (tests/test_fused.py). The runner's full-depth pass and the exit
loop's layers between checks both go through here; ``run_checked`` runs a pass's decode rows
through several layers and the exit checks between them in one kernel call, on a pass that
``route_checks`` sent there.
"""

from __future__ import annotations

from functools import partial

import torch

from eeserve.engine.attention import AttnMeta, PagedKVCache
from eeserve.engine.kernel_route import Kernel, Route, route_pass
from eeserve.kernels.fused import CheckedSpan, FusedCall, FusedDecoder
from eeserve.models.llama import LlamaForCausalLM, Rotary


class LayerStack:
    def __init__(
        self, model: LlamaForCausalLM, kv: PagedKVCache, fused: FusedDecoder | None
    ) -> None:
        self.model, self.kv, self.fused = model, kv, fused

    def route(self, meta: AttnMeta) -> Route:
        """The kernel that runs a pass over the rows of ``meta``."""
        return route_pass(self.fused, meta)

    def run(
        self, h: torch.Tensor, rot: Rotary, meta: AttnMeta, start: int, end: int
    ) -> torch.Tensor:
        """h [N, D], the input of layer ``start`` -> the output of layer ``end - 1``."""
        route = self.route(meta)
        if route.kernel is Kernel.MODULES:
            attn = partial(self.kv.attend, meta=meta)
            for layer in self.model.layers[start:end]:
                h = layer(h, rot, attn)
            return h
        assert self.fused is not None and route.attention is not None
        call = FusedCall.STACK if route.kernel is Kernel.DECODE_STACK else FusedCall.LAYERS
        kv, attention, local = self.kv, route.attention, route.local_attention
        return self.fused.run(call, h, rot.cos, rot.sin, kv.k, kv.v, attention, start, end, local)

    def run_checked(
        self, h: torch.Tensor, rot: Rotary, route: Route, start: int, end: int, span: CheckedSpan
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layers [start, end) with ``span``'s checks on a ``DECODE_STACK`` route: (the output
        [N, D] of the last layer run, the confidences [C, N], the check that stopped the run or
        -1). See ``FusedDecoder``."""
        assert route.kernel is Kernel.DECODE_STACK
        assert self.fused is not None and route.attention is not None
        kv = self.kv
        fused, attention, local = self.fused, route.attention, route.local_attention
        return fused.run_checked(
            h, rot.cos, rot.sin, kv.k, kv.v, attention, start, end, span, local
        )
