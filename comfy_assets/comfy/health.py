"""Is a ComfyUI server up? One probe: /system_stats and /queue.

The probe is what `comfy-assets health` runs as a readiness check every few seconds, so it
starts in a blink: the standard library's http.client on a thread per request, no event
loop and no aiohttp to import. Its answers are read by ``ComfyClient.read_json``, as the
batch reads them; its transport errors map to the same typed errors as the client's.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from comfy_assets.comfy.answers import Answer, unreachable_reason
from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import (
    ComfyError,
    ConnectionLost,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
)
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.comfy.types import QueueState, SystemStats

_MIB = 1024 * 1024


@dataclass(frozen=True)
class ServerHealth:
    """Result of one probe. ``healthy`` when both routes answered; then ``stats`` and
    ``queue_length`` (running + pending) are set, else ``error`` says what failed."""

    spec: ServerSpec
    stats: SystemStats | None = None
    queue_length: int | None = None
    error: ComfyError | None = None
    timeout_s: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def free_vram_mib(self) -> int | None:
        """Free memory of the first device, MiB rounded (bytes / 2**20)."""
        if self.stats is None or not self.stats.devices:
            return None
        return round(self.stats.devices[0].vram_free / _MIB)

    def line(self) -> str:
        """``gpu0 healthy device=cpu free_vram_mib=23089 queue=0`` or
        ``gpu1 unreachable: connection refused (http://127.0.0.1:9)``; the URL never
        shows a user or password (``ServerSpec``)."""
        name = self.spec.name
        if self.error is None:
            device = self.stats.devices[0].label if self.stats and self.stats.devices else "none"
            return (
                f"{name} healthy device={device} free_vram_mib={self.free_vram_mib} "
                f"queue={self.queue_length}"
            )
        state, reason = _describe(self.error, self.timeout_s)
        return f"{name} {state}: {reason} ({self.spec.url})"


def _describe(error: ComfyError, timeout_s: float) -> tuple[str, str]:
    """(state, reason) from the error's type, not its text."""
    if isinstance(error, ServerUnreachable):
        return "unreachable", error.reason
    if isinstance(error, RequestTimeout):
        return "unreachable", f"no answer within {timeout_s:g} s"
    if isinstance(error, ConnectionLost):
        return "unreachable", "connection lost"
    if isinstance(error, ServerError):
        return "unhealthy", f"HTTP {error.status}"
    return "unhealthy", f"unexpected answer: {error.message}"


def probe(spec: ServerSpec, timeout_s: float = 3.0) -> ServerHealth:
    """Probe one server, its two requests at once; never raises for what the server
    does (the error is in the result). ``timeout_s`` bounds connecting and each read
    (seconds)."""
    return probe_all([spec], timeout_s)[0]


def probe_all(specs: list[ServerSpec], timeout_s: float = 3.0) -> list[ServerHealth]:
    """Probe every server, all requests at once; results in the order of ``specs``."""
    clients = [
        ComfyClient(spec.url, credentials=spec.credentials, name=spec.name, timeout_s=timeout_s)
        for spec in specs
    ]
    with ThreadPoolExecutor(max_workers=2 * len(specs)) as threads:
        asked = [
            (
                threads.submit(_get, client, "/system_stats", SystemStats.from_json),
                threads.submit(_get, client, "/queue", QueueState.from_json),
            )
            for client in clients
        ]
        results = []
        for spec, (stats_asked, queue_asked) in zip(specs, asked, strict=True):
            stats, queue = stats_asked.result(), queue_asked.result()
            error = next((r for r in (stats, queue) if isinstance(r, ComfyError)), None)
            if error is not None:
                results.append(ServerHealth(spec, error=error, timeout_s=timeout_s))
                continue
            assert isinstance(stats, SystemStats) and isinstance(queue, QueueState)
            results.append(
                ServerHealth(spec, stats=stats, queue_length=queue.length, timeout_s=timeout_s)
            )
    return results


def _get(client: ComfyClient, path: str, parse: Callable[[Any], object]) -> object:
    """GET ``path`` of ``client``'s server, read by ``client.read_json``; a ComfyError is
    returned, not raised (anything else is a bug and raises)."""
    route = f"GET {path}"
    try:
        return client.read_json(route, _fetch(client, path, route), parse)
    except ComfyError as e:
        return e


def _fetch(client: ComfyClient, path: str, route: str) -> Answer:
    """One GET over http.client (redirects not followed), its answer whole within
    ``client.timeout_s`` seconds, mapped like the client's requests: refused or
    unresolved → ServerUnreachable, no whole answer in time → RequestTimeout, a reset
    or a broken answer → ConnectionLost."""
    parts = urlsplit(client.base_url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    where = f"{client.name}: {route}"
    connection = kind(parts.hostname or "", parts.port, timeout=client.timeout_s)
    # The socket's timeout bounds each read only: a server that drips its answer a byte
    # at a time would hold the probe for ever. At the deadline the socket is shut down,
    # which ends a blocked read; whatever it then returns is no answer.
    cut = threading.Event()
    deadline = threading.Timer(client.timeout_s, _cut, args=(connection, cut))
    deadline.daemon = True
    deadline.start()
    try:
        connection.request("GET", f"{parts.path.rstrip('/')}{path}", headers=client.auth_headers)
        response = connection.getresponse()
        # An HTTPMessage reads as a mapping, its lookups case-insensitive like aiohttp's.
        headers = cast(Mapping[str, str], response.headers)
        answer = Answer(response.status, headers, response.read())
    except (OSError, http.client.HTTPException) as exc:
        raise _transport_error(exc, client, where, cut.is_set()) from exc
    finally:
        deadline.cancel()
        connection.close()
    if cut.is_set():
        raise _transport_error(TimeoutError(), client, where, True)
    return answer


def _cut(connection: http.client.HTTPConnection, cut: threading.Event) -> None:
    """Shut down ``connection``'s socket (not close: the reading thread owns it)."""
    sock = connection.sock
    if sock is not None:
        cut.set()
        with contextlib.suppress(OSError):  # already closed by the reading thread
            # socket.socket's own shutdown: an SSLSocket's would unwrap under the reader.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _transport_error(exc: BaseException, client: ComfyClient, where: str, cut: bool) -> ComfyError:
    """The typed error of a failed exchange; ``cut``: the deadline ended it."""
    if cut or isinstance(exc, TimeoutError):
        return RequestTimeout(
            f"{where}: no answer within {client.timeout_s:g} s", server=client.base_url
        )
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, http.client.HTTPException)):
        # Reset, or closed before or within the answer (RemoteDisconnected is both).
        return ConnectionLost(
            f"{where}: connection lost ({exc or type(exc).__name__})", server=client.base_url
        )
    # refused, host not found, no route
    reason = unreachable_reason(exc, client.base_url)
    return ServerUnreachable(
        f"{where}: {reason} ({client.base_url})", server=client.base_url, reason=reason
    )
