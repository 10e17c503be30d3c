"""Model hyper-parameters read from an HF ``config.json``, and the rotary tables they imply.

Contract: ``ModelConfig.from_hf`` accepts the Llama family (Llama 2/3, SmolLM, Mistral without
sliding window, Qwen2/2.5) and Gemma 3's text decoder (``Gemma3ForCausalLM``), and raises
``ValueError`` naming what is supported for anything else (also for a final or attention logit
soft-cap, which no supported runner applies). ``layer_windows`` gives each layer's sliding window
(None: full attention). ``rope_tables`` gives ``[max_len, head_dim]`` tables, or for a model with
a second RoPE base for its local layers (Gemma 3) ``[max_len, 2 * head_dim]``: the global
layers' tables, then the local layers' (``models.gemma3`` takes each layer's half), so that the
per-token gather ``cos[positions]`` and ``Rotary.select`` stay what they are for Llama.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

GEMMA3 = "Gemma3ForCausalLM"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", GEMMA3)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3_text": GEMMA3,
}
SLIDING = "sliding_attention"  # a Gemma 3 ``layer_types`` entry: local attention


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3 (defaults: the Llama family's behaviour)
    hidden_activation: str = "silu"  # "gelu_pytorch_tanh": GeGLU with tanh GELU
    layer_types: tuple[str, ...] = ()  # per layer, "sliding_attention" or "full_attention"
    sliding_window: int | None = None  # keys a local layer's query sees, its own included
    local_rope_theta: float | None = None  # RoPE base of the local layers
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None  # attention scale**-2 (None: head_dim)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window of its attention (None: it sees the whole context)."""
        return (
            tuple(self.sliding_window if kind == SLIDING else None for kind in self.layer_types)
            or (None,) * self.num_layers
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _BY_MODEL_TYPE.get(str(d.get("model_type")), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or d.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "MistralForCausalLM" and d.get("sliding_window"):
            # Treated as full attention: exact as long as sequences stay within the window.
            pass
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(cap) is not None:
                raise ValueError(f"{arch}: {cap}={d[cap]} is not supported (no soft-capping)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        local: dict[str, Any] = {}
        if arch == GEMMA3:
            rope, local = _gemma_rope(d, rope)
        theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = int(d["num_attention_heads"])
        gemma: dict[str, Any] = {}
        if arch == GEMMA3:
            gemma = dict(
                hidden_activation=str(d.get("hidden_activation") or "gelu_pytorch_tanh"),
                layer_types=_gemma_layer_types(d),
                sliding_window=int(d["sliding_window"]),
                local_rope_theta=float(local.get("rope_theta", 10000.0)),
                local_rope_scaling=local,
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or d["head_dim"]),
            )
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            **gemma,
        )


def _gemma_rope(d: dict[str, Any], rope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE parameters of a Gemma 3 config: per layer type (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` and ``rope_local_base_freq`` (earlier writers)."""
    if "full_attention" in rope:
        return dict(rope["full_attention"]), dict(rope.get(SLIDING) or {})
    local = {"rope_type": "default", "rope_theta": float(d.get("rope_local_base_freq", 10000.0))}
    return rope, local


def _gemma_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's attention kind; from the sliding-window pattern when the config has no list
    (every ``pattern``-th layer global, as HF derives it)."""
    n = int(d["num_hidden_layers"])
    kinds = d.get("layer_types")
    if kinds:
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries for {n} layers")
        return tuple(str(k) for k in kinds)
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return tuple("full_attention" if (i + 1) % pattern == 0 else SLIDING for i in range(n))


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for the default, ``linear`` and ``llama3`` rope types;
    ``local``: those of the local (sliding-window) layers of a model that has a base for them."""
    if local:
        assert cfg.local_rope_theta is not None
        return _inv_freq(cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling)
    return _inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        s = scaling
        factor, low, high = (
            float(s["factor"]),
            float(s["low_freq_factor"]),
            float(s["high_freq_factor"]),
        )
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim] in float32, as HF computes them; [max_len, 2 * head_dim]
    (global, then local) when the local layers have their own base."""
    cos, sin = _tables(rope_inv_freq(cfg), max_len)
    if cfg.local_rope_theta is None:
        return cos, sin
    local_cos, local_sin = _tables(rope_inv_freq(cfg, local=True), max_len)
    return torch.cat((cos, local_cos), dim=-1), torch.cat((sin, local_sin), dim=-1)


def _tables(inv: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
