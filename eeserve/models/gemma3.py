"""Gemma 3's text decoder (``Gemma3ForCausalLM``) as a plain ``nn.Module``, in the Llama module's
shape.

Contract: the same pieces, call signatures and fused parameter names as ``models.llama``
(``embed``, ``layers[i].attn_block`` / ``mlp_block`` / ``kv_from_hidden`` / ``forward``,
``final_norm``, ``lm_head``, ``load_weights``; ``self_attn.qkv_proj`` / ``o_proj`` / ``kv_proj``,
``mlp.gate_up_proj`` / ``down_proj``), so the runner, the exit loop, packed and int8 projections
and int8 drafts use it as they use Llama. Where Gemma 3 differs:
- its RMSNorm scales by ``1 + w``: ``load_weights`` stores ``1 + w``, so every norm is the Llama
  ``RMSNorm`` (in float32 the same numbers as HF's, which adds the 1 in float32 too);
- q and k are RMS-normed per head (``q_norm``, ``k_norm``) before the rotary embedding; the query
  scale ``query_pre_attn_scalar ** -0.5`` is folded into ``q_norm``'s weight as a factor on the
  ``head_dim ** -0.5`` that attention applies (a factor of exactly 1 for Gemma-3-270M);
- each layer norms the attention output and the MLP output before adding them to the residual
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the MLP's input with
  ``pre_feedforward_layernorm``; the MLP is GeGLU with tanh GELU;
- the embedding is scaled by sqrt(hidden), that factor rounded to the weights' dtype as in HF;
- local (sliding-window) layers rotate with the local RoPE base: ``rope_tables`` gives both table
  pairs side by side and each layer takes its half. The window itself is applied by whoever
  attends (the engine's KV cache), from ``config.layer_windows()``.
The classes subclass Llama's so that code typed for Llama takes them; ``kernels.fused`` (which
computes a Llama layer) checks the exact class and leaves Gemma layers to the modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from eeserve.models.config import ModelConfig
from eeserve.models.llama import (
    AttentionFn,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
    Rotary,
)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate first) -> gelu_tanh(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def layer_rotary(rot: Rotary, head_dim: int, local: bool) -> Rotary:
    """The global or local half of the per-token tables that ``rope_tables`` lays side by side
    ([N, 2 * head_dim]); contiguous, as the rotary kernel reads them."""
    part = slice(head_dim, 2 * head_dim) if local else slice(0, head_dim)
    return Rotary(rot.cos[:, part].contiguous(), rot.sin[:, part].contiguous())


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, local: bool) -> None:
        super().__init__(cfg)
        self.local = local
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normed hidden [N, D] -> normed, rotated q [N, H, hd], k [N, Hkv, hd]; v [N, Hkv,
        hd]."""
        n, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + 2 * hkv, self.head_dim)
        qk = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv])), dim=1)
        # q and k heads rotated together: one set of elementwise ops instead of two.
        qk = self.rotary(qk, layer_rotary(rot, self.head_dim, self.local))
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv :]

    def kv(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V only (no query, no attention): what the KV-debt ``fill`` strategy needs."""
        n = x.shape[0]
        if self.kv_proj is not None:
            kv = self.kv_proj(x)
        else:
            kv = F.linear(x, self.qkv_proj.weight[self.q_size :])
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        k = self.rotary(k, layer_rotary(rot, self.head_dim, self.local))
        return k, v.reshape(n, self.num_kv_heads, self.head_dim)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        nn.Module.__init__(self)  # Llama's modules are not built only to be replaced
        self.index = index
        windows = cfg.layer_windows()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Gemma3Attention(cfg, local=windows[index] is not None)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = LlamaMLP(d, cfg.intermediate_size)
        self.mlp.act = gelu_tanh_and_mul
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def attn_block(self, h: torch.Tensor, rot: Rotary, attn: AttentionFn) -> torch.Tensor:
        """Input hidden -> h + norm(attention): the state between attention and MLP (h_mid)."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(h), rot)
        out = self.self_attn.o_proj(attn(self.index, q, k, v))
        return self.post_attention_layernorm(out).add_(h)  # type: ignore[no-any-return]

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """h_mid -> h_mid + norm(MLP(norm(h_mid))): this layer's output hidden."""
        out = self.mlp(self.pre_feedforward_layernorm(h))
        return self.post_feedforward_layernorm(out).add_(h)  # type: ignore[no-any-return]


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.tie_word_embeddings:
            raise ValueError("Gemma 3 checkpoints tie the LM head to the embedding")
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 activation {cfg.hidden_activation!r} is not supported")
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.model.embed_tokens(input_ids)  # type: ignore[operator]
        # HF multiplies by the scale as a tensor rounded to the weights' dtype: same here.
        return e * torch.tensor(self.embed_scale, dtype=e.dtype)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors in; every norm weight w stored as 1 + w (``q_norm``'s also times the
        query-scale factor)."""
        return super().load_weights(self._fold_norms(weights))

    def _fold_norms(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        scalar = cfg.query_pre_attn_scalar or float(cfg.head_dim)
        q_factor = (cfg.head_dim / scalar) ** 0.5  # query_pre_attn_scalar**-0.5 / head_dim**-0.5
        for name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = 1.0 + tensor.float()
                if name.endswith("q_norm.weight") and q_factor != 1.0:
                    tensor = tensor * q_factor
            yield name, tensor
