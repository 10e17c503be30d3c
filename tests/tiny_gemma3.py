"""A tiny random Gemma 3 text model for the tests (tests/test_gemma3.py, tests/test_exit_checks.py):
grouped K/V, two sliding-window layers around a global one, two RoPE bases, a query scale
other than head_dim's."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.tiny_model import build_tokenizer

WINDOW = 8
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def build_tiny_gemma3(folder: Path, seed: int = 0) -> Path:
    """A random Gemma 3 text model: grouped K/V (4 query heads, 1 K/V head), a window of 8, two
    RoPE bases, a query scale other than head_dim's, and random norm weights (so that a norm
    read as w instead of 1 + w, or swapped, changes the logits)."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=KINDS,
        query_pre_attn_scalar=24,
        max_position_embeddings=128,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 0.15)
    model.save_pretrained(folder)
    tok = build_tokenizer()
    tok.chat_template = None  # a base model's tokenizer
    assert len(tok) <= cfg.vocab_size
    tok.save_pretrained(folder)
    return folder
