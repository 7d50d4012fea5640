"""Priorities across the processes sharing servers (a part of ``Pool``).

A pool has the priority of the batch it serves (``Pool.priority``, an integer, higher
first, default 0); its marks that it waits for a server carry it (``mark_waiting``).
When one of our prompts frees a server, the pool hands it to its own next job unless
another process waits for it with a priority at least ours (equal ones take turns:
``Handover.slot_released``); a free server that another process waits for with a higher
priority is not taken at all. A prompt already rendering is never interrupted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from comfy_assets.pool.lease_keeping import LeaseKeeper
from comfy_assets.pool.server_state import ServerState, ServerStates

# Seconds a mark that this pool waits for a server stands (``Priorities.mark_waiting``):
# long enough to be written rarely, short enough that a mark left by a pool that got its
# server makes others leave a freed server idle (``3 x busy_poll_s``) only briefly.
WAITING_MARK_S = 1.0
# Seconds the other processes' marks, once read, stand for every server of the pool: a
# mark made meanwhile is seen this much later at most (a freed server goes to our next
# job once more), where reading them at each freed server was a statement per job.
MARKS_READ_S = WAITING_MARK_S / 4


@dataclass(eq=False)
class Priorities:
    """The pool's priority, its marks that it waits, and whether another process waits
    for a server (at a priority at least ours, or above it). The marks read from the store
    stand ``MARKS_READ_S`` for every server."""

    states: ServerStates
    keeper: LeaseKeeper
    busy_poll_s: float
    priority: int = field(default=0, init=False)
    _in_flight: Counter[int] = field(default_factory=Counter, init=False, repr=False)
    _marked_at: float = field(default=-1e9, init=False, repr=False)
    # (asked at, the other processes' marks then): ``marks``.
    _marks: tuple[float, list[tuple[str | None, int]]] = field(
        default=(-1e9, []), init=False, repr=False
    )

    def outranked(self, state: ServerState) -> bool:
        """Whether another process waits for ``state``'s server with a higher priority
        than ours."""
        return self._waiting_for(state.name, self.priority + 1)

    def others_waiting(self, state: ServerState) -> bool:
        """Whether another process waits for ``state``'s server at our priority or above:
        one that could not take it is no reason to leave it."""
        return self._waiting_for(state.name, self.priority)

    def _waiting_for(self, server: str, priority: int) -> bool:
        """Whether another process's mark (``marks``) waits for ``server`` with at
        least ``priority``."""
        return any(
            at_least >= priority and (servers is None or f" {server} " in servers)
            for servers, at_least in self.marks()
        )

    def marks(self) -> list[tuple[str | None, int]]:
        """The other processes' marks standing now, as (servers, priority)
        (``Store.waiting_marks``): read at most once per ``MARKS_READ_S`` (or
        ``busy_poll_s`` if longer) for all our servers, where a question per server was a
        statement per freed server (one per job); none while the store fails."""
        now = asyncio.get_running_loop().time()
        asked_at, marks = self._marks
        if now - asked_at >= max(self.busy_poll_s, MARKS_READ_S):
            keeper = self.keeper
            marks = keeper.ask(keeper.leases.waiting_marks, [], keeper.owner)
            self._marks = (now, marks)
        return marks

    def mark_waiting(self) -> None:
        """Tell other processes that we wait for one of our servers: a mark good for
        ``WAITING_MARK_S``, renewed at half its life. A consumer in line for a busy
        server waits most of the time, so a mark per poll would be a write every
        busy_poll_s for as long as the pool works."""
        now = asyncio.get_running_loop().time()
        if now - self._marked_at >= WAITING_MARK_S / 2:
            self._marked_at = now
            names = [s.name for s in self.states.all]
            keeper = self.keeper
            mark = keeper.leases.mark_waiting
            keeper.ask(mark, None, keeper.owner, WAITING_MARK_S, names, None, self.priority)

    @contextmanager
    def prioritized(self, priority: int) -> Iterator[None]:
        """While a job of ``priority`` runs on this (long-lived) pool, the pool has the
        highest priority of the jobs it runs (a worker's messages each carry their own)."""
        self._in_flight[priority] += 1
        self.priority = max(self._in_flight)
        try:
            yield
        finally:
            self._in_flight[priority] -= 1
            if not self._in_flight[priority]:
                del self._in_flight[priority]
            self.priority = max(self._in_flight, default=0)
