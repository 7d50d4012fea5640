"""FaultProxy: a small asyncio TCP proxy that breaks connections on purpose.

    proxy = FaultProxy("http://127.0.0.1:8188", seed=7, cuts=2, cut_within_s=1.0,
                       view_404={"inverted_*": 2, "solid_00003_.png": None},
                       lose_answer={"POST /prompt": 1, "GET /view": 1})
    async with proxy.serve(port=0) as url:     # "http://127.0.0.1:PORT"
        ...                                    # point a client at url (HTTP and /ws)
    with proxy.serve_in_thread(port=0) as url:  # own loop in a daemon thread
        ...
    proxy.stats   # {"connections": N, "cut": N, "view_404": N, "lost_answers": N}

Faults, each bounded so that a client can still get through:

- **socket cuts**: each new connection (HTTP or the /ws WebSocket) is, with probability
  ``cut_probability``, aborted (RST, no close frame, no response) at a time drawn
  uniformly from ``[0, cut_within_s)`` seconds after it was accepted, until ``cuts``
  connections have been cut. The times come from ``random.Random(seed)``, drawn in accept
  order. ``cut_all()`` aborts every open connection at once.
- **/view 404**: a ``GET /view`` whose ``filename`` matches a key of ``view_404`` (an
  ``fnmatch`` pattern) is answered ``404 Not Found`` by the proxy itself, as ComfyUI
  answers a file missing from its output folder (basics.json), for the first N such
  requests (the value), or every one (``None``). The server never sees those requests.
- **lost answers**: for the first N requests whose "METHOD /path" starts with a key of
  ``lose_answer`` (``"POST /prompt"``, ``"GET /view"``), the request reaches the server,
  which handles it and answers; the client gets the first half of the answer's first
  chunk, then the connection is aborted. A prompt posted so is queued, though its
  client never learns it; a download so ends midway.

HTTP/1.1 requests are read one by one on each connection (a head, then a body of
``Content-Length`` bytes), so a kept-alive connection is inspected request by request;
after a WebSocket upgrade or a chunked body the bytes are passed through unread. The
proxy answers a connection refused by the target by closing the client's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
import random
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from urllib.parse import parse_qs, urlsplit

from fake_comfy.threads import serve_in_thread

log = logging.getLogger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class FaultProxy:
    """A TCP proxy in front of ``target`` ("http://host:port" or "host:port") that cuts
    sockets, answers 404 to listed ``GET /view`` requests and loses listed answers (see
    the module docstring).

    seed: seeds the cut draws. cut_probability: chance (0..1) that a new connection is
    cut. cut_within_s: a cut lands within this many seconds of the accept. cuts: at most
    this many connections are cut (0: none). view_404: ``{fnmatch pattern of filename:
    count or None (every time)}``. lose_answer: ``{"METHOD /path" prefix: count}``.
    Raises ValueError for a probability outside 0..1, a negative count or time, or a
    target without a host and port.
    """

    def __init__(
        self,
        target: str,
        *,
        seed: int = 0,
        cut_probability: float = 1.0,
        cut_within_s: float = 1.0,
        cuts: int = 0,
        view_404: Mapping[str, int | None] | None = None,
        lose_answer: Mapping[str, int] | None = None,
    ) -> None:
        if not 0.0 <= cut_probability <= 1.0 or cut_within_s < 0 or cuts < 0:
            raise ValueError(
                f"need 0 <= cut_probability <= 1, cut_within_s >= 0, cuts >= 0; got "
                f"{cut_probability}, {cut_within_s}, {cuts}"
            )
        parts = urlsplit(target if "//" in target else f"//{target}")
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"target needs a host and a port, got {target!r}")
        self.target_host: str = parts.hostname
        self.target_port: int = parts.port
        self.cut_probability = cut_probability
        self.cut_within_s = cut_within_s
        self.cuts_left = cuts
        self.view_404: dict[str, int | None] = dict(view_404 or {})
        self.lose_answer: dict[str, int] = dict(lose_answer or {})
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stats = {"connections": 0, "cut": 0, "view_404": 0, "lost_answers": 0}
        self._open: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url: str | None = None

    @property
    def stats(self) -> dict[str, int]:
        """{"connections": accepted, "cut": aborted at a drawn time, "view_404": answered
        404, "lost_answers": answers cut short}."""
        with self._lock:
            return dict(self._stats)

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def cut_all(self) -> None:
        """Abort every open connection now (safe from any thread)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FaultProxy is not serving")

        def cut() -> None:
            for task in list(self._open):
                task.cancel()

        loop.call_soon_threadsafe(cut)

    def _take_404(self, head: bytes) -> bool:
        """Whether the request with this head is a listed GET /view to answer 404."""
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        method, _, rest = line.partition(" ")
        path = rest.partition(" ")[0]
        parts = urlsplit(path)
        if method != "GET" or parts.path != "/view":
            return False
        filename = parse_qs(parts.query).get("filename", [""])[0]
        with self._lock:
            for pattern, left in self.view_404.items():
                if fnmatch.fnmatchcase(filename, pattern) and (left is None or left > 0):
                    if left is not None:
                        self.view_404[pattern] = left - 1
                    self._stats["view_404"] += 1
                    return True
        return False

    def _take_lost(self, head: bytes) -> bool:
        """Whether the answer to the request with this head is to be lost."""
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        with self._lock:
            for prefix, left in self.lose_answer.items():
                if line.startswith(prefix) and left > 0:
                    self.lose_answer[prefix] = left - 1
                    self._stats["lost_answers"] += 1
                    return True
        return False

    def _cut_delay(self) -> float | None:
        """Seconds until this new connection is cut, or None (drawn in accept order)."""
        with self._lock:
            if self.cuts_left <= 0 or self._rng.random() >= self.cut_probability:
                return None
            self.cuts_left -= 1
            return self._rng.uniform(0.0, self.cut_within_s)

    # -- serving --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, port: int = 0, host: str = "127.0.0.1") -> AsyncIterator[str]:
        """Listens on ``host``:``port`` (0 = a free port) and yields "http://host:port";
        on exit closes the listener and every connection. Raises OSError if the port
        cannot be bound."""
        self._loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self._accept, host, port)
        bound = server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        try:
            yield self.url
        finally:
            server.close()
            for task in list(self._open):
                task.cancel()
            if self._open:
                await asyncio.wait(list(self._open))
            await server.wait_closed()
            self._loop = None
            self.url = None

    def serve_in_thread(
        self, port: int = 0, host: str = "127.0.0.1"
    ) -> AbstractContextManager[str]:
        """``serve()`` on its own event loop in a daemon thread; yields the URL once it
        listens, stops and joins the thread on exit. Raises what ``serve()`` raised."""
        return serve_in_thread(self.serve, "fault_proxy", port, host)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count("connections")
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        delay = self._cut_delay()
        timer = None
        if delay is not None:
            timer = asyncio.get_running_loop().call_later(delay, self._cut, task)
        upstream: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, upstream = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError as ex:
                log.info("fault_proxy: target %s refused: %s", self.target_port, ex)
                return
            lose = asyncio.Event()  # set: the next answer is cut short
            back = asyncio.create_task(_pipe(up_reader, writer, lose))
            try:
                await self._requests(reader, writer, upstream, lose)
            finally:
                back.cancel()
                await asyncio.wait([back])
        except asyncio.CancelledError:
            # A cut (or the proxy stopping): abort both sides, no FIN, no response.
            writer.transport.abort()
            if upstream is not None:
                upstream.transport.abort()
            return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if timer is not None:
                timer.cancel()
            self._open.discard(task)
        for w in (writer, upstream):
            if w is not None:
                w.close()

    def _cut(self, task: asyncio.Task[None]) -> None:
        if task in self._open:
            self._count("cut")
            task.cancel()

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        upstream: asyncio.StreamWriter,
        lose: asyncio.Event,
    ) -> None:
        """Forward request after request; answer listed /view requests with 404; mark
        the answers to lose (the reverse ``_pipe`` cuts them short)."""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed between requests
            if len(head) > _MAX_HEAD_BYTES:
                raise ConnectionError("request head too large")
            if self._take_404(head):
                client.write(_NOT_FOUND)
                await client.drain()
                return
            headers = _headers(head)
            if self._take_lost(head):
                lose.set()
            upstream.write(head)
            if "upgrade" in headers or "chunked" in headers.get("transfer-encoding", ""):
                await _pipe(reader, upstream)  # a WebSocket, or a body we do not frame
                return
            length = int(headers.get("content-length", "0"))
            if length:
                upstream.write(await reader.readexactly(length))
            await upstream.drain()


def _headers(head: bytes) -> dict[str, str]:
    """Header names (lowercase) to values of a request head."""
    out: dict[str, str] = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip().lower()
    return out


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: asyncio.Event | None = None
) -> None:
    """Copy bytes until ``reader`` ends, then close ``writer``. When ``lose`` is set, the
    next chunk read is cut short: half of it is written, then ``writer`` is aborted."""
    try:
        while data := await reader.read(65536):
            if lose is not None and lose.is_set():
                writer.write(data[: len(data) // 2])
                await writer.drain()
                writer.transport.abort()
                return
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
