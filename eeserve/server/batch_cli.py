"""``eeserve batch INPUT.jsonl --output OUTPUT.jsonl``: an OpenAI batch file through the engine.

Contract: ``add_batch_parser(subparsers)`` adds the sub-command; ``run_batch(args)`` reads the
input (``batch.read_envelopes``), resumes from an existing output (finished ``custom_id``s are
skipped, failed lines retried), runs the rest in this process through one engine with every
request batched (``BatchProcessor``), appends one line per request to the output with a tqdm
progress bar (lines and generated tokens/s), and returns 0 when every line succeeded, 1 when any
failed. ``--ray`` runs the same processing sharded over a Ray cluster (``batch_ray.run_on_ray``)
and writes the same lines. A missing input file is a ``ValueError`` (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eeserve.engine.llm_engine import LLMEngine
from eeserve.engine_args import add_engine_args, engine_config
from eeserve.server.batch import OutputWriter, count_lines, read_envelopes, resume_output
from eeserve.server.batch_ray import RayBatchOptions, run_on_ray
from eeserve.server.batch_run import BatchProcessor

DESCRIPTION = (
    "Run an OpenAI batch file (one request per line: custom_id, method, url = /v1/completions "
    "or /v1/chat/completions, body) and write OpenAI batch output lines (id, custom_id, "
    "response {status_code, request_id, body}, error). Bodies are validated and answered "
    "exactly as `eeserve serve` does, `early_exit` included. Rerunning with an existing output "
    "skips the custom_ids already answered."
)


def add_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "batch", help="run an OpenAI batch file offline", description=DESCRIPTION
    )
    p.add_argument("input", help="batch input (.jsonl)")
    p.add_argument("--output", required=True, help="batch output (.jsonl); resumed if it exists")
    p.add_argument("--model", default="smollm2", help="smollm2, an HF folder or a .gguf file")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="name(s) the bodies' `model` may use (default: the --model value); repeatable",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    r = p.add_argument_group("Ray (needs the `ray` extra)")
    r.add_argument(
        "--ray", action="store_true", help="shard the file over a Ray cluster (Ray Data)"
    )
    r.add_argument(
        "--ray-address", default=None, help="Ray cluster to run on (default: start one here)"
    )
    r.add_argument("--replicas", type=int, default=2, help="engine actors (with --ray)")
    r.add_argument(
        "--threads-per-replica", type=int, default=1, help="CPUs (torch threads) per actor"
    )
    add_engine_args(p.add_argument_group("engine options"))
    p.set_defaults(func=run_batch)
    return p


class Progress:
    """Output lines as they come: written, counted, shown with generated tokens per second."""

    def __init__(self, writer: OutputWriter, total: int, done: int, enabled: bool) -> None:
        self.writer = writer
        self.bar = tqdm(total=total, initial=min(done, total), unit="req", disable=not enabled)
        self.tokens = 0
        self.start = time.perf_counter()

    def __call__(self, out: dict[str, Any]) -> None:
        self.writer.write(out)
        body = (out.get("response") or {}).get("body") or {}
        self.tokens += int((body.get("usage") or {}).get("completion_tokens", 0))
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix(tok_s=f"{self.tokens / elapsed:.1f}", failed=self.writer.failed)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_batch(args: argparse.Namespace) -> int:
    source, output = Path(args.input), Path(args.output)
    if not source.is_file():
        raise ValueError(f"batch input {source} is not a file")
    if not args.ray and args.ray_address is not None:
        raise ValueError("--ray-address needs --ray")
    if args.replicas < 1 or args.threads_per_replica < 1:
        raise ValueError("--replicas and --threads-per-replica must be >= 1")
    done = resume_output(output)
    items = read_envelopes(source, done)
    names = args.served_model_name or [args.model]
    writer = OutputWriter(output)
    progress = Progress(writer, count_lines(source), len(done), not args.no_progress)
    try:
        if args.ray:
            opts = RayBatchOptions(
                engine=dataclasses.asdict(engine_config(args)),
                model_names=names,
                replicas=args.replicas,
                threads=args.threads_per_replica,
                address=args.ray_address,
            )
            run_on_ray(opts, items, progress)
        else:
            BatchProcessor(LLMEngine(engine_config(args)), names).run(items, progress)
    finally:
        progress.close()
        writer.close()
    print(
        f"{writer.written} lines written ({writer.failed} failed), {len(done)} already done "
        f"-> {output}",
        file=sys.stderr,
    )
    return 1 if writer.failed else 0
