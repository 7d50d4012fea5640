"""Feeding a batch from a job file read a chunk at a time (``jobs/stream.py``): each chunk
registered in the store, then put in line, while at most ``AHEAD`` jobs are fed and not
yet resolved. The first chunk is small, so the first prompt goes out at once while the
rest of the file is still to register; the memory a batch holds stays that of ``AHEAD``
jobs whatever the file's size. A job the registration finds ended already (a run started
again on its file) is resolved as it is fed (``settle``), not put in line: the jobs done
before a kill cost a row read each in their chunk's registration, not a claim each in
turn before the first job left to run is posted. ``Feeding``, a part of ``Batch``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.stream import JobReader, JobScan
from comfy_assets.render.outputs import EndedBefore, ended_before
from comfy_assets.render.queue import Item, JobQueue
from comfy_assets.store import Store

FIRST_CHUNK = 64  # jobs: registered in a few milliseconds
CHUNK = 1000  # jobs a registration: one transaction, a few hundred milliseconds at most
AHEAD = 2000  # jobs fed and not yet resolved, at most (before the next chunk is taken)


@dataclass(eq=False, kw_only=True)
class Feeding:
    """Takes ``source``'s jobs a chunk at a time, registers each chunk in ``store`` under
    ``partition`` and puts its jobs in ``queue``, while the jobs fed and not yet resolved
    (``resolved()``: the batch's resolutions) stay under ``AHEAD``; ``room`` is set when
    that may have changed, and ``over()`` says the batch finished or stopped. A job its
    registration found ended is given to ``settle`` instead (``Admission.settle_ended``:
    True when it resolved it, else it goes in line). ``fed``: jobs fed so far."""

    source: JobScan
    store: Store
    partition: str
    queue: JobQueue
    resolved: Callable[[], int]
    over: Callable[[], bool]
    settle: Callable[[Job, EndedBefore], bool]
    room: asyncio.Event = field(default_factory=asyncio.Event)
    fed: int = 0

    async def run(self) -> None:
        """Feed until every job is fed or the batch is over. Raises what reading the
        file (``JobFileChanged``) or registering (``PartitionConflict``,
        ``StoreUnavailable``) raises."""
        reader = self.source.reader()
        try:
            size = FIRST_CHUNK
            while not self.over() and self.fed < self.source.count:
                if self.fed - self.resolved() >= AHEAD:
                    self.room.clear()
                    await self.room.wait()
                    continue
                jobs, ended = await self._take(reader, size)
                size = CHUNK
                self.fed += len(jobs)
                for job in jobs:
                    before = ended.get(job.id)
                    if before is None or not self.settle(job, before):
                        self.queue.push(Item(job))
        finally:
            reader.close()

    async def _take(
        self, reader: JobReader, count: int
    ) -> tuple[list[Job], dict[str, EndedBefore]]:
        """The next ``count`` jobs, built and registered on a thread of their own (the
        event loop goes on following prompts meanwhile), and those of them ended already
        (``outputs.ended_before``). Cancelled, it waits for that thread: a registration
        under way lands before the batch cleans up."""
        work = asyncio.ensure_future(asyncio.to_thread(self._registered, reader, count))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.gather(work, return_exceptions=True)
            raise

    def _registered(
        self, reader: JobReader, count: int
    ) -> tuple[list[Job], dict[str, EndedBefore]]:
        jobs = reader.take(count)
        if not jobs:
            return jobs, {}
        ended = self.store.register_jobs(self.partition, jobs).ended
        return jobs, ended_before(self.store, self.partition, ended) if ended else {}
