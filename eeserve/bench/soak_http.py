"""The soak's HTTP client: HTTP/1.1 on asyncio streams, lean enough to time hundreds at once.

Contract: ``LeanClient(base_url, headers)`` sends requests over keep-alive connections of its own
(one per request in flight; a connection goes back to the idle ones when its response was read to
the end, and is closed otherwise: a client that leaves a stream early hangs up, as the soak's
planned disconnects mean to). ``stream(method, path, json=, content=, headers=)`` is an async
context manager yielding a ``LeanResponse`` with ``status_code``, ``headers`` (lower-case names),
``aread()`` and ``aiter_lines()``: the part of ``httpx.AsyncClient.stream`` that ``soak_load.send``
uses, so that either client drives it. ``preconnect(n)`` opens connections ahead of a burst;
``aclose()`` closes every connection. Any failure to connect, send or read is an ``HTTPFailure``.

Why not httpx: with 400 requests in flight its connection pool and per-request layers held the
client's event loop for seconds (0.8-1.2 s to a 429 that a trivial server answered, the loop late by
up to 4.8 s), so the client, not the server, set every latency it timed; this client, its
connections opened before a burst, times the same 429s in 10-36 ms at p50 on this project's 2-core
VM. It speaks only what the soak needs: a request with a JSON body or none, and a response whose
body has a ``Content-Length`` or is chunked.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit


class HTTPFailure(Exception):
    """The request could not be sent or its response not read (connection refused or reset,
    a malformed answer)."""


class _Stale(HTTPFailure):
    """The connection closed before a byte of the response came: on a kept-alive connection,
    one the server had closed, and the request is sent again on a new one."""


class LeanResponse:
    def __init__(self, reader: asyncio.StreamReader, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            self.status_code = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise HTTPFailure(f"malformed status line: {lines[0]!r}") from None
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                self.headers[name.strip().lower()] = value.strip()
        self._reader = reader
        chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self._left = None if chunked else int(self.headers.get("content-length", "0"))
        self.done = False

    @property
    def reusable(self) -> bool:
        return self.done and self.headers.get("connection", "").lower() != "close"

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        if self._left is not None:  # Content-Length
            data = await self._reader.readexactly(self._left) if self._left else b""
            self.done = True
            if data:
                yield data
            return
        while True:  # chunked: size line, data, CRLF; a zero size ends it
            size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self._reader.readexactly(size + 2)
            if size == 0:
                self.done = True
                return
            yield data[:-2]

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        pending = ""
        async for chunk in self.aiter_bytes():
            pending += chunk.decode()
            *lines, pending = pending.split("\n")
            for line in lines:
                yield line.rstrip("\r")
        if pending:
            yield pending


class LeanClient:
    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._headers = f"Host: {url.netloc}\r\n{extra}"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self, reuse: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while reuse and self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof():
                return reader, writer
            writer.close()  # the server closed it while it was idle
        try:
            return await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise HTTPFailure(f"connect: {e}") from e

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> AsyncIterator[LeanResponse]:
        body = content if json is None else jsonlib.dumps(json).encode()
        fields = dict(headers or {})
        if json is not None:
            fields["content-type"] = "application/json"
        extra = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        head = (
            f"{method} {path} HTTP/1.1\r\n{self._headers}{extra}Content-Length: {len(body)}\r\n\r\n"
        )
        request = head.encode() + body
        reader, writer = await self._connect(reuse=True)
        response: LeanResponse | None = None
        try:
            try:
                response = await self._send(reader, writer, request)
            except _Stale:  # a kept-alive connection that the server closed meanwhile
                writer.close()
                reader, writer = await self._connect(reuse=False)
                response = await self._send(reader, writer, request)
            yield response
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            raise HTTPFailure(f"{type(e).__name__}: {e}") from e
        finally:
            if response is not None and response.reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> LeanResponse:
        writer.write(request)
        try:
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                raise
            raise _Stale from e
        return LeanResponse(reader, head)

    async def preconnect(self, n: int) -> None:
        """Have ``n`` open idle connections (a closed one is replaced), as a load balancer's
        pool would keep them."""
        for reader, writer in self._idle:
            if reader.at_eof():
                writer.close()
        self._idle = [(r, w) for r, w in self._idle if not r.at_eof()]
        while len(self._idle) < n:
            self._idle.append(await self._connect(reuse=False))

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
