"""A TCP proxy the test cuts and restores: a database outage (a restart, a failover) that
touches only the processes pointed at it, not the machine's shared PostgreSQL.

It runs its own event loop on a thread of its own, so a test's in-process store calls,
which block whichever thread makes them, never stand between it and its clients.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TcpProxy:
    """Forwards ``listen_host:port`` (``127.0.0.1`` by default) to
    ``target_host:target_port`` while up.

    ``cut()``: every open connection is closed and new ones are refused (nothing listens
    on the port), as during a server restart. ``restore()``: it listens again on the same
    port. ``connections``: how many were accepted so far; ``bytes_sent``: how many bytes
    the clients sent to the target. Both are safe from any thread
    and return once done.
    """

    def __init__(
        self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        with socket.socket() as probe:  # a free port, kept for the proxy's whole life
            probe.bind((listen_host, 0))
            self.port = probe.getsockname()[1]
        self.connections = 0
        self.bytes_sent = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @contextmanager
    def running(self) -> Iterator[TcpProxy]:
        """Start (listening), yield, then stop the proxy and its thread."""
        self._thread.start()
        try:
            self.restore()
            yield self
        finally:
            self.cut()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._restore())

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _restore(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._serve, self.listen_host, self.port, reuse_address=True
            )

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as a server killed mid-conversation
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update({writer, up_writer})
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, sent=True),
                self._pipe(up_reader, writer),
                return_exceptions=True,
            )
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: bool = False
    ) -> None:
        try:
            while data := await reader.read(65536):
                if sent:
                    self.bytes_sent += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()  # one side gone: the other goes too
