"""Keeping the pool's server leases: renewed each third of ``lease_s``; one another process
took, or that the store could not renew until a third of it was left, is lost (the slot
marked, its holder told); releases and questions to a failing store handled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("comfy_assets.pool")
T = TypeVar("T")


class LeaseKeeping:
    """How the pool keeps its leases (a part of ``Pool``)."""

    def _ask_leases(self, call: Callable[..., T], failed: T, *args: object) -> T:
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
            if not self._store_failing_since:
                log.warning(
                    "server leases: the store failed (%s: %s); trying again", type(e).__name__, e
                )
            since = self._store_failing_since.setdefault(name, now)
            if now - since >= self.store_timeout_s:
                raise
            return failed
        self._store_failing_since.pop(name, None)
        return answer

    def _release_lease(self, name: str, model: str | None) -> None:
        """Give the lease back in the store. If the store fails, the lease is left to
        expire (nobody else uses the server meanwhile), and the log says so."""
        self._lease_until.pop(name, None)
        try:
            self.leases.release_server(name, self.owner, last_model=model)
        except Exception as e:  # the store, whatever its driver: the lease expires by itself
            log.warning(
                "server %s: server lease not released (%s: %s); it expires within %.0f s",
                name,
                type(e).__name__,
                e,
                self.settings.server_lease_s,
            )

    async def _renew_forever(self) -> None:
        """Renew every lease we hold or keep each third of ``lease_s``; while the store
        fails, try again every thirtieth, and give a lease up as lost once only a third
        of it is left (``_lose``)."""
        failing = False
        while True:
            await asyncio.sleep(self.settings.server_lease_s / (30 if failing else 3))
            failing = False
            held = [n for n, slot in self._held.items() if slot.lost is None]
            for name in [*held, *self._kept]:
                failing = not self._renew(name) or failing

    def _renew(self, name: str) -> bool:
        """Renew one lease; False when the store failed and the lease is still ours."""
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        try:
            renewed = self.leases.renew_server(name, self.owner, self.settings.server_lease_s)
        except Exception as e:  # the store, whatever its driver: judged by the time left
            left = self._lease_until.get(name, asked_at) - asked_at
            why = f"{type(e).__name__}: {e}"
            if left > self.settings.server_lease_s / 3:
                log.warning(
                    "server %s: server lease not renewed (%s); %.0f s left, trying again",
                    name,
                    why,
                    left,
                )
                return False
            self._lose(name, f"server lease not renewed ({why}) and {left:.0f} s left")
            return True
        if renewed:
            self._lease_until[name] = asked_at + self.settings.server_lease_s
        else:
            self._lose(name, "server lease taken by another process")
        return True

    def _lose(self, name: str, why: str) -> None:
        """Stop using server ``name``: the lease is no longer ours for sure."""
        self._lease_until.pop(name, None)
        kept = self._kept.pop(name, None) is not None
        slot = self._held.get(name)
        if slot is None or slot.lost is not None:
            if kept:
                log.error("server %s: %s; not posting there", name, why)
            return
        slot.lost = f"{name}: {why}"
        log.error("server %s: %s; not posting there, our prompt there is removed", name, why)
        for listener in list(self.lost_listeners):
            listener(slot)
