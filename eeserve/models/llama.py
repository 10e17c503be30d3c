"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) as a plain ``nn.Module``.

Contract: the module knows nothing about batching, paging or early exit. It exposes the pieces a
runner steps through one layer at a time (``embed``, ``layers[i]``, ``norm``, ``lm_head``), with
parameter names that are HF's except for two fusions that the loader maps (q/k/v -> ``qkv_proj``,
gate/up -> ``gate_up_proj``): one matmul instead of three (two) per layer. Attention itself is
delegated to a callable that the runner passes in, because only the runner owns the KV cache.
Hidden states are flat: ``[num_tokens, hidden]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eeserve.models.config import ModelConfig

# (layer index, q [N, H, hd], k [N, Hkv, hd], v [N, Hkv, hd]) -> attention output [N, H*hd]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Rotary:
    """Per-token rotary tables, gathered once per step for the tokens in the batch."""

    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor  # [N, head_dim]

    def select(self, rows: torch.Tensor) -> Rotary:
        return Rotary(self.cos[rows], self.sin[rows])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; bit-identical to the HF arithmetic below in float32.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Same arithmetic as HF: normalise in float32, scale in the input dtype.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


# (x [N, heads, hd], tables) -> rotated x; a runner may swap in a fused kernel that rotates in place
RotaryFn = Callable[[torch.Tensor, Rotary], torch.Tensor]
# gate_up [N, 2I] -> silu(gate) * up [N, I]
ActFn = Callable[[torch.Tensor], torch.Tensor]


def apply_rotary(x: torch.Tensor, rot: Rotary) -> torch.Tensor:
    """x: [N, heads, hd]; HF's non-interleaved (rotate-half) convention."""
    cos = rot.cos.unsqueeze(1)
    sin = rot.sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # Optional dedicated K/V projection (a runner that re-lays weights for its kernels sets
        # it); by default ``kv`` uses the K/V rows of ``qkv_proj``.
        self.kv_proj: nn.Module | None = None
        self.rotary: RotaryFn = apply_rotary

    def qkv(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: normed hidden [N, D] -> rotated q [N, H, hd], k [N, Hkv, hd], v [N, Hkv, hd]."""
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # q and k heads rotated together: one set of elementwise ops instead of two.
        qk = self.rotary(qkv[:, : self.num_heads + self.num_kv_heads], rot)
        return (
            qk[:, : self.num_heads],
            qk[:, self.num_heads :],
            qkv[:, self.num_heads + self.num_kv_heads :],
        )

    def kv(self, x: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V only (no query, no attention): what the KV-debt ``fill`` strategy needs."""
        n = x.shape[0]
        if self.kv_proj is not None:
            kv = self.kv_proj(x)
        else:
            w = self.qkv_proj.weight[self.q_size :]
            b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :]
            kv = F.linear(x, w, b)
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = self.rotary(k.view(n, self.num_kv_heads, self.head_dim), rot)
        return k, v.view(n, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    """SwiGLU MLP; sized by numbers, not a config, so that exit heads can hold their own copy."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act: ActFn = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, rot: Rotary, attn: AttentionFn) -> torch.Tensor:
        return self.mlp_block(self.attn_block(h, rot, attn))

    def attn_block(self, h: torch.Tensor, rot: Rotary, attn: AttentionFn) -> torch.Tensor:
        """The attention half: input hidden -> the state between attention and MLP (h_mid).

        Separate from ``mlp_block`` because a ``layer`` exit head decides inside this layer."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(h), rot)
        out: torch.Tensor = self.self_attn.o_proj(attn(self.index, q, k, v))
        # Added into the projection's fresh output: one allocation less per layer.
        return out.add_(h)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP half: h_mid -> this layer's output hidden."""
        return self.mlp(self.post_attention_layernorm(h)).add_(h)  # type: ignore[no-any-return]

    def kv_from_hidden(self, h: torch.Tensor, rot: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V this layer would cache for a token whose input hidden state is ``h``."""
        return self.self_attn.kv(self.input_layernorm(h), rot)


class LlamaForCausalLM(nn.Module):
    # The decoder layer of this architecture (a subclass names its own).
    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        embed = self.model.embed_tokens
        # Block-format modules (kernels.gguf_linear) share the embedding's blocks themselves.
        if self.config.tie_word_embeddings and isinstance(embed, nn.Embedding):
            self.lm_head.weight = embed.weight

    @property
    def layers(self) -> list[LlamaDecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return,operator]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)  # type: ignore[no-any-return,operator]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                name = "model.embed_tokens.weight"  # some writers keep only the head's copy
            target, dst = name, None
            for part, (fused_name, start, size) in fused.items():
                if f".{part}." in name:
                    target = name.replace(part, fused_name)
                    dst = (start, size)
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            param = params[target].data
            if dst is not None:
                param = param.narrow(0, dst[0], dst[1])
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            param.copy_(tensor)
            loaded.add(target)
        return loaded
