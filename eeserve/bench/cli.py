"""The ``eeserve bench`` command line: one place that registers every benchmark subcommand.

Contract: ``add_bench_parser(subparsers)`` adds ``eeserve bench`` (this engine vs HF and the
early-exit sweeps, ``bench.compare``) with its subcommands ``report`` (``bench.report``) and
``serve`` (``bench.serve``; ``--scenario long-prompts``: ``bench.arrivals``) and ``soak``
(``bench.soak``: overload and endurance at multiples of the server's capacity) and ``checks``
(``bench.checks``: what an exit check costs against a decoder layer) and ``structured``
(``bench.structured``: constrained decoding, jump-forward and exits under a grammar).
"""

from __future__ import annotations

import argparse
from typing import Any

from eeserve.bench.arrivals import add_arrival_args, run_arrivals
from eeserve.bench.checks import add_checks_parser
from eeserve.bench.compare import main
from eeserve.bench.report import add_report_parser
from eeserve.bench.serve import add_bench_serve_parser, run_bench_serve
from eeserve.bench.soak import add_soak_parser
from eeserve.bench.structured import add_structured_parser
from eeserve.config import QUANTIZATIONS


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark: this engine vs HF transformers (and exits)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="repeats; peer: interleaved rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/compare/bench.json")
    p.add_argument(
        "--sections",
        default="hf,exits",
        help="comma-separated: hf (engine vs HF), exits, peer (vs llama.cpp's own batched "
        "bench, interleaved; builds it once, needs cmake and a C++ compiler)",
    )
    p.add_argument(
        "--peer-formats",
        default="F32,Q8_0,own",
        help="peer: llama.cpp's weights formats (F32 vs float32; Q8_0 vs int8 and the default "
        "mode; own: the model's own GGUF, Q4_1 for smollm2, Q4_K_M for gemma3-270m or the .gguf "
        "given as --model, vs --weights native on that file); --repeats sets the rounds",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="the engine's weights in the hf and exits sections (peer runs float32, int8 and "
        "native)",
    )
    p.add_argument("--policies", default="per_sequence,batch_all")
    p.add_argument("--kv-fills", default="fill", help="fill, recompute or both")
    p.add_argument("--thresholds", default="0.5,0.8,0.9,0.95")
    p.add_argument("--measure", default=None, help="default: the model's exit config")
    p.add_argument(
        "--efficiency-layer",
        type=int,
        default=None,
        help="exit layer of the threshold-0 efficiency check (default: the first exit layer)",
    )
    p.add_argument("--exit-dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    p.set_defaults(func=main)
    sub_bench = p.add_subparsers(
        dest="bench_command", metavar="{report,serve,soak,checks,structured}"
    )
    add_report_parser(sub_bench)
    serve = add_bench_serve_parser(sub_bench)
    add_arrival_args(serve)
    serve.set_defaults(func=_serve)
    add_soak_parser(sub_bench)
    add_checks_parser(sub_bench)
    add_structured_parser(sub_bench)


def _serve(args: argparse.Namespace) -> int:
    return run_arrivals(args) if args.scenario == "long-prompts" else run_bench_serve(args)
