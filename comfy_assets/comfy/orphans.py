"""Prompts of ours that nobody follows any more (their holder died, or gave up on them):
found by probes on free servers, removed after ``orphan_grace_s`` (a retry may adopt
one meanwhile)."""

from __future__ import annotations

import asyncio
import logging

from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.servers import ServerSpec

log = logging.getLogger("comfy_assets.pool")


class Orphans:
    """How the pool removes prompts of ours nobody follows (a part of ``Pool``)."""

    def _watch_orphans(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Note prompts of ours found on a free server; remove them once they have been
        there for ``orphan_grace_s``."""
        loop = asyncio.get_running_loop()
        if not orphans:
            self._orphans_since.pop(spec.name, None)
            return
        since = self._orphans_since.setdefault(spec.name, loop.time())
        if loop.time() - since < self.orphan_grace_s or spec.name in self._sweeps:
            return
        sweep = asyncio.create_task(
            self._remove_orphans(spec, orphans), name=f"orphans {spec.name}"
        )
        self._sweeps[spec.name] = sweep
        sweep.add_done_callback(lambda _: self._sweeps.pop(spec.name, None))

    async def _remove_orphans(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Take the server's lease, interrupt and delete ``orphans`` there, wait until they
        left its /queue (README fact 7: a delete can lose the race), give the lease back."""
        slot = self._take(spec, (), {}, purpose="to remove prompts of ours nobody follows")
        if slot is None:
            return  # someone took the server: they see the orphans too
        slot.dispatched()  # no prompt of ours goes there meanwhile
        client = self.clients[spec.name]
        deadline = asyncio.get_running_loop().time() + self.orphan_grace_s
        try:
            await client.delete_from_queue(orphans)
            for pid in orphans:
                await client.interrupt(pid)
            while (await client.queue()).find_any(orphans):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"still there after {self.orphan_grace_s:g} s")
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
        self._orphans_since.pop(spec.name, None)
        log.warning(
            "server %s: removed prompts of ours that nobody followed: %s",
            spec.name,
            ", ".join(orphans),
        )
        slot.release()
