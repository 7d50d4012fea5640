"""Probing the pool's servers: health and queue length from their sockets when open,
else from ``/system_stats`` and ``/queue``; reports of servers that went away or came
back; "no server reachable" for longer than ``unreachable_timeout_s``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from comfy_assets.comfy.errors import ComfyError, NoServerReachable
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.comfy.slot import (
    CLIENT_ID_PREFIX,
    ServerProbe,
)

if TYPE_CHECKING:
    from comfy_assets.comfy.follow import PromptFollower

log = logging.getLogger("comfy_assets.pool")
REPORT_AGAIN_S = 60.0  # seconds between reminders that a server is still unreachable


class Probing:
    """How the pool sees its servers (a part of ``Pool``)."""

    async def probe(self, spec: ServerSpec) -> ServerProbe:
        """Probe ``/system_stats`` and ``/queue`` of one server within ``probe_timeout_s``.

        Consumers waiting at the same moment share one probe per server, and an answer
        stands for ``probe_ttl_s`` (a burst of acquisitions, as at start, probes once).
        A server whose open socket says its queue is empty needs no request at all: the
        ``status`` broadcast (README fact 3) already told us (a prompt posted a moment ago
        may not be counted yet; it would queue ahead of ours, as after any probe). A
        healthy server's socket is opened by its first probe: a server whose ``/ws``
        fails is unreachable for us, as we could not follow a prompt there.
        """
        follower = self._followers.get(spec.name)
        if follower is not None and not follower.failed and follower.queue_remaining() == 0:
            return ServerProbe(spec.name, True)
        cached = self._probed.get(spec.name)
        if cached is not None and asyncio.get_running_loop().time() - cached[0] < self.probe_ttl_s:
            return cached[1]
        running = self._probing.get(spec.name)
        if running is None:
            running = asyncio.ensure_future(self._probe(spec))
            self._probing[spec.name] = running
            running.add_done_callback(lambda _: self._probing.pop(spec.name, None))
        return await asyncio.shield(running)

    async def _probe(self, spec: ServerSpec) -> ServerProbe:
        client = self.clients[spec.name]
        loop = asyncio.get_running_loop()
        # /system_stats says the server is up and which device it has; it changes slowly,
        # so a recent healthy answer stands in for it. /queue is always asked afresh.
        fresh = loop.time() - self._stats_at.get(spec.name, -1e9) < self.stats_ttl_s
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                if fresh:
                    queue = await client.queue()
                else:
                    stats, queued = await asyncio.gather(
                        client.system_stats(), client.queue(), return_exceptions=True
                    )
                    # Both asked at once; when both fail (a server down refuses both),
                    # the reason names /system_stats's failure, whichever came first.
                    if isinstance(stats, BaseException):
                        raise stats
                    if isinstance(queued, BaseException):
                        raise queued
                    queue = queued
                    self._stats_at[spec.name] = loop.time()
                # A prompt needs the server's socket; once open, its `status` messages
                # answer the next probes without a request.
                await self.follower(spec.name)
        except TimeoutError:
            self._stats_at.pop(spec.name, None)
            return ServerProbe(
                spec.name, False, reason=f"no answer in {self.settings.probe_timeout_s} s"
            )
        except ComfyError as e:
            self._stats_at.pop(spec.name, None)
            return ServerProbe(spec.name, False, reason=f"{type(e).__name__}: {e}")
        entries = [*queue.running, *queue.pending]
        ours = tuple(
            e.prompt_id for e in entries if (e.client_id or "").startswith(CLIENT_ID_PREFIX)
        )
        probe = ServerProbe(spec.name, True, foreign_queue=len(entries) - len(ours), ours=ours)
        self._probed[spec.name] = (loop.time(), probe)
        return probe

    def _report(self, probes: Sequence[ServerProbe]) -> None:
        """Log a server's state when it changes, not at every probe; an unreachable
        server is named again every ``REPORT_AGAIN_S`` so a long wait is not silent."""
        now = time.monotonic()
        for p in probes:
            self._came_back(p.name, p.healthy)
            state = "healthy" if p.healthy else f"unreachable: {p.reason}"
            changed = self._reported.get(p.name, "healthy") != state
            stale = not p.healthy and now - self._reported_at.get(p.name, now) >= REPORT_AGAIN_S
            if changed or stale:
                level = logging.INFO if p.healthy else logging.WARNING
                log.log(level, "server %s %s", p.name, state)
                self._reported_at[p.name] = now
            self._reported[p.name] = state
        if len(self._probed_unreachable()) < len(self.servers):
            self._none_reachable_since = None
        elif self._none_reachable_since is None:
            self._none_reachable_since = asyncio.get_running_loop().time()

    def open_follower(self, name: str) -> PromptFollower | None:
        """The socket of server ``name`` if one is open now (for reading progress)."""
        return self._followers.get(name)

    def unreachable(self) -> dict[str, str]:
        """Servers last seen unreachable, with the reason ("unreachable: ..."): by their
        last probe, or by their socket, which dropped and could not be opened again (a
        server that died under our prompt, which no probe looks at while the prompt is
        followed). For summaries, status rows and metrics."""
        found = self._probed_unreachable()
        for name, follower in list(self._followers.items()):
            lost = follower.lost()
            if lost is not None and name not in found:
                found[name] = f"unreachable: {lost}"
        return found

    def _probed_unreachable(self) -> dict[str, str]:
        return {n: s for n, s in self._reported.items() if s != "healthy"}

    def _check_reachable(self) -> None:
        """Raise NoServerReachable once no server has answered for unreachable_timeout_s."""
        since, limit = self._none_reachable_since, self.settings.unreachable_timeout_s
        if since is None or limit is None:
            return
        waited = asyncio.get_running_loop().time() - since
        if waited >= limit:
            raise NoServerReachable(waited, self._probed_unreachable())
