"""Probing the pool's servers: health and queue length from their sockets when open,
else from ``/system_stats`` and ``/queue``; reports of servers that went away or came
back; "no server reachable" for longer than ``unreachable_timeout_s``, or for
``NEVER_ANSWERED_S`` when none has answered since the pool started (a mistyped URL)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from comfy_assets.comfy.errors import ComfyError, NoServerReachable
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.pool.models_held import ModelsHeld
from comfy_assets.pool.server_state import HEALTHY, ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import CLIENT_ID_PREFIX, ServerProbe

if TYPE_CHECKING:  # annotations only: ``render/config.py`` reads this module's constants
    from comfy_assets.pool.sockets import Sockets

log = logging.getLogger("comfy_assets.pool")
REPORT_AGAIN_S = 60.0  # seconds between reminders that a server is still unreachable
# Seconds a pool with a patience (``unreachable_timeout_s``) waits when none of its servers
# has answered since it started: a mistyped URL or a server not started is said within a
# minute, while a farm whose servers start with the batch has time to come up.
NEVER_ANSWERED_S = 30.0
# The option of ``comfy-assets run`` (and the field of the Dagster resource, underscored)
# that sets the patience, named where a line says how long the batch waits.
PATIENCE_OPTION = "--unreachable-timeout-s"


@dataclass(eq=False)
class Prober:
    """How the pool sees its servers (a part of ``Pool``). ``stats_ttl_s``: how long a
    healthy ``/system_stats`` answer stands (``/queue`` is asked at every probe).
    ``probe_ttl_s``: how long a probe's /queue answer stands for a server nobody took
    since. A probe's verdict goes to ``models`` (a server back from away is read again)."""

    states: ServerStates
    sockets: Sockets
    models: ModelsHeld
    settings: PoolSettings
    stats_ttl_s: float
    probe_ttl_s: float
    none_reachable_since: float | None = field(default=None, init=False, repr=False)  # loop time

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
        state = self.states[spec.name]
        follower = state.follower
        if follower is not None and not follower.failed and follower.queue_remaining() == 0:
            return ServerProbe(spec.name, True)
        cached = state.probed
        if cached is not None and asyncio.get_running_loop().time() - cached[0] < self.probe_ttl_s:
            return cached[1]
        running = state.probing
        if running is None:
            running = state.probing = asyncio.ensure_future(self._probe(spec))
            running.add_done_callback(lambda _: setattr(state, "probing", None))
        return await asyncio.shield(running)

    async def _probe(self, spec: ServerSpec) -> ServerProbe:
        state = self.states[spec.name]
        client = state.client
        loop = asyncio.get_running_loop()
        # /system_stats says the server is up and which device it has; it changes slowly,
        # so a recent healthy answer stands in for it. /queue is always asked afresh.
        stats_at = -1e9 if state.stats_at is None else state.stats_at
        fresh = loop.time() - stats_at < self.stats_ttl_s
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
                    state.stats_at = loop.time()
                # A prompt needs the server's socket; once open, its `status` messages
                # answer the next probes without a request.
                await self.sockets.follower(spec.name)
        except TimeoutError:
            state.stats_at = None
            return ServerProbe(
                spec.name, False, reason=f"no answer in {self.settings.probe_timeout_s} s"
            )
        except ComfyError as e:
            state.stats_at = None
            return ServerProbe(spec.name, False, reason=f"{type(e).__name__}: {e}")
        entries = [*queue.running, *queue.pending]
        ours = tuple(
            e.prompt_id for e in entries if (e.client_id or "").startswith(CLIENT_ID_PREFIX)
        )
        probe = ServerProbe(spec.name, True, foreign_queue=len(entries) - len(ours), ours=ours)
        state.probed = (loop.time(), probe)
        return probe

    def report(self, probes: Sequence[ServerProbe]) -> None:
        """Log a server's state when it changes, not at every probe; its first line as
        unreachable says how long the batch waits (``_patience``); an unreachable server
        is named again every ``REPORT_AGAIN_S`` with how long it has been away."""
        now = time.monotonic()
        for p in probes:
            self.models.came_back(p.name, p.healthy)
            server = self.states[p.name]
            if p.healthy:
                server.answered = True
            state = HEALTHY if p.healthy else f"unreachable: {p.reason}"
            was = server.reported
            changed = was != state
            went = changed and was == HEALTHY  # not a new reason of one already away
            if went:
                server.away_since = now
            away = now - (now if server.away_since is None else server.away_since)
            reported_at = now if server.reported_at is None else server.reported_at
            stale = not p.healthy and now - reported_at >= REPORT_AGAIN_S
            if changed and p.healthy:
                log.info("server %s healthy", p.name)
            elif changed:
                log.warning("server %s %s%s", p.name, state, self._patience() if went else "")
            elif stale:
                log.warning("server %s still unreachable after %.0f s: %s", p.name, away, p.reason)
            if changed or stale:
                server.reported_at = now
            server.reported = state
        if len(self._probed_unreachable()) < len(self.states.all):
            self.none_reachable_since = None
        elif self.none_reachable_since is None:
            self.none_reachable_since = asyncio.get_running_loop().time()

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
        answered = any(s.answered for s in self.states.all)
        return not answered and limit is not None and NEVER_ANSWERED_S < limit

    def _unreachable_limit(self) -> float | None:
        """Seconds with no server reachable before the batch stops: ``unreachable_timeout_s``,
        or ``NEVER_ANSWERED_S`` while ``_never_answered``; None: for ever."""
        return NEVER_ANSWERED_S if self._never_answered() else self.settings.unreachable_timeout_s

    def unreachable(self) -> dict[str, str]:
        """Servers last seen unreachable, with the reason ("unreachable: ..."): by their
        last probe, or by their socket, which dropped and could not be opened again (a
        server that died under our prompt, which no probe looks at while the prompt is
        followed). For summaries, status rows and metrics."""
        found = self._probed_unreachable()
        for state in self.states.all:
            lost = None if state.follower is None else state.follower.lost()
            if lost is not None and state.name not in found:
                found[state.name] = f"unreachable: {lost}"
        return found

    def _probed_unreachable(self) -> dict[str, str]:
        return {s.name: s.reported for s in self.states.all if s.reported != HEALTHY}

    def check_reachable(self) -> None:
        """Raise NoServerReachable once no server has answered for the patience
        (``_unreachable_limit``)."""
        since, limit = self.none_reachable_since, self._unreachable_limit()
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
