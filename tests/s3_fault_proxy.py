"""An S3 endpoint for the tests that passes every request on to a real one (SeaweedFS)
and breaks what it is told to: the store down, slow, throttling, full, or an upload cut
halfway. It runs its own event loop on a thread of its own, so it serves a test's
in-process batch, blocking store calls and ``comfy-assets`` subprocesses alike.

Requests go on with their headers as sent (``Host`` included), so the server checks the
client's own signatures."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
from aiohttp import web
from yarl import URL

# Headers of a message's framing, which each side sets for itself.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_WRITES = frozenset({"PUT", "POST"})


def _error(status: int, code: str) -> web.Response:
    body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code></Error>"
    return web.Response(status=status, text=body, content_type="application/xml")


class S3FaultProxy:
    """Passes requests to ``target`` (``http://127.0.0.1:PORT``), at ``endpoint`` once
    ``running``. The faults, set from any thread:

    - ``down``: every request's connection is aborted, no answer (a store that is down);
    - ``delay_s``: every answer comes this many seconds late (a slow store);
    - ``slowdown``: the next that many writes (PUT, POST) are answered 503 SlowDown;
    - ``full``: every write is answered 507 InsufficientStorage (a bucket over its quota);
    - ``cut_uploads``: the next that many writes are cut after half their body came: the
      connection is aborted, nothing passed on.

    ``counts``: requests by what became of them (``passed``, ``down``, ``slowdown``,
    ``full``, ``cut``)."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.down = False
        self.delay_s = 0.0
        self.slowdown = 0
        self.full = False
        self.cut_uploads = 0
        self.counts: dict[str, int] = {}
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-fault-proxy")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @contextmanager
    def running(self) -> Iterator[S3FaultProxy]:
        """Serve at ``endpoint`` for the block."""
        self._thread.start()
        try:
            self._call(self._start())
            yield self
        finally:
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)  # type: ignore[arg-type]

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _abort(self, request: web.Request, what: str) -> web.Response:
        self._count(what)
        if request.transport is not None:
            request.transport.abort()  # a reset, no answer
        return web.Response(status=503)  # never sent: the connection is gone

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            return self._abort(request, "down")
        write = request.method in _WRITES
        if write and self.cut_uploads > 0:
            self.cut_uploads -= 1
            await request.content.readexactly((request.content_length or 0) // 2)
            return self._abort(request, "cut")
        body = await request.read()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the fault itself: a store that answers late
        if write and self.slowdown > 0:
            self.slowdown -= 1
            self._count("slowdown")
            return _error(503, "SlowDown")
        if write and self.full:
            self._count("full")
            return _error(507, "InsufficientStorage")
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _FRAMING}
        async with self._session.request(
            request.method,
            URL(self.target + request.raw_path, encoded=True),  # the path as signed
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding"),
        ) as answer:
            data = await answer.read()
            out = {k: v for k, v in answer.headers.items() if k.lower() not in _FRAMING}
            self._count("passed")
            return web.Response(status=answer.status, body=data, headers=out)
