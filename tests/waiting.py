"""Waiting, in a test's event loop, for what another task or thread makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], object], what: str) -> None:
    """Return once ``cond()`` is true; fail naming ``what`` after a minute (a guard against a
    hang, not a timing requirement)."""
    for _ in range(6000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")
