"""Many jobs over the pool: claims, attempts, retries with backoff, the state machine.

Used by the Dagster asset, ``comfy-assets run`` and the RabbitMQ worker alike.

Two consumer loops per server: a loop takes the next job and claims it, then waits for
a server, so a server handed over at the end of a prompt goes straight to the next POST
(among free servers the job's previous server and model count; a server our prompt just
left goes to the next consumer in line whatever its job); a loop that still holds a
server takes the waiting job that fits it best. A job waiting for its backoff delay holds
its claim but no server. Every state change goes through the store (an event row and a
JSON log line); people get one log line per decision, in the shape of STYLE.md. With
PostgreSQL the batch's own store calls (claims, transitions, done records) run on worker
threads, so their network round trips don't stall the event loop that reads every
server's socket; the pool's lease calls stay on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ParamSpec, TypeVar

from comfy_assets.backoff import RetryPolicy
from comfy_assets.comfy.download import MAX_OUTPUT_BYTES
from comfy_assets.comfy.errors import NoServerReachable
from comfy_assets.comfy.pool import Pool, Slot
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobfile import Job, JobFile
from comfy_assets.runner import Attempt, AttemptHooks, AttemptResult, NotPosted
from comfy_assets.states import InvalidTransition
from comfy_assets.store import AttemptEntry, ClaimLost, JobRecord, Store, StoreUnavailable

log = logging.getLogger("comfy_assets.batch")

P = ParamSpec("P")
R = TypeVar("R")
# Worker threads for a networked store (PostgreSQL): two, so one call can wait on the
# network while another runs; more only adds GIL contention (bench/throughput.py on
# PostgreSQL, 2,000 jobs: 1 thread 67.7, 2 threads 74.8, 4 threads 66.6 jobs/s).
STORE_THREADS = 2


@dataclass
class BatchConfig:
    """Knobs of a batch (seconds everywhere). ``policy``: None follows the job file's
    header; "delivery" stops submitting a storyboard's shots at its first fatal failure;
    "draft" turns permanent failures (and failed optional shots) into ``degraded``.
    ``catch_up_s``: how long a job's previous server is asked again before the job is
    posted elsewhere (``runner.Attempt``). ``unreachable_timeout_s``: with no server
    reachable for this long the batch stops, its unrun jobs left pending (None: wait for
    ever, as the worker service does). ``max_output_bytes``: the most one output file may
    have (bytes); a larger one is a permanent failure."""

    attempts: int = 4
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0
    jitter: bool = True
    timeout_s: float = 600.0
    poll_s: float = 1.0
    lease_s: float = 3600.0
    server_lease_s: float = 30.0
    max_queue: int | None = None
    probe_timeout_s: float = 3.0
    unhealthy_wait_s: float = 5.0
    catch_up_s: float = 60.0
    unreachable_timeout_s: float | None = 600.0
    policy: str | None = None
    max_output_bytes: int = MAX_OUTPUT_BYTES

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.attempts,
            base_delay_s=self.base_delay_s,
            max_delay_s=self.max_delay_s,
            jitter=self.jitter,
            timeout_s=self.timeout_s,
        )


@dataclass
class BatchSummary:
    """What a batch came to. ``dead_letters``: (job_id, reason) pairs."""

    partition: str
    counts: dict[str, int]
    done: int
    dead_lettered: int
    dead_letters: list[tuple[str, str]]
    jobs: list
    gpu_seconds: float
    seconds: float
    stopped: str | None = None
    unreachable: dict[str, str] = field(default_factory=dict)
    no_server: bool = False  # stopped because no server was reachable (worth a retry)

    def line(self) -> str:
        return f"summary: {self.done} done, {self.dead_lettered} dead-lettered"


def new_owner() -> str:
    """A claim/lease owner id naming this host and process: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_alive(owner: str) -> bool:
    """False only for an owner of this host whose process is gone (its claims need not
    wait for their lease); True when unsure (another host, or an id of another shape)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.split(":", 1)[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def outputs_problem(store: Store, partition: str, job_id: str) -> str | None:
    """None when every recorded output of a done job is on disk with its recorded size;
    else what is wrong ("missing: a.png", "changed: b.png"). Sizes, not hashes: cheap
    enough to check at every run."""
    job_dir = store.job_dir(partition, job_id)
    for f in store.files(job_id):
        path = job_dir / f.path
        if not path.is_file():
            return f"missing: {f.path}"
        if path.stat().st_size != f.bytes:
            return f"changed: {f.path} ({path.stat().st_size} bytes, recorded {f.bytes})"
    return None


def remove_stale_outputs(job_dir: Path, keep: Sequence[object]) -> None:
    """Delete files in a job's folder that its new outputs don't include (those of its
    inputs before an edit), so the folder holds what the store says it holds."""
    wanted = {str(getattr(f, "path", "")) for f in keep}
    if not job_dir.is_dir():
        return
    for path in job_dir.rglob("*"):
        if path.is_file() and path.relative_to(job_dir).as_posix() not in wanted:
            path.unlink()


@dataclass
class _Item:
    job: Job
    prev_server: str | None = None
    attempts_before: int = 0  # the job's tries before its last requeue (store)
    fresh: bool = False  # its outputs are gone from the server: render anew


class _JobQueue:
    """Jobs ready to run, and jobs waiting for a delay (backoff, someone else's claim)."""

    def __init__(self) -> None:
        self.ready: deque[_Item] = deque()
        self.changed = asyncio.Event()
        self._timers: set[asyncio.TimerHandle] = set()

    def push(self, item: _Item) -> None:
        self.ready.append(item)
        self.changed.set()

    def push_later(self, item: _Item, delay_s: float) -> None:
        """Put ``item`` back after ``delay_s`` seconds, at the head of the line: it has
        waited longest."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(handle)
            self.ready.appendleft(item)
            self.changed.set()

        handle = loop.call_later(delay_s, fire)
        self._timers.add(handle)

    @property
    def waiting(self) -> int:
        return len(self._timers)

    def pop_for(self, slot: Slot) -> _Item | None:
        """The best job for this server: its own previous server, else the model the
        server last ran (looking a little ahead), else the first in line."""
        if not self.ready:
            return None
        last = slot.pool.last_model.get(slot.name)
        for i, item in enumerate(list(self.ready)[:64]):
            if item.prev_server == slot.name or (last and last in item.job.models):
                del self.ready[i]
                return item
        return self.ready.popleft()

    def cancel_all(self) -> list[_Item]:
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        items = list(self.ready)
        self.ready.clear()
        return items


class Batch:
    """Runs ``jobs`` of ``partition`` to the end over ``pool``, recording in ``store``."""

    def __init__(
        self,
        jobs: Sequence[Job],
        *,
        partition: str,
        pool: Pool,
        store: Store,
        config: BatchConfig,
        owner: str,
        stop_on_fatal: bool = False,
        draft: bool = False,
        on_line: Callable[[str], None] | None = None,
        consumers: int | None = None,
    ) -> None:
        self.jobs = list(jobs)
        # Twice the servers: a server freed at execution_success (while its previous job
        # still downloads) finds a consumer waiting for it instead of sitting idle.
        self.consumers = consumers or 2 * len(pool.servers)
        self.partition = partition
        self.pool = pool
        self.store = store
        self.config = config
        self.owner = owner
        self.stop_on_fatal = stop_on_fatal
        self.draft = draft
        self.on_line = on_line or log.info
        self.queue = _JobQueue()
        self.unresolved = len(self.jobs)
        self.claimed: set[str] = set()
        self.told_held: set[str] = set()  # jobs whose "claimed by another" line was said
        self.stopped: str | None = None
        self.no_server = False
        self.attempts: dict[str, Attempt] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the consumer running each attempt
        # Epoch time until which each claim of ours stands for sure (the store said so).
        self.claim_until: dict[str, float] = {}
        # Jobs whose final record is being written: no longer renewed, released at the end.
        self.finishing: set[str] = set()
        self.finished = asyncio.Event()  # every job resolved, or stopped with none in flight
        # SQLite is a local file: a call costs less than a hop to a thread and back.
        self._store_threads = (
            ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="store")
            if store.dialect == "postgresql"
            else None
        )
        # Store calls under way on those threads: a cancelled await does not stop one,
        # so cleanup waits for them before it reads or releases anything.
        self._in_flight: set[concurrent.futures.Future[object]] = set()
        self.claiming: set[str] = set()  # claims asked for and not yet answered

    async def _db(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` (a store call): on a worker thread for PostgreSQL,
        inline for SQLite. Raises what ``fn`` raises."""
        if self._store_threads is None:
            return fn(*args, **kwargs)
        future = self._store_threads.submit(functools.partial(fn, *args, **kwargs))
        self._in_flight.add(future)  # type: ignore[arg-type]
        future.add_done_callback(self._in_flight.discard)  # type: ignore[arg-type]
        return await asyncio.wrap_future(future)

    async def _landed(self) -> None:
        """Wait until every store call under way on a worker thread has finished."""
        if self._in_flight:
            pending = [asyncio.wrap_future(f) for f in list(self._in_flight)]
            await asyncio.gather(*pending, return_exceptions=True)

    def say(self, text: str) -> None:
        self.on_line(text)

    async def run(self) -> None:
        """Run every job to done, dead letter, or (delivery stop) left pending."""
        if not self.jobs:
            return
        for job in self.jobs:
            self.queue.push(_Item(job))
        self.pool.lost_listeners.append(self._on_lost_slot)
        heartbeat = asyncio.create_task(self._heartbeat(), name="claim-heartbeat")
        workers = [
            asyncio.create_task(self._consumer(), name=f"consumer-{i}")
            for i in range(self.consumers)
        ]
        try:
            await asyncio.gather(*workers)
        except asyncio.CancelledError:
            # gather has cancelled each consumer once; a second cancel would cut short
            # their cleanup (interrupting and removing prompts), so wait for it instead.
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            self.pool.lost_listeners.remove(self._on_lost_slot)
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self._landed()  # a claim that lands now must be released below
            left = [item.job.id for item in self.queue.cancel_all()]
            self._release_claims([*left, *self.claimed, *self.claiming, *self.finishing])
            if self._store_threads is not None:
                self._store_threads.shutdown(wait=False)  # nothing is under way any more

    def _resolve(self) -> None:
        self.unresolved -= 1
        self._check_finished()

    def _check_finished(self) -> None:
        if self.unresolved <= 0 or (self.stopped and not self.attempts):
            self.finished.set()
            self.pool.wake()  # a consumer waiting for a server sees it is over
        self.queue.changed.set()

    async def _acquire(self, head: _Item) -> Slot | None:
        """A free server for ``head``'s kind of job, or None once the batch is finished
        (a consumer must not wait forever for a server when nothing is left to run)."""
        slot = await self.pool.acquire_until(
            self.finished, prefer=head.prev_server, models=head.job.models
        )
        if slot is not None and self.finished.is_set():
            slot.release()
            return None
        return slot

    async def _consumer(self) -> None:
        slot: Slot | None = None
        try:
            while not self.finished.is_set() and not self.stopped:
                if not self.queue.ready:
                    if slot is not None:
                        slot.release()
                        slot = None
                    self.queue.changed.clear()
                    await self.queue.changed.wait()
                    continue
                held = slot is not None and not slot.released
                item = self.queue.pop_for(slot) if held else self.queue.ready.popleft()
                if item is None:
                    continue
                # The job is claimed before we wait for a server, so a server handed to
                # us goes straight to the submit and the POST: one store write less
                # between two prompts on a GPU.
                rec = await self._claim(item)
                if rec is None:
                    continue
                try:
                    if (slot is None or slot.released) and not self.stopped:
                        slot = await self._acquire(item)
                    if slot is None or self.stopped:
                        # Stopped (delivery policy) while we claimed or waited: the job
                        # stays pending, unposted.
                        self._release_claim(item.job.id)
                        break
                    slot = await self._run_item(item, rec, slot)
                except NoServerReachable as e:
                    self._release_claim(item.job.id)  # unposted: it stays pending
                    self._stop_unreachable(e)
                    break
        finally:
            if slot is not None:
                slot.release()
            self.queue.changed.set()  # wake the other consumers to see the end

    async def _claim(self, item: _Item) -> JobRecord | None:
        """Claim ``item``'s job; its record when it is ours to run, else None (done,
        dead-lettered, or held by another worker: then it is resolved or put back)."""
        job, cfg, store = item.job, self.config, self.store
        status, rec = await self._claim_job(job.id)
        if status == "done":
            problem = await self._db(outputs_problem, store, self.partition, job.id)
            if problem is None:
                self.say(f"job {job.id}: already done, nothing posted")
                self._resolve()
                return None
            # Done, but its files are gone or changed on disk: render it again, which
            # catches up from the server's /history first (downloads, no new prompt).
            try:
                await self._db(
                    store.transition, job.id, "pending", detail=f"outputs {problem}; fetching again"
                )
                self.say(f"job {job.id}: outputs {problem}; fetching them again")
            except InvalidTransition:
                pass  # another worker reopened it a moment ago: claim decides who fetches
            status, rec = await self._claim_job(job.id)
            if status == "done":  # and that worker has already fetched them
                self.say(f"job {job.id}: already done, nothing posted")
                self._resolve()
                return None
        if status == "dead_lettered":
            self.say(f"job {job.id}: dead-lettered earlier ({rec.reason}); requeue it to run again")
            self._resolve()
            return None
        if status == "held" and rec.claimed_by and not owner_alive(rec.claimed_by):
            holder = rec.claimed_by
            status, rec = await self._claim_job(job.id, dead_holder=holder)
            if status == "claimed":
                self.say(f"job {job.id}: claim of {holder} taken over (that process is gone)")
        if status == "held":
            if job.id not in self.told_held:
                self.told_held.add(job.id)
                until = time.strftime("%H:%M:%S", time.localtime(rec.claim_expires_at or 0))
                self.say(f"job {job.id}: claimed by {rec.claimed_by} until {until}; waiting")
            left = (rec.claim_expires_at or 0) - time.time()
            self.queue.push_later(item, min(max(left, cfg.poll_s / 4), cfg.poll_s))
            return None
        if rec.state in ("submitted", "rendering"):
            # The lost holder's attempt never settled: count it, so attempt numbers and
            # results.csv say how many times the job was tried.
            lost = AttemptEntry(
                rec.attempts_before + rec.attempts + 1,
                outcome="transient",
                server=rec.server,
                prompt_id=rec.prompt_id,
                number=rec.number,
                started_at=rec.updated_at,
                reason="its holder was lost mid-attempt",
            )
            await self._db(
                store.transition,
                job.id,
                "failed_retryable",
                detail="previous holder lost; claim taken over",
                attempt=rec.attempts + 1,
                server=rec.server,
                tried=lost,
            )
            rec = dataclasses.replace(rec, state="failed_retryable", attempts=rec.attempts + 1)
        if rec.state == "failed_retryable":
            await self._db(store.transition, job.id, "pending", detail="retry")
        return rec

    async def _claim_job(
        self, job_id: str, dead_holder: str | None = None
    ) -> tuple[str, JobRecord]:
        """``Store.claim_job`` for us; a claim taken is noted in ``claimed`` (renewed by
        the heartbeat, released at the end), one under way in ``claiming``."""
        # Kept in `claiming` if we are cancelled meanwhile: the claim may still land on
        # its worker thread, and the batch's cleanup releases it then.
        self.claiming.add(job_id)
        status, rec = await self._db(
            self.store.claim_job,
            job_id,
            self.owner,
            self.config.lease_s,
            dead_holder=dead_holder,
        )
        self.claiming.discard(job_id)
        if status == "claimed":
            self.claimed.add(job_id)
            self.claim_until[job_id] = rec.claim_expires_at or 0.0
        return status, rec

    async def _run_item(self, item: _Item, rec: JobRecord, slot: Slot) -> Slot | None:
        """Run one attempt of ``item`` (claimed: ``rec``) on ``slot`` or the server it
        catches up on; returns the slot if it is still ours."""
        job, cfg, store = item.job, self.config, self.store
        number = rec.attempts + 1
        item.attempts_before = rec.attempts_before
        prev = rec.server if rec.prompt_id == job.prompt_id else None

        async def submitted(server: str, detail: str | None) -> None:
            # With our owner: a claim lost while we waited (the job re-registered with
            # new inputs, say) raises ClaimLost here, before anything is posted.
            await self._db(
                store.transition,
                job.id,
                "submitted",
                owner=self.owner,
                from_state="pending",  # as _claim left it: one statement on PostgreSQL
                server=server,
                attempt=number,
                prompt_id=job.prompt_id,
                detail=detail,
            )

        async def rendering(server: str, n: int) -> None:
            await self._db(
                store.transition,
                job.id,
                "rendering",
                owner=self.owner,
                from_state="submitted",
                server=server,
                attempt=number,
                number=n,
            )

        hooks = AttemptHooks(submitted=submitted, rendering=rendering, stopped=lambda: self.stopped)
        attempt = Attempt(
            job,
            self.pool,
            store.job_dir(self.partition, job.id),
            slot=slot,
            prev_server=prev,
            prev_number=rec.number if prev is not None else None,
            deadline_s=cfg.timeout_s,
            poll_s=cfg.poll_s,
            catch_up_s=cfg.catch_up_s,
            fresh=item.fresh,
            hooks=hooks,
            label=f"job {job.id}",
            max_output_bytes=cfg.max_output_bytes,
        )
        me = asyncio.current_task()
        assert me is not None
        self.attempts[job.id] = attempt
        self._tasks[job.id] = me  # a lost server lease or claim cancels it (``_abort``)
        try:
            try:
                result = await attempt.run()
            finally:
                del self._tasks[job.id]  # from here on nothing cancels us for the attempt
        except asyncio.CancelledError:
            if attempt.aborted is None or me.cancelling() > 1:
                await asyncio.shield(self._cancelled(job, attempt, number, rec.attempts_before))
                raise
            me.uncancel()  # only the attempt was stopped, not the batch
            # The lease still keeps other processes away while our prompt is removed.
            what = await asyncio.shield(attempt.cancel_cleanup())
            await self._landed()  # a transition still being written lands first
            if attempt.claim_lost:
                await self._left_to_holder(job, attempt, number, attempt.aborted, what)
                return None
            result = attempt.aborted_result(what)
        except ClaimLost as e:
            what = await attempt.cancel_cleanup()  # our prompt, if posted, is stale: remove it
            await self._left_to_holder(job, attempt, number, f"claim lost ({e})", what)
            return None
        except NotPosted:
            self._release_claim(job.id)  # the batch stopped first: the job stays pending
            return None
        except NoServerReachable:
            self._release_claim(job.id)  # nothing posted: the job stays pending
            raise
        finally:
            self.attempts.pop(job.id, None)
        try:
            await self._settle(item, number, result)
        except ClaimLost as e:
            outcome = f"its result ({result.kind}) not recorded"
            await self._left_to_holder(job, attempt, number, f"claim lost ({e})", outcome)
        self._check_finished()
        kept = attempt.slot if attempt.slot is not None and not attempt.slot.released else None
        return kept

    def _stop_unreachable(self, e: NoServerReachable) -> None:
        if not self.stopped:
            self.no_server = True
            self.stopped = f"stopped: {e}; the jobs not done stay pending (run again)"
            self.say(self.stopped)
        self._check_finished()

    async def _left_to_holder(
        self, job: Job, attempt: Attempt, number: int, why: str, cleanup: str
    ) -> None:
        """The job's claim went to another worker while attempt ``number`` ran: say so
        (an event that changes nothing, and a line) and leave the job to its holder."""
        server = attempt.slot.name if attempt.slot is not None else None
        detail = f"{why} during attempt {number}; {cleanup}"
        await self._db(self.store.note, job.id, detail, server=server, attempt=number)
        self.claimed.discard(job.id)
        self.claim_until.pop(job.id, None)
        self.say(f"job {job.id}: {detail}; left to its holder")
        self._resolve()

    def _on_lost_slot(self, slot: Slot) -> None:
        """The pool lost the server lease of ``slot``: stop the attempt holding it (its
        prompt is removed while the lease still keeps other processes away)."""
        for job_id, attempt in self.attempts.items():
            if attempt.slot is slot:
                self._abort(job_id, f"server lease lost ({slot.lost})")

    def _abort(self, job_id: str, why: str, *, claim: bool = False) -> None:
        """Stop the running attempt of ``job_id`` from outside: its consumer is cancelled
        once, and ``_run_item`` tells that from a cancelled batch (``cancelling() == 1``
        with ``aborted`` set), cleans up and goes on; ``claim``: the job is no longer ours."""
        attempt, task = self.attempts.get(job_id), self._tasks.get(job_id)
        if attempt is None or task is None or attempt.aborted is not None:
            return
        attempt.aborted = why
        attempt.claim_lost = claim
        task.cancel()

    async def _cancelled(self, job: Job, attempt: Attempt, number: int, before: int) -> None:
        """The batch is cancelled during attempt ``number`` (``before``: the job's tries
        before its last requeue): remove our prompt, record the attempt, free the claim."""
        what = "cleanup did not finish"
        try:
            what = await attempt.cancel_cleanup()
        finally:
            try:
                await self._record_cancel(job, attempt, number, before, what)
                what += ", claim released"
            except StoreUnavailable as e:
                what += f"; neither recorded nor its claim released ({e})"
            self.say(f"job {job.id}: run cancelled, {what}")

    async def _record_cancel(
        self, job: Job, attempt: Attempt, number: int, before: int, what: str
    ) -> None:
        """Record the cancelled attempt (its job back to failed_retryable) and free the
        claim. Raises StoreUnavailable."""
        await self._landed()  # a `submitted` still being written lands first
        rec = await self._db(self.store.get, job.id)
        if rec is not None and rec.state in ("submitted", "rendering"):
            reason = f"run cancelled; {what}"
            tried = AttemptEntry(
                before + number,
                outcome="transient",
                server=rec.server,
                prompt_id=job.prompt_id,
                number=rec.number,
                seconds=time.monotonic() - attempt.started,
                reason=reason,
            )
            await self._db(
                self.store.transition,
                job.id,
                "failed_retryable",
                detail=reason,
                attempt=number,
                tried=tried,
            )
        self._release_claim(job.id)

    async def _settle(self, item: _Item, number: int, r: AttemptResult) -> None:
        job, store, cfg = item.job, self.store, self.config
        tried = AttemptEntry(  # written with the transition below, one transaction
            item.attempts_before + number,  # rows go on numbering after a requeue
            server=r.server,
            prompt_id=r.prompt_id,
            number=r.number,
            seconds=r.seconds,
            queue_wait_s=r.queue_wait_s,
            gpu_seconds=r.gpu_seconds,
            outcome=r.kind,
            reason=r.reason or None,
        )
        where = f" on {r.server}" if r.server else ""
        if r.kind == "success":
            remove_stale_outputs(store.job_dir(self.partition, job.id), r.files)
            self._finishing(job.id)
            await self._db(
                store.mark_done,
                job.id,
                self.owner,
                state="succeeded",
                files=r.files,
                server=r.server,
                attempt=number,
                number=r.number,
                tried=tried,
            )
            self.finishing.discard(job.id)
            how = "caught up, nothing posted" if r.caught_up else f"{len(r.files)} files"
            self.say(f"job {job.id} attempt {number}{where}: succeeded ({how})")
            self._resolve()
            return
        if r.kind == "transient" and number < cfg.attempts:
            await self._db(
                store.transition,
                job.id,
                "failed_retryable",
                server=r.server,
                attempt=number,
                detail=r.reason,
                tried=tried,
            )
            if self.stopped:  # no consumer takes it any more: the next run does
                self._release_claim(job.id)
                self.say(
                    f"job {job.id}: attempt {number} failed{where}, {r.reason}; not retried "
                    f"in this run ({self.stopped})"
                )
                self._resolve()
                return
            delay = cfg.retry.delay(number)
            self.say(
                f"job {job.id}: attempt {number} failed{where}, {r.reason}; "
                f"retry in {delay * 1000:.0f} ms, ahead of the jobs not yet tried"
            )
            again = _Item(job, prev_server=r.server, fresh=r.outputs_missing)
            self.queue.push_later(again, delay)
            return
        reason = (
            r.reason
            if r.kind == "permanent"
            else f"gave up after {number} attempts, last: {r.reason}"
        )
        self._finishing(job.id)
        if self.draft and (r.kind == "permanent" or job.optional):
            await self._db(
                store.mark_done,
                job.id,
                self.owner,
                state="degraded",
                files=[],
                server=r.server,
                attempt=number,
                reason=reason,
                tried=tried,
            )
            self.say(f"job {job.id}: degraded (draft), {reason}")
        else:
            await self._db(
                store.dead_letter,
                job.id,
                self.owner,
                reason,
                server=r.server,
                attempt=number,
                tried=tried,
            )
            self.say(f"job {job.id}: dead-lettered, {reason}")
            if self.stop_on_fatal and not self.stopped:
                self.stopped = f"stopped after the fatal failure of job {job.id}: {reason}"
                self.say(f"delivery policy: {self.stopped}; no new shots are submitted")
        self.finishing.discard(job.id)
        self._resolve()

    def _finishing(self, job_id: str) -> None:
        """The job's final record is about to be written, which drops its claim: the
        heartbeat must not take that for a lost claim."""
        self.claimed.discard(job_id)
        self.claim_until.pop(job_id, None)
        self.finishing.add(job_id)

    def _release_claims(self, job_ids: Sequence[str]) -> None:
        """Release our claims on ``job_ids`` at the end; with the store unreachable they
        are left to expire (each after its lease), which the log says."""
        for i, job_id in enumerate(job_ids):
            try:
                self._release_claim(job_id)
            except StoreUnavailable as e:
                log.warning(
                    "%d claims not released (%s); they expire within %.0f s",
                    len(job_ids) - i,
                    e,
                    self.config.lease_s,
                )
                return

    def _release_claim(self, job_id: str) -> None:
        self.claimed.discard(job_id)
        self.claim_until.pop(job_id, None)
        self.finishing.discard(job_id)
        self.store.release_claim(job_id, self.owner)

    async def _heartbeat(self) -> None:
        """Renew every claim we hold each third of ``lease_s``, so a long job never loses
        it; while the store fails, try again every thirtieth. A claim that another worker
        took, or that can't be renewed before only a third of it is left, is lost: its
        attempt is stopped (our prompt removed) and the job left to whoever holds it."""
        failing = False
        while True:
            await asyncio.sleep(self.config.lease_s / (30 if failing else 3))
            failing = False
            for job_id in list(self.claimed):
                failing = not await self._renew_claim(job_id) or failing

    async def _renew_claim(self, job_id: str) -> bool:
        """Renew one claim; False when the store failed and the claim still stands."""
        lease_s = self.config.lease_s
        asked_at = time.time()
        try:
            renewed = await self._db(self.store.renew_claim, job_id, self.owner, lease_s)
        except Exception as e:  # the store, whatever its driver: judged by the time left
            left = self.claim_until.get(job_id, asked_at) - asked_at
            why = f"{type(e).__name__}: {e}"
            if left > lease_s / 3:
                log.warning("job %s: claim not renewed (%s); %.0f s left", job_id, why, left)
                return False
            self._claim_gone(job_id, f"claim not renewed ({why}) and {left:.0f} s left")
            return True
        if job_id not in self.claimed:
            return True  # finished or released while we asked
        if renewed:
            self.claim_until[job_id] = asked_at + lease_s
        else:
            self._claim_gone(job_id, "claim taken by another worker")
        return True

    def _claim_gone(self, job_id: str, why: str) -> None:
        log.error("job %s: %s; its attempt is stopped", job_id, why)
        if job_id in self.attempts:
            self._abort(job_id, why, claim=True)
        else:
            # Waiting for a server or its retry: the next claim finds out who holds it.
            self.claimed.discard(job_id)
            self.claim_until.pop(job_id, None)


def make_pool(servers: Sequence[ServerSpec], store: Store, config: BatchConfig, owner: str) -> Pool:
    """The pool of ``servers`` with the leases, probes and polls of ``config``."""
    return Pool(
        servers,
        store,
        owner=owner,
        lease_s=config.server_lease_s,
        probe_timeout_s=config.probe_timeout_s,
        max_queue=config.max_queue,
        unhealthy_wait_s=config.unhealthy_wait_s,
        poll_s=config.poll_s,
        unreachable_timeout_s=config.unreachable_timeout_s,
    )


def resolve_policy(job_file: JobFile, config: BatchConfig) -> tuple[bool, bool]:
    """(stop_on_fatal, draft) for a job file: the run config wins over the file header.

    Only a storyboard (a file whose jobs have ``shot``) stops at its first fatal failure
    under ``delivery``; an image batch renders every job and dead-letters the failures.
    """
    mode = config.policy or job_file.policy
    storyboard = any(j.shot is not None for j in job_file.jobs)
    return (mode == "delivery" and storyboard), mode == "draft"


async def run_batch(
    job_file: JobFile,
    *,
    partition: str,
    servers: Sequence[ServerSpec],
    store: Store,
    config: BatchConfig,
    owner: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> BatchSummary:
    """Register the jobs of ``job_file`` as ``partition`` and run them all over a pool of
    ``servers``; returns the summary. Raises only on cancellation (after cleaning up:
    prompts interrupted and removed, claims and server leases released)."""
    started = time.monotonic()
    owner = owner or new_owner()
    store.register_jobs(partition, job_file.jobs)
    stop_on_fatal, draft = resolve_policy(job_file, config)
    async with make_pool(servers, store, config, owner) as pool:
        batch = Batch(
            job_file.jobs,
            partition=partition,
            pool=pool,
            store=store,
            config=config,
            owner=owner,
            stop_on_fatal=stop_on_fatal,
            draft=draft,
            on_line=on_line,
        )
        await batch.run()
    summary = summarize(
        store,
        partition,
        time.monotonic() - started,
        batch.stopped,
        pool.unreachable(),
        job_ids=[j.id for j in job_file.jobs],
    )
    summary.no_server = batch.no_server
    return summary


def summarize(
    store: Store,
    partition: str,
    seconds: float,
    stopped: str | None = None,
    unreachable: dict[str, str] | None = None,
    job_ids: Sequence[str] | None = None,
) -> BatchSummary:
    """The summary of a partition as the store has it now; with ``job_ids``, of those
    jobs only (a line deleted from the job file leaves its record, not its count)."""
    jobs = store.jobs(partition)
    if job_ids is not None:
        wanted = set(job_ids)
        jobs = [j for j in jobs if j.job_id in wanted]
    counts: dict[str, int] = {}
    for j in jobs:
        counts[str(j.state)] = counts.get(str(j.state), 0) + 1
    dead = [(j.job_id, j.reason or "") for j in jobs if j.state == "failed_fatal"]
    done = sum(1 for j in jobs if j.state in ("succeeded", "degraded"))
    gpu = sum(j.gpu_seconds or 0.0 for j in jobs)
    return BatchSummary(
        partition,
        counts,
        done,
        len(dead),
        dead,
        jobs,
        round(gpu, 3),
        round(seconds, 3),
        stopped,
        unreachable or {},
    )


def run_batch_sync(
    job_file: JobFile,
    *,
    partition: str,
    servers: Sequence[ServerSpec],
    store: Store,
    config: BatchConfig,
    owner: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> BatchSummary:
    """``run_batch`` for sync callers (Dagster, the CLI); blocks until it ends.

    The event loop runs in a thread of its own while the calling thread waits in
    ``join()``. A BaseException raised in the calling thread (Dagster turns a cancel into
    DagsterExecutionInterruptedError in the main thread; Ctrl+C) then cancels the batch
    from outside, waits for its cleanup (prompts interrupted and removed from the queue,
    claims and server leases released) and re-raises. Raised inside a loop step instead,
    asyncio would store it in whichever task was running and the cleanup would not run.
    """
    loop = asyncio.new_event_loop()
    task = loop.create_task(
        run_batch(
            job_file,
            partition=partition,
            servers=servers,
            store=store,
            config=config,
            owner=owner,
            on_line=on_line,
        )
    )
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def drive() -> None:
        asyncio.set_event_loop(loop)
        try:
            outcome["value"] = loop.run_until_complete(task)
        except BaseException as e:  # handed to the calling thread below
            outcome["error"] = e
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            finished.set()

    threading.Thread(target=drive, name=f"batch-{partition}", daemon=True).start()
    try:
        # Wait in short steps on an Event, not Thread.join(): a simulated signal (Dagster's
        # interrupt_main) runs its handler only when the main thread wakes, and a join()
        # interrupted by an exception marks a running thread as stopped (CPython < 3.13).
        while not finished.wait(0.2):
            pass
    except BaseException:
        loop.call_soon_threadsafe(task.cancel)
        finished.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


async def run_one(
    job: Job,
    *,
    partition: str,
    pool: Pool,
    store: Store,
    config: BatchConfig,
    owner: str,
    on_line: Callable[[str], None] | None = None,
) -> str:
    """Run one job (a message from a queue) to its end over a long-lived ``pool``.

    Returns the job's final state: ``succeeded``/``degraded`` (done, also when it was
    done before: nothing is posted), ``failed_fatal`` (dead letter, with its reason in
    the store); while another live worker holds its claim it waits. Retries with
    backoff happen inside. Raises only on cancellation, after cleaning up.
    """
    store.register_jobs(partition, [job])
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
    )
    await batch.run()
    rec = store.get(job.id)
    return rec.state if rec is not None else "pending"
