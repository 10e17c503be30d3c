"""Paying ``fill`` KV debt in one projection: a leaving row's K/V for every layer above its exit.

Contract: ``KVFiller.build(model)`` stacks the K/V rows of every layer's fused qkv projection
with that layer's input-norm weight folded in (float32, taken before the runner packs the
weights) for models whose layers are plain Llama-family layers in float32; None otherwise (Gemma
3's layers norm K after projecting it; int8, bfloat16 and native block weights), and those pay
layer by layer (``layer.kv_from_hidden``). ``pay(h, rot, first, kv, slots)`` writes the K/V of
layers ``first``.. (1-based) for rows h [m, D]: one RMS normalisation, one matmul
[m, D] x [D, layers · 2 · kv], one rotary over all the layers' K heads and one scatter per pool,
instead of a norm, a projection, a rotary and two writes per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eeserve.engine.attention import PagedKVCache
from eeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, Rotary, apply_rotary


class KVFiller:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        self.weight = weight  # [L * 2 * kv_size, D]: per layer its K rows, then its V rows
        self.bias = bias  # [L * 2 * kv_size] or None
        self.kv_heads, self.head_dim, self.eps = kv_heads, head_dim, eps
        self.rows_per_layer = 2 * kv_heads * head_dim

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> KVFiller | None:
        layers = model.layers
        if not layers or any(type(layer) is not LlamaDecoderLayer for layer in layers):
            return None
        weights, biases = [], []
        for layer in layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            if not isinstance(attn.qkv_proj, torch.nn.Linear):
                return None  # native (block-format) weights: kv_from_hidden pays
            w = attn.qkv_proj.weight
            if w.dtype != torch.float32:
                return None
            # RMSNorm scales each input feature by its weight: fold it into the columns.
            weights.append(w[attn.q_size :].detach() * norm.weight.detach()[None, :])
            b = attn.qkv_proj.bias
            biases.append(None if b is None else b[attn.q_size :].detach())
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        cfg = model.config
        weight = torch.cat(weights).contiguous()
        return cls(weight, bias, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    @torch.inference_mode()
    def pay(
        self, h: torch.Tensor, rot: Rotary, first: int, kv: PagedKVCache, slots: torch.Tensor
    ) -> None:
        """K/V of layers ``first``.. (1-based) for rows h [m, D] at ``slots`` [m]."""
        per = self.rows_per_layer
        start = (first - 1) * per
        if start >= self.weight.shape[0]:
            return
        n = (self.weight.shape[0] - start) // per
        xn = F.rms_norm(h, (h.shape[-1],), None, self.eps)
        bias = None if self.bias is None else self.bias[start:]
        out = F.linear(xn, self.weight[start:], bias)  # [m, n * 2 * kv_size]
        m, hd = h.shape[0], self.head_dim
        out = out.view(m, n, 2, self.kv_heads, hd)
        k = apply_rotary(out[:, :, 0].reshape(m, n * self.kv_heads, hd), rot)
        k = k.view(m, n, self.kv_heads, hd).transpose(0, 1)  # [n, m, Hkv, hd]
        v = out[:, :, 1].transpose(0, 1)
        kv.k[first - 1 :, slots] = k.to(kv.k.dtype)
        kv.v[first - 1 :, slots] = v.to(kv.v.dtype)
