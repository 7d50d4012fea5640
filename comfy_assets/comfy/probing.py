"""Probing the pool's servers: health and queue length from their sockets when open,
else from ``/system_stats`` and ``/queue``; reports of servers that went away or came
back; "no server reachable" for longer than ``unreachable_timeout_s``, or for
``NEVER_ANSWERED_S`` when none has answered since the pool started (a mistyped URL)."""

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
# Seconds a pool with a patience (``unreachable_timeout_s``) waits when none of its servers
# has answered since it started: a mistyped URL or a server not started is said within a
# minute, while a farm whose servers start with the batch has time to come up.
NEVER_ANSWERED_S = 30.0
# The option of ``comfy-assets run`` (and the field of the Dagster resource, underscored)
# that sets the patience, named where a line says how long the batch waits.
PATIENCE_OPTION = "--unreachable-timeout-s"


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
        """Log a server's state when it changes, not at every probe; its first line as
        unreachable says how long the batch waits (``_patience``); an unreachable server
        is named again every ``REPORT_AGAIN_S`` with how long it has been away."""
        now = time.monotonic()
        for p in probes:
            self._came_back(p.name, p.healthy)
            if p.healthy:
                self._answered.add(p.name)
            state = "healthy" if p.healthy else f"unreachable: {p.reason}"
            was = self._reported.get(p.name, "healthy")
            changed = was != state
            went = changed and was == "healthy"  # not a new reason of one already away
            if went:
                self._away_since[p.name] = now
            away = now - self._away_since.get(p.name, now)
            stale = not p.healthy and now - self._reported_at.get(p.name, now) >= REPORT_AGAIN_S
            if changed and p.healthy:
                log.info("server %s healthy", p.name)
            elif changed:
                log.warning("server %s %s%s", p.name, state, self._patience() if went else "")
            elif stale:
                log.warning("server %s still unreachable after %.0f s: %s", p.name, away, p.reason)
            if changed or stale:
                self._reported_at[p.name] = now
            self._reported[p.name] = state
        if len(self._probed_unreachable()) < len(self.servers):
            self._none_reachable_since = None
        elif self._none_reachable_since is None:
            self._none_reachable_since = asyncio.get_running_loop().time()

    def _patience(self) -> str:
        """What a server's first line as unreachable adds: how long the batch waits for a
        server to answer and what sets it (nothing for a pool that waits for ever)."""
        limit = self._unreachable_limit()
        if limit is None:
            return ""
        if self._never_answered():
            return f"; no server has answered yet: the batch stops in {limit:g} s unless one does"
        return f"; the batch waits up to {limit:g} s for a server to answer ({PATIENCE_OPTION})"

    def _never_answered(self) -> bool:
        """No server has answered since the pool started, and ``NEVER_ANSWERED_S`` is
        shorter than the patience the settings give."""
        limit = self.settings.unreachable_timeout_s
        return not self._answered and limit is not None and NEVER_ANSWERED_S < limit

    def _unreachable_limit(self) -> float | None:
        """Seconds with no server reachable before the batch stops: ``unreachable_timeout_s``,
        or ``NEVER_ANSWERED_S`` while ``_never_answered``; None: for ever."""
        return NEVER_ANSWERED_S if self._never_answered() else self.settings.unreachable_timeout_s

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
        """Raise NoServerReachable once no server has answered for the patience
        (``_unreachable_limit``)."""
        since, limit = self._none_reachable_since, self._unreachable_limit()
        if since is None or limit is None:
            return
        waited = asyncio.get_running_loop().time() - since
        if waited < limit:
            return
        if not self._never_answered():
            raise NoServerReachable(waited, self._probed_unreachable())
        raise NoServerReachable(
            waited,
            self._probed_unreachable(),
            why=f"none has answered in the {limit:g} s since the batch started",
        )
