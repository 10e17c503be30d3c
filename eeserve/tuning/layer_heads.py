"""``layer`` exit heads in ``tune-exits``: their initialisation and training input.

Contract: EE-Tuning's "layer" head for exit layer l is decoder layer l + 1 whose self-attention
stays the base model's (frozen and shared: the K/V it writes are the ones layer l + 1 caches
anyway, so the head needs no KV cache of its own), followed by a trainable copy of that layer's
post-attention RMSNorm and SwiGLU MLP, the head's own final RMSNorm and the frozen LM head
(``models.exit_heads``). ``init_layer_heads`` copies those weights from the base model, so that an
untrained head equals the shared head (final norm + LM head) at layer l + 1 exactly.
Its sidecar has ``adapter_rank`` = the model's MLP width. Training reuses ``tuning``'s sampled-KL
distillation (``tuning.train_head``) and probes on h_mid, the head's input, which
``tuning.data.collect(mid=True)`` collects; no warm start from the layer above (each head starts
from its own layer l + 1) and no input standardisation (the head's first op is an RMSNorm).
Its learning rate is ``TuneOptions.layer_lr``: a pretrained MLP wants smaller steps than a
zero-initialised adapter (on the default model, 1e-4 left the heads near their start: held-out
agreement 0.17 / 0.55 at layers 14 / 22; 2e-3 reached 0.41 / 0.76, bench/results/tuning/).
"""

from __future__ import annotations

import torch

from eeserve.models.exit_heads import ExitHeads
from eeserve.models.llama import LlamaForCausalLM

LAYER_LR = 2e-3  # peak AdamW learning rate of layer heads (``TuneOptions.layer_lr``)


@torch.no_grad()
def init_layer_heads(heads: ExitHeads, model: LlamaForCausalLM) -> None:
    """Each head := copies of layer l + 1's post-attention norm and MLP, and the final norm."""
    final = model.model.norm
    for exit_layer in heads.config.exit_layers:
        head = heads.head(exit_layer)
        src = model.layers[exit_layer]  # 0-based index l: the 1-based layer l + 1
        post, mlp = head.adapter.post_attention_layernorm, head.adapter.mlp
        assert post is not None and mlp is not None, "not a 'layer' exit head"
        post.weight.copy_(src.post_attention_layernorm.weight)
        mlp.gate_up_proj.weight.copy_(_dense(src.mlp.gate_up_proj))
        mlp.down_proj.weight.copy_(_dense(src.mlp.down_proj))
        head.norm.weight.copy_(final.weight)  # type: ignore[union-attr,arg-type]


def _dense(linear: torch.nn.Module) -> torch.Tensor:
    # A model packed for the CPU kernels (``kernels.pack_for_cpu``) has no dense weights left.
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("layer heads are initialised from an unpacked model (load_model)")
    return weight
