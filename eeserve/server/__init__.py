"""OpenAI-compatible HTTP server for the engine (``eeserve serve MODEL``).

Contract: ``add_serve_parser(subparsers)`` / ``run_serve(args)`` for the command line,
``create_app(engine, ...)`` for an ASGI app around an ``LLMEngine``. ``python -m eeserve.server
MODEL --port N`` runs the same server.
"""

from __future__ import annotations

from eeserve.server.app import create_app
from eeserve.server.launch import add_serve_args, add_serve_parser, main, run_serve

__all__ = ["add_serve_args", "add_serve_parser", "create_app", "main", "run_serve"]
