"""Builders for tiny random-weight HF-format model folders (no network, a second to build)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Early exit lets confident tokens skip the remaining layers of a transformer.",
    "One two three four five six seven eight nine ten.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    folder: Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = True,
    arch: str = "llama",
    max_pos: int = 512,
    **extra: Any,
) -> Path:
    """Write a random Llama (or Qwen2 with ``arch='qwen2'``) with its tokenizer into ``folder``."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        rms_norm_eps=1e-5,
    )
    common.update(extra)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model: Any = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Larger-than-default weights so that different layers disagree and logits are not flat.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"], cfg
    return folder
