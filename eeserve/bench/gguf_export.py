"""The benchmark's model in llama.cpp's format: an F32 GGUF written from the model folder.

Contract: ``write_gguf_f32(folder, out)`` writes a Llama-architecture GGUF holding exactly the
folder's safetensors weights in float32 (Q and K rows permuted into GGML's rotary layout, as
llama.cpp's own converter does), its hyperparameters and its byte-level BPE tokenizer, so that
llama.cpp and this engine run the same model. Only Llama-architecture folders are supported
(ValueError otherwise). The Q8_0 file is made from it by llama.cpp's own quantiser
(``bench.peer``), so both peers' numbers are llama.cpp's formats as users get them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

# HF (our loader's source) name inside ``model.layers.{i}.`` -> GGUF name inside ``blk.{i}.``
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order -> GGML's interleaved pairs (llama.cpp's converter does this)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    return None


def _add_tokenizer(writer: Any, folder: Path, vocab_size: int) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{folder}: only byte-level BPE tokenizers are exported")
    tokens = [""] * vocab_size
    types = [gguf.TokenType.NORMAL] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        if added.get("special"):
            types[added["id"]] = gguf.TokenType.CONTROL
    for i, text in enumerate(tokens):
        if not text:  # ids the tokenizer leaves unused: a placeholder llama.cpp accepts
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)


def write_gguf_f32(folder: Path, out: Path) -> Path:
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(
            f"{folder}: GGUF export supports model_type llama, not {cfg.get('model_type')}"
        )
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(folder.name)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, folder, cfg["vocab_size"])
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        tied = cfg.get("tie_word_embeddings", False)
        for name in names:
            target = _gguf_name(name)
            if target == "output.weight" and tied:
                # A tied checkpoint may store the table under either name; GGUF wants it once.
                if "model.embed_tokens.weight" in names:
                    continue
                target = "token_embd.weight"
            if target is None:
                continue
            w = f.get_tensor(name).float()
            if target.endswith("attn_q.weight"):
                w = _rope_permute(w, heads)
            elif target.endswith("attn_k.weight"):
                w = _rope_permute(w, kv_heads)
            writer.add_tensor(target, np.ascontiguousarray(w.numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
