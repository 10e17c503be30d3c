"""Engine options on the command line, shared by every command that builds an engine.

Contract: ``add_engine_args`` adds one flag per ``EngineConfig`` field (except the model, which
each command names its own way); ``engine_config`` turns the parsed flags back into a config.
"""

from __future__ import annotations

import argparse

from eeserve.config import (
    EXIT_POLICIES,
    KV_FILL_STRATEGIES,
    QUANTIZATIONS,
    SPECULATIVE_DRAFTS,
    EngineConfig,
)


def add_engine_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=512 * 2**20,
        help="KV pool: bytes, or a fraction (0, 1] of free memory",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="positions per forward pass (prompts longer than this are prefilled in chunks); "
        "default 112, or --max-num-seqs + 48 when that is more",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mix decode rows and prompt chunks in one pass (no decode stalls on long prompts)",
    )
    p.add_argument(
        "--attention-context",
        type=float,
        default=None,
        help="a prompt chunk's position p counts 1 + p / this against the budget "
        "(default: from the model's shape and the device; 0: one per position)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--exit-policy", default="per_sequence", choices=EXIT_POLICIES)
    p.add_argument("--kv-fill", default="fill", choices=KV_FILL_STRATEGIES)
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weight-only int8 projections and LM head (activations stay in --dtype)",
    )
    p.add_argument(
        "--speculative-draft",
        default="auto",
        choices=SPECULATIVE_DRAFTS,
        help="what drafts for speculative-mode requests: the exit heads, or an int8 copy of the "
        "model's weights (full depth; loaded beside the float weights); auto: the model's "
        "default (its exit config's default_draft)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        attention_context=args.attention_context,
        exit_policy=args.exit_policy,
        kv_fill=args.kv_fill,
        quantization=args.quantization,
        speculative_draft=args.speculative_draft,
    )
