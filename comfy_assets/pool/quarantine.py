"""The pool's view of its servers' health, as the store records it for every process:
which servers take no job now (quarantined, or on trial with its one job failed), and
which have failures not judged yet (``on_probation``: the batch's queue sends them only
jobs that failed elsewhere, while a server without any can run the rest).

The store decides (``store/health.py``); the pool reads the decisions at most every
``HEALTH_TTL_S`` seconds, and at once after its own batch wrote one (``health_changed``).
A quarantine never touches a prompt that runs: it only keeps new ones away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from comfy_assets.comfy.errors import NoServerReachable
from comfy_assets.pool.lease_keeping import LeaseKeeper
from comfy_assets.pool.server_state import ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import ServerLeaseStore

log = logging.getLogger("comfy_assets.pool")

# Seconds a read of the servers' health stands: other processes' quarantines reach this
# pool within that.
HEALTH_TTL_S = 1.0


class HealthRecord(Protocol):
    """What the pool reads of a server's health (``store.health.ServerHealthRecord``);
    read-only, as that frozen record's fields are."""

    @property
    def state(self) -> str: ...

    @property
    def until(self) -> float | None: ...

    @property
    def open_failures(self) -> int: ...

    def blocked(self) -> str | None: ...

    def line(self) -> str: ...


@dataclass(eq=False)
class Quarantine:
    """Servers' health as the pool sees it (a part of ``Pool``): ``health``, each
    server's record by name, as last read from the store."""

    states: ServerStates
    keeper: LeaseKeeper
    settings: PoolSettings
    leases: ServerLeaseStore = field(init=False, repr=False)
    health: Mapping[str, HealthRecord] = field(default_factory=dict, init=False, repr=False)
    _health_at: float = field(default=-1e9, init=False, repr=False)  # loop time of the last read
    # Loop time every server was first blocked at.
    _blocked_since: float | None = field(default=None, init=False, repr=False)
    # Times every server was blocked at once: a second time, they went back to
    # quarantine after a trial (the fault stays), and the batch stops.
    _blocked_episodes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.leases = self.keeper.leases

    def health_changed(self) -> None:
        """Our batch wrote a server's failure or change of state: read again before the
        next choice."""
        self._health_at = -1e9

    def read_health_soon(self) -> None:
        """Read the servers' health on the loop (as the leases are), when the last read
        is older than ``HEALTH_TTL_S``; a store that fails leaves the last view."""
        now = asyncio.get_running_loop().time()
        if now - self._health_at < HEALTH_TTL_S:
            return
        self._health_at = now
        read = self.keeper.ask(self.leases.server_health, None)
        if read is not None:
            self._took_health(read)

    def _took_health(self, read: Mapping[str, HealthRecord]) -> None:
        self.health = read
        for state in self.states.all:
            why = self.blocked(state.name)
            if why != state.said_blocked:
                if why is not None:
                    log.info("server %s takes no job: %s", state.name, why)
                else:
                    log.info("server %s takes jobs again", state.name)
                state.said_blocked = why

    def blocked(self, name: str) -> str | None:
        """Why server ``name`` takes no new prompt now (``gpu2 quarantined until
        12:04:10: ...``), else None."""
        record = self.health.get(name)
        why = record.blocked() if record is not None else None
        if why is None or record is None:
            return None
        if why == "quarantined":
            return record.line().removeprefix(f"{name} ")
        return why

    def on_probation(self, name: str) -> bool:
        """Whether server ``name`` has failures that no other server has judged yet."""
        record = self.health.get(name)
        return record is not None and record.open_failures > 0

    def note_all_blocked(self) -> bool:
        """True when every server of the pool takes no prompt now (the time it started
        is kept for ``check_usable``)."""
        if not self.all_blocked():
            self._blocked_since = None
            return False
        if self._blocked_since is None:
            self._blocked_since = asyncio.get_running_loop().time()
            self._blocked_episodes += 1
        return True

    def check_usable(self) -> None:
        """Raise NoServerReachable once every server has been quarantined for
        ``unreachable_timeout_s``, or at once when no cool-down ends within it or when
        it is the second time in this pool's life that every server is (one came back,
        and its fault did too): the batch stops with its jobs pending, as when none
        answers."""
        since, limit = self._blocked_since, self.settings.unreachable_timeout_s
        if since is None or limit is None:
            return
        waited = asyncio.get_running_loop().time() - since
        blocked = self.all_blocked()
        if not blocked:
            return
        if self._blocked_episodes > 1:
            why = "every server was quarantined again after one came back: nothing more is posted"
            raise NoServerReachable(waited, blocked, what="usable", why=why)
        ends = [self.health[name].until for name in blocked if name in self.health]
        if all(end is not None for end in ends) and ends:
            left = min(e for e in ends if e is not None) - self.leases.now()
            if left > limit - waited:
                why = (
                    f"the first cool-down ends in {left:.0f} s, past the {limit:g} s a batch "
                    "waits for a usable server"
                )
                raise NoServerReachable(waited, blocked, what="usable", why=why)
        if waited >= limit:
            raise NoServerReachable(waited, blocked, what="usable")

    async def read_health(self) -> None:
        """Read the servers' health now, on a thread: while the database is away this
        waits (up to the store's budget, then raises its error) instead of failing a
        call on the loop."""
        self._health_at = asyncio.get_running_loop().time()
        self._took_health(await asyncio.to_thread(self.leases.server_health))

    async def until_usable(
        self, say: Callable[[str], None], back: Callable[[], None] = lambda: None
    ) -> None:
        """Return once some server of the pool may take a prompt. While none may (every
        one quarantined), ``say`` why, once, and look again every ``HEALTH_TTL_S``;
        ``back`` is called when one may again after that. Raises the store's error when
        its database stays away past the store's budget."""
        said = False
        while True:
            if asyncio.get_running_loop().time() - self._health_at >= HEALTH_TTL_S:
                await self.read_health()
            blocked = self.all_blocked()
            if not blocked:
                if said:
                    back()
                return
            if not said:
                listed = "; ".join(f"{name} {why}" for name, why in blocked.items())
                say(f"every server is quarantined ({listed})")
                said = True
            await asyncio.sleep(HEALTH_TTL_S)

    def all_blocked(self) -> dict[str, str]:
        """Every server of the pool with why it takes no prompt, when none may take
        one; else empty."""
        reasons = {s.name: self.blocked(s.name) for s in self.states.all}
        if any(why is None for why in reasons.values()):
            return {}
        return {name: why for name, why in reasons.items() if why is not None}
