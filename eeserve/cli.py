"""Command line: ``eeserve fetch | generate | bench | serve | batch``.

Contract: argument parsing and printing only; all work is done by the engine, the loader, the
benchmark, tuning and server packages, whose subcommands are registered here.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from eeserve.bench.cli import add_bench_parser
from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine_args import add_engine_args, engine_config
from eeserve.exit_params import ExitParams
from eeserve.llm import chat_token_ids
from eeserve.models.loader import resolve_model
from eeserve.sampling_params import SamplingParams
from eeserve.server import add_batch_parser, add_serve_parser
from eeserve.tuning.calibrate import add_calibrate_parser
from eeserve.tuning.cli import add_tune_parser
from eeserve.tuning.shortlist import add_shortlist_parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download and convert a named model (once)")
    f.add_argument("--model", default="smollm2", help="smollm2 or gemma3-270m")

    g = sub.add_parser("generate", help="generate text, streamed to the terminal")
    g.add_argument(
        "--model", default="smollm2", help="smollm2, gemma3-270m, an HF folder or a .gguf file"
    )
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="confidence threshold for early exit (default: the model's exit config)",
    )
    g.add_argument(
        "--exit-measure",
        default=None,
        choices=["softmax_margin", "max_prob", "hidden_cosine", "classifier"],
    )
    g.add_argument(
        "--exit-mode",
        default=None,
        choices=["exit", "speculative"],
        help="speculative: exits draft and the deep layers verify (output = full depth)",
    )
    g.add_argument(
        "--num-draft-tokens", type=int, default=None, help="speculative: most drafts per verify"
    )
    g.add_argument("--no-exit", action="store_true", help="full depth")
    g.add_argument("--show-exits", action="store_true", help="annotate tokens with exit layers")

    add_bench_parser(sub)
    add_tune_parser(sub)
    add_calibrate_parser(sub)
    add_shortlist_parser(sub)
    add_serve_parser(sub)
    add_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    try:
        return int(args.func(args)) if hasattr(args, "func") else _dispatch(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "fetch":
        print(resolve_model(args.model))
        return 0
    if args.command == "generate":
        return _generate(args)
    raise AssertionError(args.command)


def _exit_params(args: argparse.Namespace) -> ExitParams | None:
    """The request's exit rule from the flags (None: the model's default mode)."""
    if args.no_exit:
        return ExitParams(enabled=False)
    rule = (args.exit_threshold, args.exit_measure, args.exit_mode, args.num_draft_tokens)
    if all(x is None for x in rule):
        return None
    return ExitParams(
        threshold=args.exit_threshold,
        measure=args.exit_measure,
        mode=args.exit_mode,
        num_draft_tokens=args.num_draft_tokens,
    )


def _generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    exit_params = _exit_params(args)
    if args.chat:
        ids = chat_token_ids(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        ids = engine.tokenize(args.prompt)
    rid = engine.add_request(args.prompt, params, prompt_token_ids=ids, exit_params=exit_params)
    printer = _StreamPrinter(engine.tokenizer, args.show_exits, engine.model_config.num_layers)
    start = time.perf_counter()
    first: float | None = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            first = first or time.perf_counter()
            printer.update(out.outputs[0])
            final = out
    end = time.perf_counter()
    print()
    assert final is not None
    c = final.outputs[0]
    n = len(c.token_ids)
    decode_s = end - (first or end)
    stats = c.exit_stats
    print(
        f"--- {n} tokens in {end - start:.2f}s: {n / (end - start):.1f} tok/s overall, "
        f"{(n - 1) / decode_s if n > 1 and decode_s > 0 else float('nan'):.1f} tok/s decode, "
        f"TTFT {((first or end) - start) * 1000:.0f} ms; finish={c.finish_reason}",
        file=sys.stderr,
    )
    if stats is not None and stats.acceptance_rate is not None:
        layer = f"{stats.mean_draft_layer:.1f}" if stats.mean_draft_layer else "-"
        source = "int8 copy" if engine.speculative_draft == "int8" else "exits"
        print(
            f"--- speculative, {source} drafts (output = full depth): acceptance "
            f"{stats.acceptance_rate:.1%}, mean draft length {stats.mean_draft_length:.2f}, "
            f"mean draft layer {layer}/{stats.num_layers}",
            file=sys.stderr,
        )
    elif stats is not None:
        print(
            f"--- exits: mean exit layer {stats.mean_exit_layer:.2f}/{stats.num_layers}, "
            f"layers saved {stats.layers_saved_fraction:.1%}",
            file=sys.stderr,
        )
    return 0


class _StreamPrinter:
    """Prints the new text of a completion; with exits shown, one coloured piece per token."""

    _COLORS = ("\033[32m", "\033[36m", "\033[33m", "\033[35m", "\033[31m")

    def __init__(self, tokenizer: Any, show_exits: bool, num_layers: int) -> None:
        self.tokenizer = tokenizer
        self.show_exits = show_exits
        self.num_layers = num_layers
        self.printed_text = 0
        self.printed_tokens = 0
        self.tty = sys.stdout.isatty()

    def update(self, c: Any) -> None:
        if not self.show_exits:
            sys.stdout.write(c.text[self.printed_text :])
            self.printed_text = len(c.text)
        else:
            for tok, layer in zip(
                c.token_ids[self.printed_tokens :], c.exit_layers[self.printed_tokens :]
            ):
                piece = self.tokenizer.decode([tok])
                if self.tty:
                    color = self._COLORS[min(4, (layer - 1) * 5 // self.num_layers)]
                    sys.stdout.write(f"{color}{piece}\033[0m")
                else:
                    sys.stdout.write(f"{piece}[{layer}]")
            self.printed_tokens = len(c.token_ids)
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
