"""OpenAI-compatible HTTP server for the engine (``eeserve serve MODEL``).

Contract: ``add_serve_parser(subparsers)`` / ``run_serve(args)`` for the command line,
``create_app(engine, ...)`` for an ASGI app around an ``LLMEngine``. ``python -m eeserve.server
MODEL --port N`` runs the same server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eeserve.server.launch import add_serve_args, add_serve_parser, main, run_serve

if TYPE_CHECKING:
    from eeserve.server.app import create_app

__all__ = ["add_serve_args", "add_serve_parser", "create_app", "main", "run_serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":  # imported lazily: FastAPI is only needed to serve
        from eeserve.server.app import create_app

        return create_app
    raise AttributeError(name)
