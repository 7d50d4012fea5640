"""Prompts of ours that nobody follows any more (their holder died, or gave up on them):
found by probes on free servers, removed after ``orphan_grace_s`` (a retry may adopt
one meanwhile)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.pool.server_state import ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import Slot

# How the pool takes a server's lease for a purpose of its own: (spec, models, queue
# lengths for the log, purpose) -> the slot, or None if someone else has it.
Take = Callable[[ServerSpec, Sequence[str], dict[str, int], str], Slot | None]

log = logging.getLogger("comfy_assets.pool")


@dataclass(eq=False)
class Orphans:
    """How the pool removes prompts of ours nobody follows (a part of ``Pool``), taking
    the server with ``take`` first; ``grace_s``: how long one may stay."""

    states: ServerStates
    settings: PoolSettings
    grace_s: float
    take: Take

    def watch(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Note prompts of ours found on a free server; remove them once they have been
        there for ``grace_s``."""
        loop = asyncio.get_running_loop()
        state = self.states[spec.name]
        if not orphans:
            state.orphans_since = None
            return
        if state.orphans_since is None:
            state.orphans_since = loop.time()
        if loop.time() - state.orphans_since < self.grace_s or state.sweep is not None:
            return
        sweep = state.sweep = asyncio.create_task(
            self._remove(spec, orphans), name=f"orphans {spec.name}"
        )
        sweep.add_done_callback(lambda _: setattr(state, "sweep", None))

    async def _remove(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Take the server's lease, interrupt and delete ``orphans`` there, wait until they
        left its /queue (README fact 7: a delete can lose the race), give the lease back."""
        slot = self.take(spec, (), {}, "to remove prompts of ours nobody follows")
        if slot is None:
            return  # someone took the server: they see the orphans too
        slot.dispatched()  # no prompt of ours goes there meanwhile
        client = self.states[spec.name].client
        deadline = asyncio.get_running_loop().time() + self.grace_s
        try:
            await client.delete_from_queue(orphans)
            for pid in orphans:
                await client.interrupt(pid)
            while (await client.queue()).find_any(orphans):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"still there after {self.grace_s:g} s")
                await asyncio.sleep(self.settings.poll_s)
        except (ComfyError, TimeoutError) as e:
            log.warning(
                "server %s: could not remove prompts of ours nobody follows (%s): %s",
                spec.name,
                e,
                ", ".join(orphans),
            )
            slot.abandon()
            return
        self.states[spec.name].orphans_since = None
        log.warning(
            "server %s: removed prompts of ours that nobody followed: %s",
            spec.name,
            ", ".join(orphans),
        )
        slot.release()

    async def close(self) -> None:
        """Stop the removals under way: one half done leaves a lease to expire, nothing
        worse."""
        sweeps = [s.sweep for s in self.states.all if s.sweep is not None]
        for sweep in sweeps:
            sweep.cancel()
        await asyncio.gather(*sweeps, return_exceptions=True)
