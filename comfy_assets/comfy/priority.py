"""Priorities across the processes sharing servers (a part of ``Pool``).

A pool has the priority of the batch it serves (``Pool.priority``, an integer, higher
first, default 0); its marks that it waits for a server carry it (``mark_waiting``).
When one of our prompts frees a server, the pool hands it to its own next job unless
another process waits for it with a priority at least ours (equal ones take turns:
``Pool.slot_released``); a free server that another process waits for with a higher
priority is not taken at all. A prompt already rendering is never interrupted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from comfy_assets.comfy.slot import ServerLeaseStore


class Priorities:
    """The pool's priority and whether another process outranks it for a server."""

    priority: int = 0
    _in_flight: Counter[int] | None = None
    leases: ServerLeaseStore
    owner: str
    busy_poll_s: float

    def _outranked(self, name: str) -> bool:
        """Whether another process waits for server ``name`` with a higher priority than
        ours (asked of the store at most every busy_poll_s per server)."""
        now = asyncio.get_running_loop().time()
        seen = getattr(self, "_outranks", None)
        if seen is None:
            seen = self._outranks = {}
        asked_at, higher = seen.get(name, (-1e9, False))
        if now - asked_at >= self.busy_poll_s:
            higher = self._ask_leases(  # type: ignore[attr-defined]
                self.leases.others_waiting, False, self.owner, name, None, self.priority + 1
            )
            seen[name] = (now, higher)
        return higher

    @contextmanager
    def prioritized(self, priority: int) -> Iterator[None]:
        """While a job of ``priority`` runs on this (long-lived) pool, the pool has the
        highest priority of the jobs it runs (a worker's messages each carry their own)."""
        if self._in_flight is None:
            self._in_flight = Counter()
        self._in_flight[priority] += 1
        self.priority = max(self._in_flight)
        try:
            yield
        finally:
            self._in_flight[priority] -= 1
            if not self._in_flight[priority]:
                del self._in_flight[priority]
            self.priority = max(self._in_flight, default=0)
