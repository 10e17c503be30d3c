"""Letting a burst's cheap answers go first: requests that will be served wait until the burst
they came in has stopped arriving.

Contract: an ``Arrivals`` counts the requests that reach a point of the server (``arrived()``,
on the event loop). ``await settled()`` returns once no request has arrived for two turns of
the event loop, or after ``max_wait`` seconds whatever arrives (a steady flood must not hold a
request for longer). Used before the expensive work of a request that goes on (parsing its
body, routing it), by ``refusal.EarlyRefusal`` and the replicas' ``ingress.IngressGate``.

Why: a burst's requests reach the server over the client's sending time (10-20 ms for 400 on
this project's 2-core VM), and the event loop serves them in the order they come, each up to
its first wait. Yielding once lets the refusals already queued go first, but not those still
arriving: they waited behind the bodies being parsed (~0.5 ms each, ~60 of them). Two turns,
because a request whose bytes arrive in one turn starts running in the next.
"""

from __future__ import annotations

import asyncio
import time

DEFAULT_MAX_WAIT_S = 0.05


class Arrivals:
    def __init__(self, max_wait: float = DEFAULT_MAX_WAIT_S) -> None:
        self.count = 0
        self.max_wait = max_wait

    def arrived(self) -> None:
        self.count += 1

    async def settled(self) -> None:
        end = time.monotonic() + self.max_wait
        while True:
            seen = self.count
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if self.count == seen or time.monotonic() >= end:
                return
