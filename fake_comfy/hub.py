"""The server's WebSockets and the one ordered queue of outgoing messages.

As in ComfyUI's server.py: sockets are kept by clientId (a new socket with the same id
replaces the old one, which stays open but gets nothing more); a message has one target
sid or none (= every registered socket); a single publisher task sends them in order, so
the executor never waits on a client. Messages are `{"type": event, "data": data}`
serialised with json.dumps' default separators, like aiohttp's send_json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 10.0  # a socket whose client stops reading for this long is cut
_CUT = object()  # queue marker: abort sockets at this point of the message order


class Hub:
    """Registered sockets, every open socket, and the publisher (see module docstring)."""

    def __init__(self) -> None:
        self.sockets: dict[str, web.WebSocketResponse] = {}
        # Every open socket, replaced ones too, with its transport (to cut it abruptly).
        self._open: dict[web.WebSocketResponse, asyncio.BaseTransport | None] = {}
        self._queue: asyncio.Queue[tuple[Any, str | bytes | None, str | None, str | None]] = (
            asyncio.Queue()
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the publisher task on the running loop."""
        self._task = asyncio.create_task(self._publish(), name="fake_comfy publisher")

    async def stop(self) -> None:
        """Stops the publisher; messages still queued are dropped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def register(
        self, sid: str, ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None
    ) -> None:
        """Makes `ws` the socket of `sid`, replacing (not closing) any previous one."""
        self.sockets[sid] = ws
        self._open[ws] = transport

    def unregister(self, sid: str, ws: web.WebSocketResponse) -> None:
        """Forgets a closed socket. Unlike the real server (which pops `sid` whatever
        socket holds it), a replaced socket closing late does not unregister its successor."""
        self._open.pop(ws, None)
        if self.sockets.get(sid) is ws:
            del self.sockets[sid]

    def send(
        self, event: str, data: dict[str, Any], sid: str | None, exclude: str | None = None
    ) -> None:
        """Queues a message for `sid` (None: every socket but `exclude`'s)."""
        self._queue.put_nowait((event, json.dumps({"type": event, "data": data}), sid, exclude))

    def send_bytes(self, data: bytes, sid: str | None) -> None:
        """Queues a binary frame (a preview image) for `sid` (None: every socket)."""
        self._queue.put_nowait(("binary", data, sid, None))

    def status(self, queue_remaining: int, exclude: str | None = None) -> None:
        """Queues the `status` broadcast ComfyUI sends on every queue change."""
        self.send(
            "status", {"status": {"exec_info": {"queue_remaining": queue_remaining}}}, None, exclude
        )

    def cut(self, sid: str | None) -> None:
        """Queues an abrupt close (no close frame) of `sid`'s socket, or of every open socket
        when `sid` is None, after the messages already queued have been sent."""
        self._queue.put_nowait((_CUT, None, sid, None))

    async def send_direct(
        self, ws: web.WebSocketResponse, event: str, data: dict[str, Any]
    ) -> None:
        """Sends at once, outside the queue (the greeting of a new socket, as the real one)."""
        await ws.send_str(json.dumps({"type": event, "data": data}))

    async def close_all(self, timeout_s: float) -> None:
        """Closes every open socket with a close frame (1001, going away); a socket that does
        not finish the handshake within `timeout_s` seconds is cut."""

        async def close(ws: web.WebSocketResponse, transport: asyncio.BaseTransport | None) -> None:
            try:
                await asyncio.wait_for(ws.close(code=1001), timeout_s)
            except (TimeoutError, ConnectionError):
                if transport is not None:
                    transport.abort()

        await asyncio.gather(*(close(ws, t) for ws, t in list(self._open.items())))

    def _cut_now(self, sid: str | None) -> None:
        if sid is None:
            victims = list(self._open.items())
        else:
            ws = self.sockets.get(sid)
            victims = [(ws, self._open.get(ws))] if ws is not None else []
        for ws, transport in victims:
            log.info("fake_comfy: cutting socket %s without a close frame", sid or "(all)")
            if transport is not None:
                transport.abort()
            self._open.pop(ws, None)
            for key in [k for k, v in self.sockets.items() if v is ws]:
                del self.sockets[key]

    async def _publish(self) -> None:
        while True:
            event, text, sid, exclude = await self._queue.get()
            if event is _CUT:
                self._cut_now(sid)
                continue
            assert text is not None
            if sid is not None:
                ws = self.sockets.get(sid)
                targets = [ws] if ws is not None else []
            else:
                targets = [ws for key, ws in self.sockets.items() if key != exclude]
            for ws in targets:
                if ws.closed:
                    continue
                try:
                    # The real server would wait forever on a client that stopped reading
                    # and stall every client; the fake cuts such a client instead.
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        if isinstance(text, bytes):
                            await ws.send_bytes(text)
                        else:
                            await ws.send_str(text)
                except ConnectionError as ex:
                    # The client went away mid-send; ComfyUI logs it and carries on too.
                    log.debug("fake_comfy: %s not sent to a closing socket: %s", event, ex)
                except TimeoutError:
                    log.warning(
                        "fake_comfy: a client read nothing for %s s; cutting its socket",
                        SEND_TIMEOUT_S,
                    )
                    transport = self._open.pop(ws, None)
                    if transport is not None:
                        transport.abort()
