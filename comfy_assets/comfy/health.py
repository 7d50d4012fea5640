"""Is a ComfyUI server up? One probe: /system_stats and /queue, concurrently."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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


async def probe(spec: ServerSpec, timeout_s: float = 3.0) -> ServerHealth:
    """Probe one server; never raises for what the server does (the error is in the
    result). ``timeout_s`` bounds each request (seconds)."""
    client = ComfyClient(
        spec.url, credentials=spec.credentials, name=spec.name, timeout_s=timeout_s
    )
    async with client:
        results = await asyncio.gather(
            client.system_stats(), client.queue(), return_exceptions=True
        )
    stats, queue = results
    for result in results:
        if isinstance(result, ComfyError):
            return ServerHealth(spec, error=result, timeout_s=timeout_s)
        if isinstance(result, BaseException):
            raise result  # a bug, not the server: let it show
    assert isinstance(stats, SystemStats) and isinstance(queue, QueueState)
    return ServerHealth(spec, stats=stats, queue_length=queue.length, timeout_s=timeout_s)


async def probe_all(specs: list[ServerSpec], timeout_s: float = 3.0) -> list[ServerHealth]:
    """Probe every server concurrently; results in the order of ``specs``."""
    return list(await asyncio.gather(*(probe(spec, timeout_s) for spec in specs)))
