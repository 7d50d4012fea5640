"""Looking where a job's prompt was last posted before posting it again: a success in
/history is downloaded, a prompt still in /queue is followed, a server that can't be asked
is asked again for ``catch_up_s``; a run found there is checked to render every output."""

from __future__ import annotations

import asyncio
import logging
import time

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import (
    ComfyError,
)
from comfy_assets.render.outcome import (
    AttemptResult,
)

log = logging.getLogger("comfy_assets.render.attempt")


class CatchUp:
    """An attempt's catch-up (a part of ``Attempt``)."""

    async def _catch_up(self) -> AttemptResult | None:
        """Look where the prompt was last posted before posting again (exactly once).

        A server that cannot be asked is asked again (capped exponential backoff, no
        server held meanwhile) for ``catch_up_s`` seconds: posting elsewhere while our
        prompt may still run there would render the job twice."""
        name = self.prev_server
        if name is None:
            return None
        if self.pool.spec(name) is None:
            if self.prev_unsettled or self.prev_number is not None:
                # Its prompt may be on a server this pool has no address for (another
                # worker's): nothing can be asked there, and the event says so.
                self.twice = (
                    f"catch-up on {name} not possible: not a server of this pool; posting "
                    "anew: the job may render twice"
                )
                log.warning("%s: %s", self.label, self.twice)
            return None
        client = self.pool.client(name)
        pid = self.job.prompt_id
        give_up_at = time.monotonic() + self.catch_up_s
        delay = 0.1
        try:
            while True:
                try:
                    # Bounded like a probe: a frozen server must not eat the attempt's deadline.
                    async with asyncio.timeout(self.pool.settings.probe_timeout_s):
                        entry = await client.history(pid)
                        succeeded = entry is not None and entry.status_str == "success"
                        queue = None if succeeded else await client.queue()
                        if queue is not None and queue.find(pid) is None:
                            # It may have finished between the two: a prompt leaves /queue
                            # only once its history is written, so /history now tells.
                            entry = await client.history(pid)
                            if entry is not None and entry.status_str == "success":
                                queue = None
                    break
                except (ComfyError, TimeoutError) as e:
                    why = str(e) or f"no answer in {self.pool.settings.probe_timeout_s:g} s"
                    if self.slot is not None and self.slot.name != name:
                        self.slot.release()  # nothing posted: another job may use it meanwhile
                        self.slot = None
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        self.twice = (
                            f"catch-up on {name} not possible for {self.catch_up_s:g} s ({why}); "
                            "posting anew: the job may render twice"
                        )
                        log.warning("%s: %s", self.label, self.twice)
                        self.deadline_from = time.monotonic()
                        return None
                    log.info(
                        "%s: catch-up on %s not possible (%s); asking again in %.1f s",
                        self.label,
                        name,
                        why,
                        min(delay, left),
                    )
                    self.catching_up = (name, give_up_at)  # for status: whom it waits for
                    await asyncio.sleep(min(delay, left))
                    delay = min(delay * 2, 5.0)
        finally:
            self.catching_up = None
        if queue is None:
            assert entry is not None
            log.info("%s: caught up on %s: prompt %s already succeeded", self.label, name, pid)
            return await self._download(client, name, entry, caught_up=True, verify=True)
        found = queue.find(pid)
        if found is None:
            if entry is None and self.prev_number is not None:
                # Accepted as run N, yet unknown to the server now: taken off the queue
                # before it ran, or forgotten by a restart after it ran.
                self.twice = (
                    f"catch-up on {name}: run {self.prev_number} in neither /history nor "
                    "/queue (removed before it ran, or forgotten by a restart): posting "
                    "anew, the job may render twice"
                )
            elif entry is None and self.prev_unsettled:
                # Its process died after the POST left: the POST may have been accepted
                # and the run forgotten by a restart since, or it never arrived.
                self.twice = (
                    f"catch-up on {name}: the prompt of an attempt that never ended is in "
                    "neither /history nor /queue (never accepted, removed, or forgotten by "
                    "a restart): posting anew, the job may render twice"
                )
            return None
        log.info(
            "%s: caught up on %s: prompt %s still queued as #%s",
            self.label,
            name,
            pid,
            found.number,
        )
        if self.slot is not None and self.slot.name != name:
            self.slot.release()
            self.slot = None
        if self.slot is None:
            self.slot = await self.pool.acquire(only=name, allow_prompt=pid)
        self.slot.prompt_id = pid
        await self.hooks.submitted(name, None)
        await self.hooks.rendering(name, found.number)
        return await self._follow(self.slot, found.number, posted=False)

    async def _dropped(self, client: ComfyClient, listed: tuple[str, ...] | None) -> str:
        """Why a run of our prompt renders less than the workflow asks ("outputs dropped:
        node 3 ..."), or "" when it rendered every output node. Raises the client's
        errors (it may ask /object_info).

        A POST answered 200 with ``node_errors`` (validation_errors.json) queues the
        prompt without the output nodes that failed: a run found by a catch-up or after
        an unanswered POST tells it only by its ``outputs_to_execute``."""
        if listed is None:
            return ""
        missing = [n for n in self.job.workflow if n not in listed]
        dropped = [
            n
            for n in missing
            if await client.is_output_node(str(self.job.workflow[n].get("class_type")))
        ]
        if not dropped:
            return ""
        nodes = ", ".join(f"node {n}" for n in sorted(dropped))
        return f"outputs dropped: {nodes} not among the outputs the server runs"
