"""The jobs of a batch waiting for a consumer: ready ones, and ones waiting out a delay."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from comfy_assets.comfy.slot import Slot
from comfy_assets.jobs.model import Job


@dataclass
class Item:
    job: Job
    prev_server: str | None = None
    attempts_before: int = 0  # the job's tries before its last requeue (store)
    fresh: bool = False  # its outputs are gone from the server: render anew
    # The run number of the prompt on prev_server that the last attempt saw (its POST's
    # answer, or a run found there) when the store has none: a catch-up that finds
    # neither that run nor its history then says the job may render twice.
    prev_number: int | None = None
    # The last attempt never ended (its process died mid-attempt): its POST may have been
    # accepted although no run number was recorded.
    prev_unsettled: bool = False


class JobQueue:
    """Jobs ready to run, and jobs waiting for a delay (backoff, someone else's claim)."""

    def __init__(self) -> None:
        self.ready: deque[Item] = deque()
        self.changed = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()

    def push(self, item: Item) -> None:
        self.ready.append(item)
        self.changed.set()

    def push_later(self, item: Item, delay_s: float) -> None:
        """Put ``item`` back after ``delay_s`` seconds, at the head of the line: it has
        waited longest."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self.ready.appendleft(item)
            self.changed.set()

        handle = loop.call_later(delay_s, fire)
        self._timers.add(handle)

    @property
    def waiting(self) -> int:
        return len(self._timers)

    def pop_for(self, slot: Slot) -> Item | None:
        """The best job for this server: its own previous server, else the model the
        server last ran (looking a little ahead), else the first in line."""
        if not self.ready:
            return None
        last = slot.pool.last_model.get(slot.name)
        for i, item in enumerate(list(self.ready)[:64]):
            if item.prev_server == slot.name or (last and last in item.job.models):
                del self.ready[i]
                return item
        return self.ready.popleft()

    def cancel_all(self) -> list[Item]:
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        items = list(self.ready)
        self.ready.clear()
        return items
