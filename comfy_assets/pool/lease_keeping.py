"""Keeping the pool's server leases: renewed each third of ``lease_s``; one another process
took, or that the store could not renew until a third of it was left, is lost (the slot
marked, its holder told); releases and questions to a failing store handled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from comfy_assets.pool.server_state import ServerState, ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import ServerLeaseStore, Slot

log = logging.getLogger("comfy_assets.pool")
T = TypeVar("T")


@dataclass(eq=False)
class LeaseKeeper:
    """How the pool asks the store about leases and keeps the ones it has (a part of
    ``Pool``). ``store_timeout_s``: how long a store call may fail before its error is
    raised. ``lost_listeners`` are called with each slot whose lease is lost."""

    states: ServerStates
    leases: ServerLeaseStore
    owner: str
    settings: PoolSettings
    store_timeout_s: float
    lost_listeners: list[Callable[[Slot], None]] = field(
        default_factory=list, init=False, repr=False
    )
    # Loop time each store call has failed since, by call.
    _failing_since: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def ask(self, call: Callable[..., T], failed: T, *args: object) -> T:
        """``call(*args)`` on the lease store; while the store fails, ``failed`` (nothing
        is taken on a store that can't record it) and the consumer looks again later.
        Raises the store's error once that call has failed for ``store_timeout_s`` on
        end (reads that answer meanwhile do not reset its clock: a store that reads but
        cannot write takes nothing), and at once when the error says waiting cannot help
        (``lasting``, as the store's StoreDiskFull: a full disk stays full)."""
        name = getattr(call, "__name__", repr(call))
        try:
            answer = call(*args)
        except Exception as e:  # the store, whatever its driver: see the timeout below
            if getattr(e, "lasting", False):
                raise
            now = asyncio.get_running_loop().time()
            if not self._failing_since:
                log.warning(
                    "server leases: the store failed (%s: %s); trying again", type(e).__name__, e
                )
            since = self._failing_since.setdefault(name, now)
            if now - since >= self.store_timeout_s:
                raise
            return failed
        self._failing_since.pop(name, None)
        return answer

    def take(self, state: ServerState) -> bool:
        """Take the lease of ``state``'s server in the store; False if someone else has it
        (or the store fails)."""
        asked_at = asyncio.get_running_loop().time()
        lease_s = self.settings.server_lease_s
        if not self.ask(self.leases.acquire_server, False, state.name, self.owner, lease_s):
            return False
        state.lease_until = asked_at + lease_s
        return True

    def release(self, state: ServerState, model: str | None) -> None:
        """Give the lease back in the store. If the store fails, the lease is left to
        expire (nobody else uses the server meanwhile), and the log says so."""
        state.lease_until = None
        try:
            self.leases.release_server(state.name, self.owner, last_model=model)
        except Exception as e:  # the store, whatever its driver: the lease expires by itself
            log.warning(
                "server %s: server lease not released (%s: %s); it expires within %.0f s",
                state.name,
                type(e).__name__,
                e,
                self.settings.server_lease_s,
            )

    async def renew_forever(self) -> None:
        """Renew every lease we hold or keep each third of ``lease_s``; while the store
        fails, try again every thirtieth, and give a lease up as lost once only a third
        of it is left (``lose``)."""
        failing = False
        while True:
            await asyncio.sleep(self.settings.server_lease_s / (30 if failing else 3))
            failing = False
            held = [s for s in self.states.held() if s.held is not None and s.held.lost is None]
            for state in [*held, *self.states.kept()]:
                failing = not self._renew(state) or failing

    def _renew(self, state: ServerState) -> bool:
        """Renew one lease; False when the store failed and the lease is still ours."""
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        try:
            renewed = self.leases.renew_server(state.name, self.owner, self.settings.server_lease_s)
        except Exception as e:  # the store, whatever its driver: judged by the time left
            until = asked_at if state.lease_until is None else state.lease_until
            left = until - asked_at
            why = f"{type(e).__name__}: {e}"
            if left > self.settings.server_lease_s / 3:
                log.warning(
                    "server %s: server lease not renewed (%s); %.0f s left, trying again",
                    state.name,
                    why,
                    left,
                )
                return False
            self.lose(state, f"server lease not renewed ({why}) and {left:.0f} s left")
            return True
        if renewed:
            state.lease_until = asked_at + self.settings.server_lease_s
        else:
            self.lose(state, "server lease taken by another process")
        return True

    def lose(self, state: ServerState, why: str) -> None:
        """Stop using ``state``'s server: the lease is no longer ours for sure."""
        name = state.name
        state.lease_until = None
        kept = state.kept_at is not None
        state.kept_at = None
        slot = state.held
        if slot is None or slot.lost is not None:
            if kept:
                log.error("server %s: %s; not posting there", name, why)
            return
        slot.lost = f"{name}: {why}"
        log.error("server %s: %s; not posting there, our prompt there is removed", name, why)
        for listener in list(self.lost_listeners):
            listener(slot)
