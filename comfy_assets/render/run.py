"""Running a batch: the pool, the policy and the summary around ``Batch`` (``run_batch``),
for sync callers (``run_batch_sync``: Dagster, the CLI), and one queued job (``run_one``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict, Unpack

from comfy_assets.comfy.event_loop import new_event_loop
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import Job, JobFile
from comfy_assets.jobs.states import DONE, FAILED_FATAL
from comfy_assets.jobs.stream import JobScan
from comfy_assets.pool.pool import Pool
from comfy_assets.render.batch import Batch
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.owners import OwnerHeartbeat, new_owner
from comfy_assets.render.progress import Progress
from comfy_assets.render.steering import Steering
from comfy_assets.render.summary import BatchSummary, summarize, summarize_file
from comfy_assets.store import JobRecord, Store, off_loop

log = logging.getLogger("comfy_assets.render.run")

# What ``run_one`` answers for a job the store holds under another prompt (a newer take).
SUPERSEDED: Literal["superseded"] = "superseded"

# The jobs neither done nor dead-lettered a summary of a file read a chunk at a time names.
NAMED = 5

# Called with each pool made here and its store (the metrics: ``metrics.py``).
pool_watchers: list[Callable[[Pool, Store], None]] = []


def make_pool(servers: Sequence[ServerSpec], store: Store, config: BatchConfig, owner: str) -> Pool:
    """The pool of ``servers`` with the leases, probes and polls of ``config``; its lease
    calls live through a failing store for as long as the store's own calls do."""
    pool = Pool(servers, store, owner=owner, settings=config, store_timeout_s=store.retry_s)
    for watch in pool_watchers:
        watch(pool, store)
    return pool


def resolve_policy(job_file: JobFile | JobScan, config: BatchConfig) -> tuple[bool, bool]:
    """(stop_on_fatal, draft) for a job file: the run config wins over the file header.

    Only a storyboard (a file whose jobs have ``shot``) stops at its first fatal failure
    under ``delivery``; an image batch renders every job and dead-letters the failures.
    """
    mode = config.policy or job_file.policy
    if isinstance(job_file, JobScan):
        storyboard = job_file.storyboard
    else:
        storyboard = any(j.shot is not None for j in job_file.jobs)
    return (mode == "delivery" and storyboard), mode == "draft"


class BatchArguments(TypedDict):
    """``run_batch``'s keyword arguments, for ``run_batch_sync`` to pass on."""

    partition: str
    servers: Sequence[ServerSpec]
    store: Store
    config: BatchConfig
    owner: NotRequired[str | None]
    run_id: NotRequired[str | None]
    on_line: NotRequired[Callable[[str], None] | None]
    on_progress: NotRequired[Callable[[Progress], None] | None]
    priority: NotRequired[int | None]


async def run_batch(
    job_file: JobFile | JobScan,
    *,
    partition: str,
    servers: Sequence[ServerSpec],
    store: Store,
    config: BatchConfig,
    owner: str | None = None,
    run_id: str | None = None,
    on_line: Callable[[str], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    priority: int | None = None,
) -> BatchSummary:
    """Register the jobs of ``job_file`` as ``partition`` and run them all over a pool of
    ``servers``; returns the summary. A ``JobScan`` (a file validated, its jobs not held)
    is registered and run a chunk at a time (``render/feed.py``), after a check that none
    of its ids is another partition's (PartitionConflict, before anything is posted). ``priority``: the batch's among those sharing the
    servers (higher first; None: the file header's, default 0: ``pool/priority.py``). Raises only on cancellation (after cleaning up:
    prompts interrupted and removed, claims and server leases released).

    Without an ``owner``, the batch is a new owner with a heartbeat in the store
    (``OwnerHeartbeat``, naming ``run_id``, the Dagster run, if any): found gone by
    another process, this process exits 1 at once (``owners.stop_process``). A given
    ``owner`` is the caller's to keep alive (or an owner without a heartbeat, whose
    claims are taken over only when their lease expires)."""
    heartbeat = None
    if owner is None:
        owner = new_owner()
        heartbeat = OwnerHeartbeat(store, owner, run_id=run_id)
        await off_loop(store, heartbeat.start)
    try:
        return await _run_batch(
            job_file,
            partition,
            servers,
            store,
            config,
            owner,
            heartbeat,
            on_line,
            on_progress,
            job_file.header.priority if priority is None else priority,
        )
    finally:
        if heartbeat is not None:
            await off_loop(store, heartbeat.stop)


async def _run_batch(
    job_file: JobFile | JobScan,
    partition: str,
    servers: Sequence[ServerSpec],
    store: Store,
    config: BatchConfig,
    owner: str,
    heartbeat: OwnerHeartbeat | None,
    on_line: Callable[[str], None] | None,
    on_progress: Callable[[Progress], None] | None,
    priority: int,
) -> BatchSummary:
    started = time.monotonic()
    # Store calls here wait out a database outage off the event loop (``off_loop``).
    if isinstance(job_file, JobScan):
        feed: JobScan | None = job_file
        jobs: list[Job] = []
        await off_loop(store, store.check_partition, partition, job_file.job_ids())
        job_ids: list[str] = []
    else:
        feed, jobs, job_ids = None, job_file.jobs, [j.id for j in job_file.jobs]
        await off_loop(store, store.register_jobs, partition, jobs)
    counts = await off_loop(store, store.counts, partition)
    stop_on_fatal, draft = resolve_policy(job_file, config)
    async with make_pool(servers, store, config, owner) as pool:
        pool.priority = priority
        batch = Batch(
            jobs,
            partition=partition,
            pool=pool,
            store=store,
            config=config,
            owner=owner,
            stop_on_fatal=stop_on_fatal,
            draft=draft,
            on_line=on_line,
            heartbeat=heartbeat,
            feed=feed,
        )
        await _steered(batch, on_progress, sum(counts[state] for state in DONE))
    if isinstance(job_file, JobScan):
        summary = await off_loop(
            store,
            summarize_file,
            store,
            partition,
            time.monotonic() - started,
            batch.stopped,
            pool.unreachable(),
            job_file.job_ids(),
            NAMED,
        )
    else:
        summary = await off_loop(
            store,
            summarize,
            store,
            partition,
            time.monotonic() - started,
            batch.stopped,
            pool.unreachable(),
            job_ids=job_ids,
        )
    summary.no_server = batch.no_server
    return summary


async def _steered(
    batch: Batch, on_progress: Callable[[Progress], None] | None, done_before: int = 0
) -> None:
    """Run ``batch``; ``on_progress`` gets its progress with the estimate, the reasons
    and the running prompts, at each job's end and every few seconds, and the store what
    ``comfy-assets status`` shows (``steering.py``). ``done_before``: its jobs the store
    had done at its start."""
    steering = Steering(batch, on_progress or _ignore, done_before=done_before)
    ticks = asyncio.create_task(steering.run(), name="progress")
    try:
        await batch.run()
    finally:
        ticks.cancel()
        (failed,) = await asyncio.gather(ticks, return_exceptions=True)
        steering.close()
        if isinstance(failed, Exception):
            # The progress lines stopped, the batch did not: said loudly, not raised.
            log.error("progress reporting of %s failed", batch.partition, exc_info=failed)


def _ignore(progress: Progress) -> None:
    """An ``on_progress`` that shows nothing."""


def run_batch_sync(
    job_file: JobFile | JobScan, **arguments: Unpack[BatchArguments]
) -> BatchSummary:
    """``run_batch`` for sync callers (Dagster, the CLI); blocks until it ends.

    The event loop runs in a thread of its own while the calling thread waits for it to
    end. A BaseException raised in the calling thread (Dagster turns a cancel into
    DagsterExecutionInterruptedError in the main thread; Ctrl+C) then cancels the batch
    from outside, waits for its cleanup (prompts interrupted and removed from the queue,
    claims and server leases released) and re-raises. Raised inside a loop step instead,
    asyncio would store it in whichever task was running and the cleanup would not run.
    ``on_line`` and ``on_progress`` are called on that thread, not the caller's.
    """
    loop = new_event_loop()
    task = loop.create_task(run_batch(job_file, **arguments))
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def drive() -> None:
        asyncio.set_event_loop(loop)
        try:
            outcome["value"] = loop.run_until_complete(task)
        except BaseException as e:  # handed to the calling thread below
            outcome["error"] = e
        finally:
            _cancel_left(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            finished.set()

    threading.Thread(target=drive, name=f"batch-{arguments['partition']}", daemon=True).start()
    try:
        # Wait in short steps on an Event, not Thread.join(): a simulated signal (Dagster's
        # interrupt_main) runs its handler only when the main thread wakes, and a join()
        # interrupted by an exception marks a running thread as stopped (CPython < 3.13).
        while not finished.wait(0.2):
            pass
    except BaseException:
        loop.call_soon_threadsafe(task.cancel)
        while not finished.wait(0.2):  # in steps too: a signal meanwhile is handled now
            pass
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _cancel_left(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks still pending on ``loop`` and let them finish, as ``asyncio.run``
    does: a task left there is destroyed with the closed loop, and its cleanup (a socket
    reader's, say) then prints a traceback at exit."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


How = Literal[
    "done", "done_before", "dead_lettered", "dead_before", "superseded", "left_to_holder", "left"
]


@dataclass(frozen=True)
class JobEnding:
    """How one ``run_one`` call ended its job.

    ``how``: ``done`` (this call wrote its done record: succeeded or degraded),
    ``done_before`` (done already, or finished meanwhile by a twin delivery: nothing
    posted), ``dead_lettered`` (this call wrote its dead letter: exactly one run ever
    does, ``Store.dead_letter`` taking it only from the claim's holder, once),
    ``dead_before`` (a dead letter already), ``superseded`` (the store holds the job under
    another prompt), ``left_to_holder`` (its claim taken while it ran: the holder finishes
    it), ``left`` (not run to an end here: every server that can run it quarantined, or
    the run stopped). ``state``: the job's state in the store afterwards (``pending`` for
    a job it does not hold); ``record``: its record then, if any.
    """

    how: How
    state: str
    record: JobRecord | None = None


async def run_one(
    job: Job,
    *,
    partition: str,
    pool: Pool,
    store: Store,
    config: BatchConfig,
    owner: str,
    on_line: Callable[[str], None] | None = None,
    heartbeat: OwnerHeartbeat | None = None,
    running: set[Batch] | None = None,
) -> JobEnding:
    """Run one job (a message from a queue) to its end over a long-lived ``pool``.

    Returns how it ended (``JobEnding``): done (``succeeded``/``degraded``, by this call
    or before it: then nothing is posted), a dead letter (``failed_fatal``, with its reason
    in the store), superseded, left to another holder, or left pending; while another
    live worker holds its claim it waits. Retries with backoff happen inside; nothing is
    posted while ``heartbeat`` (``owner``'s, kept by the caller) is stale. ``running``:
    where its batch is while it runs (the caller's status rows name its prompt:
    ``publish.publish_servers``). Raises only on cancellation, after cleaning up.

    ``superseded`` (``SUPERSEDED``) when the store holds the job under another prompt: a
    newer take was registered before this one (nothing is registered or posted), or the
    job was registered again while this call waited or ran (a newer take, other inputs:
    the run that registered it renders it; this one's attempt, if any, could record
    nothing).
    """
    # A job new to the store is registered claimed: its claim costs no call of its own.
    found, claimed = await off_loop(
        store, store.register_claimed, partition, job, owner, config.lease_s
    )
    if found.superseded:
        return JobEnding(SUPERSEDED, "pending")
    batch = Batch(
        [job],
        partition=partition,
        pool=pool,
        store=store,
        config=config,
        owner=owner,
        draft=config.policy == "draft",
        on_line=on_line,
        consumers=1,
        heartbeat=heartbeat,
    )
    if claimed is not None:
        batch.claims.adopt(job.id, claimed)
    if running is not None:
        running.add(batch)
    try:
        await batch.run()
    finally:
        if running is not None:
            running.discard(batch)
    written = batch.settler.done.get(job.id)
    if written is not None:
        # Its done record is this call's: no read needed to say how it ended.
        return JobEnding("done", written)
    rec = await off_loop(store, store.get, job.id)
    if rec is None:
        return JobEnding("left", "pending")
    if rec.prompt_id != job.prompt_id:
        return JobEnding(SUPERSEDED, rec.state, rec)
    wrote = job.id in batch.settler.wrote
    if rec.state in DONE:
        return JobEnding("done" if wrote else "done_before", rec.state, rec)
    if rec.state == FAILED_FATAL:
        return JobEnding("dead_lettered" if wrote else "dead_before", rec.state, rec)
    if rec.claimed_by is not None and rec.claimed_by != owner:
        return JobEnding("left_to_holder", rec.state, rec)
    return JobEnding("left", rec.state, rec)
