"""Holding a server: a prompt's end hands the server to the next consumer in line (or,
when another process waits for it, leaves it to that process for a moment), keeps its
lease for our own next prompt, or gives it back (a part of ``Pool``)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from comfy_assets.comfy.slot import Slot

log = logging.getLogger("comfy_assets.pool")


class Holding:
    """What happens to a held server at a prompt's end (a part of ``Pool``)."""

    _handovers: deque[asyncio.Event]
    _held: dict[str, Slot]
    _kept: dict[str, float]
    _yielded: dict[str, float]
    _freed_at: dict[str, float]
    _finished: Any
    _lease_until: dict[str, float]
    _line: asyncio.Lock
    _changed: asyncio.Event
    busy_poll_s: float
    settings: Any

    def dispatch_done(self) -> None:
        """``Slot.posted``: a dispatch is over; the oldest hand-over waiting is done."""
        if self._handovers:
            self._handovers.popleft().set()

    async def handed_over(self, slot: Slot, max_wait_s: float = 0.25) -> None:
        """Wait (at most ``max_wait_s`` seconds) until the server ``slot`` freed has its
        next prompt posted, when a consumer was waiting for it; else return at once."""
        if slot.handover is None or slot.handover.is_set():
            return
        try:
            async with asyncio.timeout(max_wait_s):
                await slot.handover.wait()
        except TimeoutError:
            pass

    def slot_released(self, slot: Slot) -> None:
        """``Slot.release``: give the server back, or keep it for our next prompt."""
        if slot.lost is not None:
            # The lease is not ours to give (taken, or the store can't be written): it
            # expires by itself, and the server can be offered again.
            if self._held.get(slot.name) is slot:
                del self._held[slot.name]
            self._changed.set()
            return
        self._held.pop(slot.name, None)
        loop = asyncio.get_running_loop()
        if self._line.locked() and self._others_waiting(slot.name):
            # Another process waits for a server too: leave this one to it for a moment
            # rather than hand it to our own next job (runs that share servers all move).
            self._yielded[slot.name] = loop.time() + 3 * self.busy_poll_s
        elif slot.prompt_id is not None and self._line.locked():
            slot.handover = asyncio.Event()  # a consumer is in line: it takes this server
            self._handovers.append(slot.handover)
            kept_at = self._kept[slot.name] = loop.time()
            # Nobody came for it after all (the batch ended, say): give it back.
            loop.call_later(3 * self.busy_poll_s, self._let_go, slot.name, kept_at)
        elif slot.prompt_id is not None and not self._others_waiting(slot.name):
            # Nobody in line yet, ours or another process's: our next consumer is most
            # likely finishing its job (downloads, the done record) and comes back within
            # moments. Keeping the lease saves writing it away and back between two of
            # our prompts; unused, it goes back as above.
            kept_at = self._kept[slot.name] = loop.time()
            loop.call_later(3 * self.busy_poll_s, self._let_go, slot.name, kept_at)
        if slot.prompt_id is not None:
            self._freed_at[slot.name] = asyncio.get_running_loop().time()
            self._finished[slot.prompt_id] = None
            while len(self._finished) > 4096:
                self._finished.popitem(last=False)
        self._prompt_left(slot)
        if slot.name not in self._kept:
            self._release_lease(slot.name, self.held_text(slot.name))
        self._changed.set()

    def _let_go(self, name: str, kept_at: float | None = None) -> None:
        """Release the lease of a kept server (only if kept since ``kept_at``, if given)."""
        if name not in self._kept or (kept_at is not None and self._kept[name] != kept_at):
            return
        del self._kept[name]
        self._release_lease(name, self.held_text(name))
        self._changed.set()

    def slot_abandoned(self, slot: Slot) -> None:
        """``Slot.abandon``: stop renewing; the lease expires by itself."""
        if self._held.get(slot.name) is slot:
            del self._held[slot.name]
        self._lease_until.pop(slot.name, None)
        # Not "just freed": the next prompt may go there only once a probe shows ours gone.
        self._freed_at.pop(slot.name, None)
        log.warning(
            "server %s: our prompt may still be there; its lease will expire in %.0f s",
            slot.name,
            self.settings.server_lease_s,
        )
