"""Benchmarks: ``eeserve bench`` (vs HF and early-exit sweeps), ``bench report``, ``bench serve``.

Contract: every speed figure is measured side by side in one run and carries its quality; shared
timing helpers live in ``measure``, the subcommands are registered in ``cli``. The top layer
below the CLI: may import everything except the CLI (the server only over HTTP).
"""
