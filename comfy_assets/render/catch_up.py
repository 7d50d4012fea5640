"""Looking where a job's prompt was last posted before posting it again: a success in
/history is downloaded, a prompt still in /queue is followed, a server that can't be asked
is asked again for ``catch_up_s``; a run found there is checked to render every output."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.types import HistoryEntry, QueueState
from comfy_assets.render.outcome import AttemptResult, Run

if TYPE_CHECKING:
    from comfy_assets.render.attempt import Attempt

log = logging.getLogger("comfy_assets.render.attempt")


@dataclass(eq=False)
class CatchUp:
    """An attempt's catch-up (``Attempt.catch_up``): it reads and sets the ``attempt``'s
    state (its slot, ``twice``, ``catching_up``, the deadline's start) and follows or
    downloads a run it finds with the attempt's own means."""

    attempt: Attempt
    # The server it could not ask for ``catch_up_s`` (the post goes elsewhere if it can).
    gave_up: str | None = None

    async def run(self) -> AttemptResult | None:
        """Look where the prompt was last posted before posting again (exactly once):
        the attempt's result when a run was found there (downloaded or followed), else
        None (post anew).

        A server that cannot be asked is asked again (capped exponential backoff, no
        server held meanwhile) for ``catch_up_s`` seconds: posting elsewhere while our
        prompt may still run there would render the job twice."""
        a = self.attempt
        name = a.prev_server
        if name is None:
            return None
        if a.pool.spec(name) is None:
            if a.prev_unsettled or a.prev_number is not None:
                # Its prompt may be on a server this pool has no address for (another
                # worker's): nothing can be asked there, and the event says so.
                a.twice = (
                    f"catch-up on {name} not possible: not a server of this pool; posting "
                    "anew: the job may render twice"
                )
                log.warning("%s: %s", a.label, a.twice)
            return None
        client = a.pool.client(name)
        pid = a.job.prompt_id
        asked = await self._ask(client, name)
        if asked is None:
            return None
        entry, queue = asked
        if queue is None:
            assert entry is not None
            log.info("%s: caught up on %s: prompt %s already succeeded", a.label, name, pid)
            return await a.download(
                client, name, entry, Run(entry.number, caught_up=True, verify=True)
            )
        found = queue.find(pid)
        if found is None:
            self._not_found(name, entry)
            return None
        log.info(
            "%s: caught up on %s: prompt %s still queued as #%s",
            a.label,
            name,
            pid,
            found.number,
        )
        if a.slot is not None and a.slot.name != name:
            a.slot.release()
            a.slot = None
        if a.slot is None:
            a.slot = await a.pool.acquire(only=name, allow_prompt=pid)
        a.slot.prompt_id = pid
        await a.hooks.submitted(name, None)
        await a.hooks.rendering(name, found.number)
        return await a.follow(a.slot, found.number, posted=False)

    async def _ask(
        self, client: ComfyClient, name: str
    ) -> tuple[HistoryEntry | None, QueueState | None] | None:
        """The prompt's /history entry on ``name`` and its /queue (None when it
        succeeded), asked again until ``catch_up_s`` runs out: then None (said, and
        ``twice`` set)."""
        a = self.attempt
        pid = a.job.prompt_id
        give_up_at = time.monotonic() + a.catch_up_s
        delay = 0.1
        try:
            while True:
                try:
                    # Bounded like a probe: a frozen server must not eat the attempt's deadline.
                    async with asyncio.timeout(a.pool.settings.probe_timeout_s):
                        entry = await client.history(pid)
                        succeeded = entry is not None and entry.status_str == "success"
                        queue = None if succeeded else await client.queue()
                        if queue is not None and queue.find(pid) is None:
                            # It may have finished between the two: a prompt leaves /queue
                            # only once its history is written, so /history now tells.
                            entry = await client.history(pid)
                            if entry is not None and entry.status_str == "success":
                                queue = None
                    return entry, queue
                except (ComfyError, TimeoutError) as e:
                    why = str(e) or f"no answer in {a.pool.settings.probe_timeout_s:g} s"
                    if a.slot is not None and a.slot.name != name:
                        a.slot.release()  # nothing posted: another job may use it meanwhile
                        a.slot = None
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        a.twice = (
                            f"catch-up on {name} not possible for {a.catch_up_s:g} s ({why}); "
                            "posting anew: the job may render twice"
                        )
                        log.warning("%s: %s", a.label, a.twice)
                        self.gave_up = name
                        a.deadline_from = time.monotonic()
                        return None
                    log.info(
                        "%s: catch-up on %s not possible (%s); asking again in %.1f s",
                        a.label,
                        name,
                        why,
                        min(delay, left),
                    )
                    a.catching_up = (name, give_up_at)  # for status: whom it waits for
                    await asyncio.sleep(min(delay, left))
                    delay = min(delay * 2, 5.0)
        finally:
            a.catching_up = None

    def _not_found(self, name: str, entry: HistoryEntry | None) -> None:
        """Our prompt is in neither /history's successes nor /queue on ``name``: why
        posting anew may render it twice, if it may (``twice``)."""
        a = self.attempt
        if entry is None and a.prev_number is not None:
            # Accepted as run N, yet unknown to the server now: taken off the queue
            # before it ran, or forgotten by a restart after it ran.
            a.twice = (
                f"catch-up on {name}: run {a.prev_number} in neither /history nor "
                "/queue (removed before it ran, or forgotten by a restart): posting "
                "anew, the job may render twice"
            )
        elif entry is None and a.prev_unsettled:
            # Its process died after the POST left: the POST may have been accepted
            # and the run forgotten by a restart since, or it never arrived.
            a.twice = (
                f"catch-up on {name}: the prompt of an attempt that never ended is in "
                "neither /history nor /queue (never accepted, removed, or forgotten by "
                "a restart): posting anew, the job may render twice"
            )


async def dropped_outputs(
    client: ComfyClient, workflow: dict[str, Any], listed: tuple[str, ...] | None
) -> str:
    """Why a run of our prompt renders less than ``workflow`` asks ("outputs dropped:
    node 3 ..."), or "" when it rendered every output node. Raises the client's errors
    (it may ask /object_info).

    A POST answered 200 with ``node_errors`` (validation_errors.json) queues the
    prompt without the output nodes that failed: a run found by a catch-up or after
    an unanswered POST tells it only by its ``outputs_to_execute``."""
    if listed is None:
        return ""
    missing = [n for n in workflow if n not in listed]
    dropped = [
        n for n in missing if await client.is_output_node(str(workflow[n].get("class_type")))
    ]
    if not dropped:
        return ""
    nodes = ", ".join(f"node {n}" for n in sorted(dropped))
    return f"outputs dropped: {nodes} not among the outputs the server runs"
