"""Removing our prompt from a server: interrupt, delete from the queue, wait until it left
/queue (an interrupt lands between nodes, a delete can lose the race: README fact 7),
and read its history in case it succeeded after all."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass

from comfy_assets.comfy.errors import (
    ComfyError,
)
from comfy_assets.pool.slot import Slot
from comfy_assets.render.outcome import (
    Eviction,
)

log = logging.getLogger("comfy_assets.render.attempt")

# Seconds a removal waits in silence for our prompt to leave its server's /queue.
SAY_WAITING_S = 5.0


@dataclass(eq=False)
class Removal:
    """How an attempt removes its prompt (``prompt_id``) from a server: waiting up to
    ``evict_timeout_s`` for it to leave, asking every ``poll_s``; a removal that can't be
    confirmed leaves the server lease to expire after ``lease_s``. ``label`` names the
    job in the log."""

    prompt_id: str
    _: KW_ONLY
    label: str
    evict_timeout_s: float
    poll_s: float
    lease_s: float

    async def evict(self, slot: Slot, number: int, wedge_s: float | None = None) -> Eviction:
        """Interrupt our prompt, delete it from the queue, and wait until it has left
        /queue (an interrupt lands only between nodes and a delete can lose the race:
        data/recorded/README.md fact 7); then read its history, in case run ``number``
        succeeded after all. The slot is released once the prompt has left; abandoned
        (its lease left to expire) if that can't be confirmed. ``wedge_s``: a prompt still
        running that long after its interrupt and delete means a wedged server (its
        execution stuck inside a node): given up then, ``wedged`` (None: only
        ``evict_timeout_s`` bounds the wait)."""
        client, pid = slot.client, self.prompt_id
        deadline = time.monotonic() + self.evict_timeout_s
        try:
            queue = await client.queue()
            was_there = queue.find(pid) is not None
            if was_there:
                await client.delete_from_queue([pid])
                await client.interrupt(pid)
            started, told = time.monotonic(), False
            while queue.find(pid) is not None:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"still there after {self.evict_timeout_s:g} s")
                if wedge_s is not None and now - started >= wedge_s and queue.is_running(pid):
                    problem = (
                        f"still running {now - started:.0f} s after its interrupt and delete: "
                        f"{slot.name} is wedged (its execution stuck inside a node)"
                    )
                    log.warning("%s: prompt %s %s", self.label, pid, problem)
                    slot.abandon()
                    return Eviction(was_there=True, confirmed=False, problem=problem, wedged=True)
                if not told and now - started >= SAY_WAITING_S:
                    # A node runs to its end before an interrupt lands: a long one (or a
                    # server that stopped executing) would keep the wait silent.
                    told = True
                    log.warning(
                        "%s: prompt %s still on %s %.0f s after it was interrupted; waiting "
                        "up to %g s in all for it to leave",
                        self.label,
                        pid,
                        slot.name,
                        now - started,
                        self.evict_timeout_s,
                    )
                await asyncio.sleep(self.poll_s)
                queue = await client.queue()
            entry = await client.history(pid)
        except (ComfyError, TimeoutError) as e:
            problem = str(e) or type(e).__name__
            log.warning(
                "%s: could not confirm prompt %s left %s: %s", self.label, pid, slot.name, problem
            )
            slot.abandon()
            return Eviction(was_there=True, confirmed=False, problem=problem)
        slot.release()
        won = entry.number == number and entry.status_str == "success" if entry else False
        return Eviction(
            was_there=was_there, confirmed=True, won=entry if won else None, history=entry
        )

    async def remove(self, slot: Slot, number: int) -> str:
        """``evict`` our run ``number`` from ``slot``'s server; what came of it, for
        people. A run that succeeded meanwhile is left for the next attempt's catch-up."""
        gone = await self.evict(slot, number)
        if not gone.confirmed:
            return (
                f"could not remove prompt {self.prompt_id} from {slot.name} "
                f"({gone.problem}); its server lease expires in {self.lease_s:g} s"
            )
        if gone.won is not None:
            return f"it succeeded on {slot.name} meanwhile (the next attempt takes it)"
        if gone.was_there:
            return f"prompt interrupted and removed from {slot.name}"
        return f"prompt no longer on {slot.name}"
