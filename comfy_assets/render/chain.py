"""Chained jobs: a job whose input is a file an earlier job of its file wrote (a shot that
continues from the last frame of the shot before) waits until that job is done.

Such a job is parked until its upstream jobs are resolved: it goes back in line when one
of them ends in this batch, and every few seconds in case another process renders them.
Once each upstream job has succeeded under the prompt_id the job was validated against,
the job runs and its attempt uploads the upstream's file (``render/inputs.py``). When
an upstream job is dead-lettered (or degraded, with no file to continue from), the job is
not rendered: the failure belongs to the upstream shot, and the job's reason names it
(a dead letter, or degraded under the draft policy). When that upstream job is requeued
and renders, a job dead-lettered (or degraded) only for it is requeued by the next run.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Literal

from comfy_assets.jobs.model import InputFromJob, Job
from comfy_assets.jobs.states import REQUEUEABLE, InvalidTransition
from comfy_assets.render.inputs import UpstreamFile
from comfy_assets.render.queue import Item, JobQueue
from comfy_assets.render.store_threads import StoreThreads
from comfy_assets.store import JobRecord, Store

# The start of the reason of a job not rendered because of its upstream job.
NOT_RENDERED = "not rendered: it continues from "

# How often parked jobs look again when no upstream job ended in this batch (seconds):
# an upstream job another process renders ends without telling us.
RECHECK_S = 2.0

Verdict = Literal["ready", "wait", "blocked"]


@dataclass(eq=False)
class Chain:
    """Parking and releasing the chained jobs of one batch: ``jobs``, whose records are
    read from ``store`` through ``threads``, put back in ``queue`` once they may run."""

    jobs: InitVar[Sequence[Job]]
    _: KW_ONLY
    store: Store
    threads: StoreThreads
    queue: JobQueue
    partition: str
    parked: dict[str, Item] = field(default_factory=dict, init=False, repr=False)
    lines: dict[str, Job] = field(init=False, repr=False)  # by job id
    dependants: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self, jobs: Sequence[Job]) -> None:
        self.lines = {job.id: job for job in jobs}
        for job in jobs:
            for up in job.depends_on:
                self.dependants.setdefault(up, []).append(job.id)

    def describe(self, job_id: str) -> str:
        """``job <id> (line N, shot S)``: how a reason names an upstream job."""
        job = self.lines.get(job_id)
        if job is None:
            return f"job {job_id}"
        shot = f", shot {job.shot}" if job.shot is not None else ""
        return f"job {job_id} (line {job.line}{shot})"

    async def upstreams(self, job: Job) -> tuple[Verdict, str]:
        """Whether ``job`` may run now: ("ready", ""), ("wait", "") or ("blocked",
        reason) when an upstream job ended without a file to continue from."""
        for ref in _upstream_refs(job):
            rec: JobRecord | None = await self.threads.call(self.store.get, ref.job)
            if rec is None or rec.prompt_id != ref.upstream_prompt_id:
                return "wait", ""  # not registered yet, or registered with other inputs
            if rec.state == "succeeded":
                continue
            if rec.state == "failed_fatal":
                why = f"{NOT_RENDERED}{self.describe(ref.job)}, which was dead-lettered"
                return "blocked", f"{why} ({rec.reason})"
            if rec.state == "degraded":
                why = f"{NOT_RENDERED}{self.describe(ref.job)}, which was degraded"
                return "blocked", f"{why} and wrote no file to continue from ({rec.reason})"
            return "wait", ""
        return "ready", ""

    def park(self, item: Item) -> None:
        """``item`` waits for its upstream jobs, out of the queue."""
        self.parked[item.job.id] = item

    def unpark(self, job_id: str | None) -> None:
        """Put back in line the parked jobs that wait for ``job_id`` (None: all of them)."""
        ids = list(self.parked) if job_id is None else self.dependants.get(job_id, [])
        for dependant in ids:
            item = self.parked.pop(dependant, None)
            if item is not None:
                self.queue.push(item)

    async def watch_parked(
        self, finished: asyncio.Event, stopped: Callable[[], str | None]
    ) -> None:
        """While jobs are parked, put them back in line every ``RECHECK_S`` until
        ``finished`` (not while ``stopped`` says why the batch stopped)."""
        while not finished.is_set():
            try:
                await asyncio.wait_for(finished.wait(), RECHECK_S)
            except TimeoutError:
                if self.parked and not stopped():
                    self.unpark(None)

    async def requeue_if_upstream_fixed(
        self, job: Job, rec: JobRecord, report: Callable[[str], None]
    ) -> bool:
        """A job dead-lettered (or degraded, under draft) only because its upstream job
        was, whose upstream is no longer blocked: back to pending (True, said with
        ``report``), so it renders in this run."""
        if rec.state not in REQUEUEABLE:
            return False
        if not job.depends_on or not (rec.reason or "").startswith(NOT_RENDERED):
            return False
        verdict, _ = await self.upstreams(job)
        if verdict == "blocked":
            return False
        try:
            await self.threads.call(
                self.store.transition,
                job.id,
                "pending",
                detail="requeued: the job it continues from is no longer failed",
            )
        except InvalidTransition:
            pass  # another worker requeued it a moment ago
        report(f"job {job.id}: requeued, the job it continues from is no longer failed")
        return True

    async def settle_blocked_left(
        self,
        claim: Callable[[Item], Awaitable[JobRecord | None]],
        not_rendered: Callable[[Item, str], Awaitable[None]],
    ) -> None:
        """After a stopped batch: the parked jobs whose upstream job failed are settled
        (``claim``, then ``not_rendered`` with the reason), in as many passes as the chain
        is long; the others stay pending for the next run."""
        changed = True
        while changed:
            changed = False
            # Put back in line by an upstream job's end, but no consumer is left.
            for item in [i for i in self.queue.ready if i.job.depends_on]:
                self.queue.remove(item)
                self.park(item)
            for job_id, item in list(self.parked.items()):
                verdict, reason = await self.upstreams(item.job)
                if verdict != "blocked":
                    continue
                del self.parked[job_id]
                rec = await claim(item)
                if rec is not None:
                    await not_rendered(item, reason)
                    changed = True

    async def locate(self, ref: InputFromJob) -> UpstreamFile:
        """The file ``ref`` names: the ``index``-th (0-based, in path order) output of the
        upstream job's node, from its done record. Raises LookupError."""
        files = await self.threads.call(self.store.files, ref.job)
        mine = sorted((f for f in files if f.node_id == ref.node), key=lambda f: str(f.path))
        if ref.index >= len(mine):
            raise LookupError(
                f"{self.describe(ref.job)} has {len(mine)} output files of node {ref.node}, "
                f"none at index {ref.index}"
            )
        f = mine[ref.index]
        stored = self.store.file_store
        name = stored.output_path(self.partition, ref.job, f) or f"{stored.location}: {f.path}"
        opener = functools.partial(stored.open_output, self.partition, ref.job, f)
        return UpstreamFile(str(name), f.sha256, f.bytes, opener)


def _upstream_refs(job: Job) -> list[InputFromJob]:
    """One chained input per upstream job of ``job`` (any of them names its prompt_id)."""
    seen: dict[str, InputFromJob] = {}
    for inp in job.inputs:
        if isinstance(inp, InputFromJob):
            seen.setdefault(inp.job, inp)
    return list(seen.values())
