"""Refusals and ``/health`` at the ingress of replicas (Ray Serve's proxy), from the state the
replicas publish: a burst's overflow and a health check never wait for a busy replica.

Contract: ``ReplicaState`` is what each replica publishes every ``PUBLISH_S`` seconds through
the metrics hub (``replicas.EngineReplica``; ``replica_state`` builds it): whether its engine
serves, the engine requests its admission control holds (reserved, waiting and running), how
many more of the recent mean cost it would admit now (``Admission.room``), the refusal it
answers otherwise (its ``type`` and ``Retry-After``) and a digest of the ``Authorization``
header it expects (empty: no key). ``IngressGate`` is pure ASGI middleware that Ray Serve's
proxy runs in front of its routing (``proxy_middlewares``, which the proxy imports from the
``PROXY_CALLBACK_ENV`` variable that ``replicas.init_ray`` sets for a cluster it starts). It
asks its ``StateSource`` (the hub, by default) for the fresh states every ``POLL_S`` seconds,
handing it its refusal counts, and from the latest view (no older than ``STALE_S``):

- ``GET /health`` is answered ``{"status": "ok"}`` at once while some replica's engine serves.
- A ``POST`` to a generation path that carries the replicas' key is answered 429 at once (its
  body drained unread; ``Retry-After``, OpenAI's ``rate_limit_exceeded`` body, the replicas'
  limit as its ``type``) while the generation requests this gate has let through and not seen
  answered are as many as the replicas hold plus their least room times their number (Ray, not
  the gate, picks each request's replica): a request on its way to a replica counts against the
  room it is about to take. Refusals are counted by ``type``.

A request let through waits until the burst it came in has stopped arriving before it is
routed (``arrivals.Arrivals``, at most 50 ms), so that the refusals of the requests that came
with it are answered first. Everything else goes on to
Ray's routing untouched, and so does every request while the gate has
no fresh view (no replica deployed yet, a hub that does not answer): then, and for every request
it lets through, the replica's own admission control decides, as without the gate.

Why: Ray's proxy routes each request to a replica and asks replicas for their queue lengths to
do so; a replica whose event loop is busy answers late, so under a burst of 400 chat requests a
429 took 1.3 s at p50 and ``/health`` up to 2 s (docs/server.md). Counting here costs the proxy
a few microseconds a request, and the replicas nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from eeserve.server.arrivals import Arrivals

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
HUB_NAME = "eeserve-metrics"
NAMESPACE = "eeserve"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "eeserve.server.ingress.proxy_middlewares"
PUBLISH_S = 0.05  # how often a replica publishes its state
POLL_S = 0.05  # how often the gate asks for the states
STALE_S = 2.0  # a state, or the gate's view, older than this is not used


@dataclass(frozen=True, kw_only=True)
class ReplicaState:
    replica: str
    serving: bool  # its engine runs and it is not shutting down
    held: int  # engine requests its admission control holds: reserved, waiting, running
    room: int  # more requests of the recent mean cost it would admit now
    limit: str = "requests"  # with room 0: the 429's ``type`` it would answer
    retry_after: int = 1  # with room 0: the ``Retry-After`` it would answer
    key_digest: str = ""  # sha256 of the Authorization header it expects; "" without a key


def key_digest(api_key: str | None) -> str:
    return hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest() if api_key else ""


# The fresh replica states, given the gate's refusal counts by type (to publish).
StateSource = Callable[[dict[str, int]], Awaitable[list[ReplicaState]]]


@dataclass(frozen=True, kw_only=True)
class GateView:
    """What the gate decides from: the latest fresh states, summed."""

    capacity: int  # requests the serving replicas hold, plus their least room times their number
    serving: bool
    limit: str
    retry_after: int
    digests: frozenset[str]

    @classmethod
    def of(cls, states: list[ReplicaState]) -> GateView | None:
        live = [s for s in states if s.serving]
        if not live:
            return None  # nothing to decide from: the replicas answer
        full = [s for s in live if s.room == 0] or live
        # Ray routes each request to the replica it picks (the fewest requests in flight), not
        # to the one with room: new requests split about evenly, so the least room, times the
        # replicas, is what fits (the sum of their rooms let 1 in 5 through only to be refused
        # by a replica under a 400-request burst, slowly).
        return cls(
            capacity=sum(s.held for s in live) + len(live) * min(s.room for s in live),
            serving=True,
            limit=min(full, key=lambda s: s.retry_after).limit,
            retry_after=max(1, min(s.retry_after for s in full)),
            digests=frozenset(s.key_digest for s in live),
        )


class IngressGate:
    def __init__(
        self, app: ASGIApp, source: StateSource | None = None, poll_s: float = POLL_S
    ) -> None:
        self.app = app
        self.source = source or hub_source()
        self.poll_s = poll_s
        self.open = 0  # generation requests let through and not answered yet
        self.refused: dict[str, int] = {}
        self._view: GateView | None = None
        self._view_at = 0.0
        self._poller: asyncio.Task[None] | None = None
        self.arrivals = Arrivals()

    @property
    def view(self) -> GateView | None:
        fresh = time.monotonic() - self._view_at <= STALE_S
        return self._view if fresh else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        method, path = scope.get("method"), scope.get("path")
        if scope["type"] != "http" or (method, path) not in _GATED:
            await self.app(scope, receive, send)
            return
        view = self.view
        if path == "/health":
            if view is None:
                await self.app(scope, receive, send)
            else:
                await _respond(send, 200, b'{"status":"ok"}', [])
            return
        self.arrivals.arrived()
        if view is not None and self.open >= view.capacity and _authorized(scope, view):
            await self._refuse(receive, send, view)
            return
        self.open += 1
        try:
            # Behind the requests that came with it: those beyond the room are refused
            # (microseconds each) before this one is routed (Ray's routing, in Python).
            await self.arrivals.settled()
            await self.app(scope, receive, send)
        finally:
            self.open -= 1

    async def _refuse(self, receive: Receive, send: Send, view: GateView) -> None:
        while (await receive()).get("more_body"):
            pass  # already buffered: reading it keeps the connection usable
        self.refused[view.limit] = self.refused.get(view.limit, 0) + 1
        message = (
            f"the server is overloaded: every replica's queue is full ({self.open} requests "
            f"in flight); retry after {view.retry_after} s"
        )
        error = {
            "message": message,
            "type": view.limit,
            "param": None,
            "code": "rate_limit_exceeded",
        }
        body = json.dumps({"error": error}).encode()
        await _respond(send, 429, body, [(b"retry-after", str(view.retry_after).encode())])

    async def _poll(self) -> None:
        while True:
            try:
                self._view = GateView.of(await self.source(dict(self.refused)))
                self._view_at = time.monotonic()
            except Exception:  # no hub yet, or gone: pass everything through meanwhile
                log.debug("ingress gate: no replica states", exc_info=True)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.poll_s)


_GATED = {("GET", "/health"), *(("POST", p) for p in GENERATION_PATHS)}


def _authorized(scope: Scope, view: GateView) -> bool:
    """The request carries the key the replicas expect (or they expect none): one without it
    gets the replicas' 401, not the gate's 429."""
    if view.digests == frozenset({""}):
        return True
    given = dict(scope.get("headers") or []).get(b"authorization", b"")
    digest = hashlib.sha256(given).hexdigest()
    return any(hmac.compare_digest(digest, d) for d in view.digests if d)


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def hub_source() -> StateSource:
    """The states from the metrics hub actor (found by name once it exists)."""
    hub: Any = None

    async def fetch(refused: dict[str, int]) -> list[ReplicaState]:
        nonlocal hub
        try:
            if hub is None:
                import ray  # only ever called inside Ray Serve's proxy

                hub = await asyncio.to_thread(ray.get_actor, HUB_NAME, namespace=NAMESPACE)
            states: list[ReplicaState] = await hub.exchange.remote(refused)
            return states
        except Exception:
            hub = None  # look it up again: a new deployment has a new hub
            raise

    return fetch


def proxy_middlewares() -> list[Any]:
    """Ray Serve's proxy callback (``PROXY_CALLBACK``): the gate in front of its routing."""
    return [Middleware(IngressGate)]
