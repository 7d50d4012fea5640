"""What a running batch tells the people steering it, every few seconds: how far it is,
why its jobs left wait, how far each running prompt is and when it will be done.

``Steering`` wraps a batch's ``on_progress``: each ``Progress`` the batch gives (a job
ended) and one every ``every_s`` seconds (``run``) carry the estimate (``render/eta.py``),
the jobs left by reason and a line per running prompt (``comfy/progress.py``), the reasons
and the lines looked at in one moment, so the reasons add up to the jobs left. The
reasons, a small fixed vocabulary (``REASONS``), each name what the jobs wait for:

- ``rendering``: their prompt on a server (posted, or being posted: the server held for
  it), so never more than the servers;
- ``finishing``: their prompt has left its server: the outputs are downloaded and the
  result recorded;
- ``waiting for a server``: in line for one of the servers that can run them (claimed or
  not);
- ``for their upstream shot``: a job they continue from is not done yet;
- ``in backoff``: waiting out the delay after a failed attempt;
- ``claimed by another process``: another worker holds their claim;
- ``done before, being checked``: the store had them done when the batch started (a run
  again of a partition): their records and files are checked, nothing is posted;
- ``not submitted: the batch stopped submitting``: the delivery policy stopped the batch
  at a fatal failure (or no server answered): they stay pending for another run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING

from comfy_assets.comfy.capabilities import Needs
from comfy_assets.jobs.model import Job, is_priority
from comfy_assets.pool.plan import models_of
from comfy_assets.pool.slot import Slot
from comfy_assets.render import publish
from comfy_assets.render.eta import Estimator, Running
from comfy_assets.render.progress import Progress
from comfy_assets.render.queue import Item
from comfy_assets.store import StoreUnavailable

if TYPE_CHECKING:
    from comfy_assets.render.batch import Batch

RENDERING = "rendering"
FINISHING = "finishing"
FOR_A_SERVER = "waiting for a server"
FOR_UPSTREAM = "for their upstream shot"
IN_BACKOFF = "in backoff"
FOR_A_CLAIM = "claimed by another process"
DONE_BEFORE = "done before, being checked"
STOPPED = "not submitted: the batch stopped submitting"
REASONS = (
    RENDERING,
    FINISHING,
    FOR_A_SERVER,
    FOR_UPSTREAM,
    IN_BACKOFF,
    FOR_A_CLAIM,
    DONE_BEFORE,
    STOPPED,
)


log = logging.getLogger("comfy_assets.render.steering")

EVERY_S = 2.0  # seconds between the progress a batch gives while no job ends
REFRESH_S = 0.5  # seconds an estimate stands for the jobs that end (less the time since)

# Called with each batch's progress as it is given, and (steering, None) once the batch
# ended (the metrics: ``metrics.py``).
watchers: list[Callable[[Steering, Progress | None], None]] = []


class Steering:
    """The progress of ``batch`` with its estimate, reasons and running prompts, given to
    ``on_progress`` (on the batch's event loop). Made before ``batch.run``; ``run`` gives
    one every ``every_s`` seconds until cancelled. ``done_before``: how many of its jobs
    the store had done when it started (``DONE_BEFORE``)."""

    def __init__(
        self,
        batch: Batch,
        on_progress: Callable[[Progress], None],
        every_s: float | None = None,
        done_before: int = 0,
    ) -> None:
        self.batch = batch
        self.on_progress = on_progress
        self.every_s = EVERY_S if every_s is None else every_s
        self.estimator = Estimator()
        self._published = False
        self.done_before = done_before
        self._last: Progress | None = None  # the last full look (``now``), and when
        self._last_at = 0.0
        batch.on_progress = self._batch_progress
        batch.pool.prompt_listeners.append(self._prompt_ended)

    def close(self) -> None:
        """Stop measuring the pool's prompts (the pool may outlive the batch) and take
        the batch's rows out of the store."""
        listeners = self.batch.pool.prompt_listeners
        if self._prompt_ended in listeners:
            listeners.remove(self._prompt_ended)
        for watch in watchers:
            watch(self, None)
        if self._published:
            try:
                self.batch.store.clear_live(self.batch.owner)
            except StoreUnavailable as e:  # they go stale by themselves
                log.warning("status rows of %s not cleared: %s", self.batch.partition, e)

    async def run(self) -> None:
        """Write what ``status`` shows to the store (``render/publish.py``) at once, so
        the batch's jobs read as its own from its start; then give the progress and
        write it every ``every_s`` seconds, until cancelled. (The first progress given
        is a job's end: a log of the first and then one every few seconds starts there.)"""
        give = False
        while True:
            if self.batch.progress.remaining:
                await self._tick(give)
            give = True
            await asyncio.sleep(self.every_s)

    async def _tick(self, give: bool) -> None:
        progress = self.now(self.batch.progress)
        if give:
            self._give(progress)
        batch = self.batch
        try:
            # The rows are made before the first await: the same moment as ``progress``.
            await batch.threads.call(
                batch.store.publish_live, batch.owner, publish.rows(batch, progress)
            )
            self._published = True
        except StoreUnavailable as e:
            # The batch's own store calls meet the outage and decide; status only
            # misses a few seconds.
            log.warning("status rows of %s not written: %s", batch.partition, e)

    def _batch_progress(self, progress: Progress) -> None:
        """A job ended: its progress with the reasons and running prompts of now, and
        the last estimate (less the time since), made anew at most every ``REFRESH_S``
        so a batch of short prompts does not pay for an estimate per job."""
        at = time.monotonic()
        last = self._last
        if last is None or at - self._last_at >= REFRESH_S or not progress.remaining:
            self._last, self._last_at = self.now(progress), at
            self._give(self._last)
            return
        estimate = last.estimate_s
        if estimate is not None:
            estimate = max(estimate - (at - self._last_at), 0.0)
        self._give(dataclasses.replace(self.look(progress)[0], estimate_s=estimate))

    def _give(self, progress: Progress) -> None:
        for watch in watchers:
            watch(self, progress)
        self.on_progress(progress)

    def _prompt_ended(self, slot: Slot, seconds: float) -> None:
        # Its attempt is still ours (downloads and the record follow the prompt's end).
        attempts = list(self.batch.attempts.values())
        job = next((a.job for a in attempts if a.job.prompt_id == slot.prompt_id), None)
        if job is not None:
            workflow = self._needs(job)
            load_s = self.batch.pool.plan.estimates.load_s
            self.estimator.prompt_ended(workflow, seconds, slot.load_expected, load_s)

    def look(self, progress: Progress) -> tuple[Progress, list[Running]]:
        """``progress`` with the reasons and the running prompts of now (one moment: no
        await), and those prompts for the estimate. Cheap: a look at the servers, the
        jobs waiting out a delay and counts."""
        batch = self.batch
        loop_now = asyncio.get_running_loop().time()
        running: list[Running] = []
        lines: list[str] = []
        prompts = batch.prompts()
        for name, attempt in sorted(prompts.items()):
            job, slot = attempt.job, attempt.slot
            assert slot is not None  # held: ``Batch.prompts``
            workflow = self._needs(job)
            posted = slot.posted_at
            running.append(Running(workflow, 0.0 if posted is None else loop_now - posted))
            lines.append(
                f"job {job.id[:8]} on {name}: {publish.prompt_progress(batch, name, attempt)}"
            )
        counts = dict.fromkeys(REASONS, 0)
        counts[RENDERING] = len(prompts)
        # An attempt whose server was let go downloads and records; one without a server
        # yet (a catch-up waiting for its previous server) waits for a server.
        counts[FINISHING] = len(batch.settling) + sum(
            1 for a in list(batch.attempts.values()) if a.slot is not None and a.slot.released
        )
        for item, _ in batch.queue.later():
            counts[FOR_A_CLAIM if item.job.id in batch.admission.told_held else IN_BACKOFF] += 1
        counts[FOR_UPSTREAM] = len(batch.chain.parked)
        # The rest: in line, or on their way to a server (being claimed, their server
        # just handed over); of those, the ones done before the batch started are only
        # checked (each done job resolved so far counts as one of them); once the batch
        # stopped submitting, none goes to a server any more.
        rest = max(progress.remaining - sum(counts.values()), 0)
        if batch.stopped:
            for why in (FOR_UPSTREAM, IN_BACKOFF, FOR_A_CLAIM):
                rest, counts[why] = rest + counts[why], 0
            counts[STOPPED] = rest
        else:
            counts[DONE_BEFORE] = min(max(self.done_before - progress.done, 0), rest)
            counts[FOR_A_SERVER] = rest - counts[DONE_BEFORE]
        looked = dataclasses.replace(
            progress,
            elapsed_s=max(time.monotonic() - batch.started, progress.elapsed_s),
            waiting=tuple((why, n) for why, n in counts.items() if n),
            running=tuple(lines),
        )
        return looked, running

    def now(self, progress: Progress) -> Progress:
        """``progress`` with the estimate, the reasons and the running prompts of now."""
        batch, pool = self.batch, self.batch.pool
        looked, running = self.look(progress)
        # The queue's groups are the workflows (``Needs``): counted per group, not per job.
        waiting: dict[Hashable, int] = {g: d.count for g, d in batch.queue.demand().items()}
        for item, _ in batch.queue.later():
            self._count(waiting, item)
        for item in list(batch.chain.parked.values()):
            self._count(waiting, item)
        feeding = batch.feeding
        if feeding is not None and waiting and feeding.fed < batch.total:
            # Jobs of the file not read yet: counted with the group most of those read are.
            most = max(waiting, key=waiting.__getitem__)
            waiting[most] += batch.total - feeding.fed
        usable = max(len(pool.servers) - len(pool.unreachable()), 1)
        plan = pool.plan
        # A workflow no server holds costs a load before its first job (plan.py).
        loads = sum(
            1
            for workflow in waiting
            if isinstance(workflow, Needs)
            and models_of(workflow)
            and not any(plan.fits(s, workflow) for s in plan.servers)
        )
        estimate = self.estimator.left_s(waiting, running, usable, loads, plan.estimates.load_s)
        return dataclasses.replace(looked, estimate_s=estimate)

    def _count(self, waiting: dict[Hashable, int], item: Item) -> None:
        workflow = self._needs(item.job)
        waiting[workflow] = waiting.get(workflow, 0) + 1

    def _needs(self, job: Job) -> Hashable:
        """The group of ``job`` for the estimate: its workflow's needs of a server."""
        return self.batch.queue.needs(Item(job))


# The Dagster run tag the QueuedRunCoordinator orders its queue by (an integer as a
# string): the batch's priority when set.
PRIORITY_TAG = "dagster/priority"


def run_priority(tags: Mapping[str, str]) -> int | None:
    """The priority a run's ``dagster/priority`` tag gives (None: not set, or not an
    integer, which Dagster's queue also reads as unset)."""
    text = tags.get(PRIORITY_TAG)
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if is_priority(value) else None
