"""The int8 drafter of ``speculative_draft="int8"``: the model's own weights, quantised, draft.

Contract: ``Int8Drafter(model, kv, native, dtype, vocab)`` is built from the float model *before*
the runner packs or patches it (it copies the modules, sharing every parameter, and quantises
the copy's projections and LM head to int8, ``kernels.quant``; with ``vocab``, the head's rows of
those token ids only: ``int8_head``). ``logits(h0, rot, meta)`` runs every layer of
the copy over the rows of ``meta`` and returns the draft logits [N, V] (float32, -inf outside
``vocab``). It writes the rows' K/V into the shared cache: those are approximate, so the
drafted positions are owed from layer 1 (``recompute`` KV debt) and the verification, a
full-depth pass over them, overwrites every layer's K/V with the float model's.

Why a quantised copy rather than an exit: a speculative draft pays when it is cheap *and* agrees
with full depth. On CPU a decode step reads the weights once, so a draft from exit layer l costs
about l / L of a step and the exits of a model not trained to exit agree with full depth too
rarely to pay (docs/speculative.md); the int8 copy costs less than half a step and agrees with
the float model on nearly every token.
"""

from __future__ import annotations

import copy

import torch

from eeserve.engine.attention import AttnMeta, PagedKVCache
from eeserve.engine.draft_vocab import SubsetHead
from eeserve.engine.layer_stack import LayerStack
from eeserve.kernels.fused import FusedDecoder
from eeserve.kernels.native import NativeOps
from eeserve.kernels.packing import use_native_ops
from eeserve.kernels.quant import Int8Linear, quantize_model
from eeserve.models.llama import LlamaForCausalLM, Rotary


def int8_head(
    weight: torch.Tensor, vocab: list[int] | None, native: NativeOps | None
) -> torch.nn.Module:
    """The int8 draft head of the LM head ``weight`` [V, D]: every row, or (``vocab``) the rows
    of those token ids, with logits -inf elsewhere."""
    if vocab is None:
        return Int8Linear(weight, None, native)
    rows = Int8Linear(weight[vocab].contiguous(), None, native)
    return SubsetHead(rows, vocab, weight.shape[0], weight.device)


class Int8Drafter:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKVCache,
        native: NativeOps | None,
        dtype: torch.dtype,
        vocab: list[int] | None = None,
    ) -> None:
        # A copy of the modules that shares every parameter (no second float model in memory,
        # not even while loading): quantising the copy replaces its projections with int8 ones
        # and leaves the float model's tensors alone; norms and the embedding stay shared.
        memo: dict[int, object] = {id(t): t for t in model.parameters()}
        draft: LlamaForCausalLM = copy.deepcopy(model, memo)
        if native is not None:
            use_native_ops(draft, native)
        quantize_model(draft, native)
        self.model = draft
        self.lm_head = int8_head(model.lm_head.weight.detach(), vocab, native)
        fused = FusedDecoder.build(draft, native) if dtype == torch.float32 else None
        self.stack = LayerStack(draft, kv, fused)
        self.num_layers = len(draft.layers)

    @torch.inference_mode()
    def logits(self, h0: torch.Tensor, rot: Rotary, meta: AttnMeta) -> torch.Tensor:
        """h0 [N, D] the rows' embeddings -> draft logits [N, V] float32."""
        h = self.stack.run(h0, rot, meta, 0, self.num_layers)
        return self.lm_head(self.model.final_norm(h)).float()  # type: ignore[no-any-return]
