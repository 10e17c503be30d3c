"""The decoder layers over the paged KV cache, without exits.

Contract: ``LayerStack.run(h, rot, meta, start, end)`` computes layers [start, end) (0-based)
for the rows of ``meta``, writing their K/V: through ``kernels.fused`` (one kernel call per
layer) when the model's projections are on the engine's kernels and every span's rows are
consecutive (``AttnMeta.pass_attention``; with sliding-window layers, also when no span reaches
past the window: ``window_pass_attention``), else through the model's modules with the cache's
``attend``. Both give the same numbers (tests/test_fused.py). The runner's full-depth pass and the
exit loop's layers between checks both go through here; ``run_checked`` runs a pass's decode rows
through several layers and the exit checks between them in one kernel call, when ``stacks(meta)``.
"""

from __future__ import annotations

from functools import partial

import torch

from eeserve.engine.attention import AttnMeta, PagedKVCache
from eeserve.kernels.fused import CheckedSpan, FusedDecoder, PassAttention
from eeserve.models.llama import LlamaForCausalLM, Rotary


class LayerStack:
    def __init__(
        self, model: LlamaForCausalLM, kv: PagedKVCache, fused: FusedDecoder | None
    ) -> None:
        self.model, self.kv, self.fused = model, kv, fused

    def run(
        self, h: torch.Tensor, rot: Rotary, meta: AttnMeta, start: int, end: int
    ) -> torch.Tensor:
        """h [N, D], the input of layer ``start`` -> the output of layer ``end - 1``."""
        plans = self._plans(meta)
        if plans is not None:
            assert self.fused is not None
            kv = self.kv
            return self.fused.run(h, rot.cos, rot.sin, kv.k, kv.v, plans[0], start, end, plans[1])
        attn = partial(self.kv.attend, meta=meta)
        for layer in self.model.layers[start:end]:
            h = layer(h, rot, attn)
        return h

    def _plans(self, meta: AttnMeta) -> tuple[PassAttention, PassAttention] | None:
        """How the rows attend in the global and the local layers, when the fused decoder runs
        the pass (else None)."""
        if self.fused is None:
            return None
        window = self.fused.window
        plan = meta.pass_attention()
        local = plan if window is None else meta.window_pass_attention(window)
        return None if plan is None or local is None else (plan, local)

    def stacks(self, meta: AttnMeta) -> bool:
        """Whether ``run_checked`` applies to a pass of these rows."""
        plans = self._plans(meta)
        return plans is not None and self.fused is not None and self.fused.stacks(*plans)

    def run_checked(
        self, h: torch.Tensor, rot: Rotary, meta: AttnMeta, start: int, end: int, span: CheckedSpan
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layers [start, end) with ``span``'s checks: (the output [N, D] of the last layer run,
        the confidences [C, N], the check that stopped the run or -1). See ``FusedDecoder``."""
        plans = self._plans(meta)
        assert self.fused is not None and plans is not None
        kv = self.kv
        return self.fused.run_checked(
            h, rot.cos, rot.sin, kv.k, kv.v, plans[0], start, end, span, plans[1]
        )
