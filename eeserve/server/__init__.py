"""OpenAI-compatible HTTP server for the engine (``eeserve serve MODEL``).

Contract: ``add_serve_parser(subparsers)`` / ``run_serve(args)`` for the command line,
``create_app(engine, ...)`` for an ASGI app around an ``LLMEngine``; ``add_batch_parser`` /
``run_batch(args)`` for ``eeserve batch`` (OpenAI batch files, validated and answered by the same
code). ``python -m eeserve.server MODEL --port N`` runs the same server.
"""

from __future__ import annotations

from eeserve.server.app import create_app
from eeserve.server.batch_cli import add_batch_parser, run_batch
from eeserve.server.launch import add_serve_args, add_serve_parser, main, run_serve

__all__ = [
    "add_batch_parser",
    "add_serve_args",
    "add_serve_parser",
    "create_app",
    "main",
    "run_batch",
    "run_serve",
]
