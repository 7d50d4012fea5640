"""Many jobs over the pool: claims, attempts, retries with backoff, the state machine.

Used by the Dagster asset, ``comfy-assets run`` and the RabbitMQ worker alike.

Three consumer loops per server: a loop takes the next job and claims it, then waits for
a server, so a server handed over at the end of a prompt goes straight to the next POST
(among free servers the job's previous server and model count; a server our prompt just
left goes to the next consumer in line whatever its job); a loop that still holds a
server takes the waiting job that fits it best. A job waiting for its backoff delay holds
its claim but no server. Every state change goes through the store (an event row and a
JSON log line); people get one log line per decision, in the shape of STYLE.md. The
batch's own store calls run on worker threads for PostgreSQL (``store_threads.py``); the
pool's lease calls stay on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from comfy_assets.comfy.errors import NoServerCanRun, NoServerReachable
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.stream import JobScan
from comfy_assets.pool.pool import Pool
from comfy_assets.pool.slot import Slot
from comfy_assets.render.admission import Admission
from comfy_assets.render.attempt import Attempt
from comfy_assets.render.blame import Blame
from comfy_assets.render.chain import Chain, Verdict
from comfy_assets.render.claim_keeping import Claims
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.feed import Feeding
from comfy_assets.render.outcome import CATCH_UP_AFTER, AttemptHooks, NotPosted
from comfy_assets.render.outputs import JobOutputs, take_folder
from comfy_assets.render.owners import OwnerHeartbeat
from comfy_assets.render.progress import Ended, Progress
from comfy_assets.render.queue import Item, JobQueue, prev_number
from comfy_assets.render.rendering import DeferredRendering
from comfy_assets.render.scope import BatchScope
from comfy_assets.render.settle import Settler
from comfy_assets.render.store_threads import StoreThreads
from comfy_assets.store import (
    ClaimLost,
    JobRecord,
    RenderingStart,
    Store,
    StoreUnavailable,
    Via,
)

log = logging.getLogger("comfy_assets.render.batch")

CONSUMERS_PER_SERVER = 3


class Batch:
    """Runs ``jobs`` of ``partition`` to the end over ``pool``, recording in ``store``.

    Made of parts, each given what it uses: ``threads`` (where store calls run),
    ``chain`` (chained jobs parked), ``claims`` (the claims held and renewed),
    ``admission`` (a job claimed and its record read), ``blame`` (whose failure it was),
    ``settler`` (an attempt's result decided and written), ``renderings`` (the move to
    rendering, deferred); the batch runs the consumers and the attempts."""

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
        on_progress: Callable[[Progress], None] | None = None,
        heartbeat: OwnerHeartbeat | None = None,
        feed: JobScan | None = None,
    ) -> None:
        self.jobs = list(jobs)
        # ``feed``: a job file whose jobs are taken (and registered) a chunk at a time.
        self.total = len(self.jobs) if feed is None else feed.count
        self.heartbeat = heartbeat  # of ``owner``: nothing is posted while it is stale
        # Three per server: one follows the prompt, one waits in line for the server, and
        # one may still be finishing the job before (downloads, the done record) when a
        # prompt shorter than that work ends: with two, the freed server would wait for it.
        self.consumers = consumers or CONSUMERS_PER_SERVER * len(pool.servers)
        self.partition = partition
        self.pool = pool
        self.store = store
        self.config = config
        self.owner = owner
        self.on_line = on_line or log.info
        self.on_progress = on_progress
        self.started = time.monotonic()
        self.progress = Progress(self.total)
        self.queue = JobQueue(pool.plan, pool.planned, pool)
        self.unresolved = self.total
        self.resolutions = 0  # jobs resolved so far (a parked job's check may miss one)
        self.stopped: str | None = None
        self.no_server = False
        self.attempts: dict[str, Attempt] = {}
        self.settling: set[str] = set()  # jobs whose attempt ended, its result being recorded
        # Jobs resolved other than done, and how: this batch does not take them up again
        # (a requeue while it runs is for the next run); ``status`` says so.
        self.let_go: dict[str, Ended] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the consumer running each attempt
        self.finished = asyncio.Event()  # every job resolved, or stopped with none in flight
        # Its parts, each given what it uses.
        self.threads = StoreThreads(store)
        self.chain = Chain(
            self.jobs, store=store, threads=self.threads, queue=self.queue, partition=partition
        )
        self.claims = Claims(store, owner, config.lease_s, self.threads.call, self._claim_gone)
        self.renderings = DeferredRendering(self._write_rendering, self._rendering_failed)
        self.blame = Blame(
            pool=pool,
            store=store,
            queue=self.queue,
            config=config,
            threads=self.threads,
            report=self.report,
        )
        scope = BatchScope(
            store=store,
            config=config,
            partition=partition,
            claims=self.claims,
            queue=self.queue,
            threads=self.threads,
            report=self.report,
            resolve=self._resolve,
        )
        self.admission = Admission(scope=scope, chain=self.chain)
        self.settler = Settler(
            scope=scope,
            owner=owner,
            renderings=self.renderings,
            blame=self.blame,
            stopped=lambda: self.stopped,
            stop=self._stop_fatal,
            draft=draft,
            stop_on_fatal=stop_on_fatal,
            keep_wrote=feed is None,
        )
        over = lambda: self.finished.is_set() or self.stopped is not None  # noqa: E731
        self.feeding = None if feed is None else Feeding(
            source=feed, store=store, partition=partition, queue=self.queue,
            resolved=lambda: self.resolutions, over=over, settle=self.admission.settle_ended,
        )  # fmt: skip

    def report(self, text: str) -> None:
        """One line for people (``on_line``), in the shape of STYLE.md."""
        self.on_line(text)

    async def run(self) -> None:
        """Run every job to done, dead letter, or (delivery stop) left pending."""
        if not self.total:
            return
        for job in self.jobs:
            item = Item(job)
            if job.depends_on:
                self.chain.park(item)  # a chained job waits for its upstream jobs
            else:
                self.queue.push(item)
        self.pool.lost_listeners.append(self._on_lost_slot)
        heartbeat = asyncio.create_task(self.claims.heartbeat(), name="claim-heartbeat")
        workers = [
            asyncio.create_task(self._consumer(), name=f"consumer-{i}")
            for i in range(self.consumers)
        ]
        if self.feeding is not None:
            workers.append(asyncio.create_task(self.feeding.run(), name="feeding"))
        if self.chain.parked:
            workers.append(
                asyncio.create_task(
                    self.chain.watch_parked(self.finished, lambda: self.stopped), name="parked"
                )
            )
        try:
            await asyncio.gather(*workers)
            if self.stopped and self.chain.dependants:
                await self.chain.settle_blocked_left(
                    self.admission.claim, self.settler.not_rendered
                )
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
            await self.threads.landed()  # a claim that lands now must be released below
            left = [item.job.id for item in self.queue.cancel_all()]
            self.claims.release_all(also=left)
            self.threads.close()  # nothing is under way any more

    def _resolve(self, ended: Ended = "not_run", job_id: str | None = None) -> None:
        self.unresolved -= 1
        self.resolutions += 1
        if job_id is not None:
            self.settling.discard(job_id)  # no longer left, so not finishing either
            if ended != "done":
                self.let_go[job_id] = ended
            self.chain.unpark(job_id)  # the jobs that continue from it look again
        counts = {"done": 0, "dead_lettered": 0, "not_run": 0}
        counts["done" if ended == "degraded" else ended] = 1
        p = self.progress
        self.progress = Progress(
            p.total,
            p.done + counts["done"],
            p.dead_lettered + counts["dead_lettered"],
            p.not_run + counts["not_run"],
            time.monotonic() - self.started,
        )
        if self.on_progress is not None:
            self.on_progress(self.progress)
        self._check_finished()

    def prompts(self) -> dict[str, Attempt]:
        """The attempts whose prompt is on a server now (posted, or being posted: the
        server held for it), by server: one per server at most. An attempt whose server
        was let go (its prompt ended: downloads and the result follow) is not here."""
        return {
            a.slot.name: a
            for a in list(self.attempts.values())
            if a.slot is not None and not a.slot.released
        }

    def _check_finished(self) -> None:
        if self.unresolved <= 0 or (self.stopped and not self.attempts):
            self.finished.set()
            self.pool.wake()  # a consumer waiting for a server sees it is over
        self.queue.changed.set()
        if self.feeding is not None:
            self.feeding.room.set()  # a job resolved: room for the next chunk, or the end

    async def _acquire(self) -> tuple[Slot | None, Item | None]:
        """A free server and the job the plan gives it (``render/queue.py``), or (None,
        None) once the batch is finished or no job claimed by us waits here any more (a
        consumer must not wait for a server with nothing to run, nor for jobs another
        process holds: that one may wait for the same server); the job is None when another
        consumer took the last of its group meanwhile. Raises NoServerCanRun when some
        job waiting here can run nowhere."""
        slot = await self.pool.acquire_until(
            self.finished,
            choose=self.queue.chooser(),
            check=self._unrunnable_group,
            gone=lambda: not self.queue.claimed,
        )
        if slot is not None and self.finished.is_set():
            slot.release()
            return None, None
        if slot is None:
            return None, None
        return slot, self.queue.pop_chosen(slot.name)

    async def _claim_ahead(self) -> None:
        """Claim the oldest job not claimed yet and leave it in the queue, unless as many
        are claimed as there are consumers; a job no server can run is dead-lettered at
        once, nothing posted."""
        if self.queue.claimed >= self.consumers:
            return
        item = self.queue.pop_unclaimed()
        if item is None:
            return
        rec = await self.admission.claim(item)
        if rec is None:
            return
        reason = await self.pool.cannot_run(self.queue.needs(item))
        if reason is not None:
            await self.settler.dead_letter_now(item, rec, reason)
            return
        self.queue.put_back(item, rec)

    def _unrunnable_group(self) -> str | None:
        """Why some job waiting here can run on no server now (or only on quarantined
        ones, for too long), else None (``check`` of ``Pool.acquire``, asked at each
        look)."""
        for group in self.queue.groups():
            reason = self.pool.cannot_run_now(group) or self.blame.quarantined_group(group)
            if reason is not None:
                return reason
        return None

    async def _dead_letter_unrunnable(self) -> None:
        """Dead-letter every job waiting here that no server can run now."""
        for group in self.queue.groups():
            reason = self.pool.cannot_run_now(group)
            if reason is None:
                continue
            for item in self.queue.pop_all(group):
                rec = await self.admission.claim(item)
                if rec is not None:
                    await self.settler.dead_letter_now(item, rec, reason)

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
                try:
                    if slot is None or slot.released:
                        # A job is claimed before we wait for a server and left in the
                        # queue, so a server handed to a consumer goes straight to the
                        # submit and the POST: one store write less between two prompts.
                        await self._claim_ahead()
                        if not self.queue.claimed or self.stopped:
                            # No job of ours waits here (those left are held by other
                            # processes and come back after a delay): waiting for a
                            # server would mark this batch, with its priority, as
                            # waiting, and keep the servers from the jobs' holders.
                            continue
                        slot, item = await self._acquire()
                        if slot is None:
                            continue  # the batch is finished, or nothing waits here
                    else:
                        item = self.queue.pop_for(slot)
                except NoServerCanRun:  # a server started again without a model
                    await self._dead_letter_unrunnable()
                    await self.settler.leave_quarantined()
                    continue
                except NoServerReachable as e:
                    self._stop_unreachable(e)  # the jobs here stay pending, unposted
                    break
                if item is None:
                    if slot is not None:  # nothing for it now (the plan keeps it for later)
                        slot.release()
                        slot = None
                    continue
                verdict, reason = await self._may_run(item)
                if verdict == "wait":
                    self.chain.park(item)
                    continue
                slot, go_on = await self._claim_and_run(item, slot, verdict, reason)
                if not go_on:
                    break
        finally:
            if slot is not None:
                slot.release()
            self.queue.changed.set()  # wake the other consumers to see the end

    async def _claim_and_run(
        self, item: Item, slot: Slot, verdict: Verdict, reason: str
    ) -> tuple[Slot | None, bool]:
        """Claim ``item`` (``verdict``: what its upstream jobs say) and run its attempt
        on ``slot``: the slot if still ours, and whether the consumer goes on (False once
        the batch stopped)."""
        rec = await self.admission.claim(item)
        if rec is None:
            return slot, True
        if verdict == "blocked":
            await self.settler.not_rendered(item, reason)
            return slot, True
        try:
            if self.stopped:
                # Stopped (delivery policy) while we claimed or waited: the job stays
                # pending, unposted.
                self.claims.release(item.job.id)
                return slot, False
            item.loaded_on = slot.name
            item.model_loaded = self.pool.assign(slot, self.queue.needs(item))
            return await self._run_item(item, rec, slot), True
        except NoServerReachable as e:
            self.claims.release(item.job.id)  # unposted: it stays pending
            self._stop_unreachable(e)
            return slot, False

    async def _may_run(self, item: Item) -> tuple[Verdict, str]:
        """Whether ``item``'s upstream jobs let it run now (``Chain.upstreams``), asked
        again when a job ended while we looked."""
        verdict: Verdict = "ready"
        reason = ""
        while item.job.depends_on:
            seen = self.resolutions
            verdict, reason = await self.chain.upstreams(item.job)
            if verdict != "wait" or self.resolutions == seen:
                break  # else a job ended while we looked: look again
        return verdict, reason

    async def _run_item(self, item: Item, rec: JobRecord, slot: Slot) -> Slot | None:
        """Run one attempt of ``item`` (claimed: ``rec``) on ``slot`` or the server it
        catches up on; returns the slot if it is still ours."""
        job, cfg, store = item.job, self.config, self.store
        attempt_number = rec.attempts + 1  # ours; ComfyUI's run `number` is another thing
        item.attempts_before = rec.attempts_before
        prev = rec.server if rec.prompt_id == job.prompt_id else None
        left = item.failed_on.get(prev or "")
        if left is not None and left.kind not in CATCH_UP_AFTER:
            # Its run there ended (failed, refused) or is stuck (wedged: the events say it
            # may render there too): nothing to catch up; the next attempt posts anew.
            prev = None

        async def submitted(server: str, detail: str | None) -> None:
            if job.take != 1:  # the events say which take they are about
                detail = f"take {job.take}" + (f"; {detail}" if detail else "")
            # With our owner: a claim lost while we waited (the job re-registered with
            # new inputs, say) raises ClaimLost here, before anything is posted.
            await self.threads.call(
                store.transition,
                job.id,
                "submitted",
                owner=self.owner,
                from_state="pending",  # as _claim left it: one statement on PostgreSQL
                via=Via(server=server, attempt=attempt_number),
                prompt_id=job.prompt_id,
                detail=detail,
            )

        async def rendering(server: str, n: int) -> None:
            # The store's clock, as every other event of the job is.
            at = store.now()
            self.renderings.defer(job.id, RenderingStart(server, attempt_number, n, at))

        hooks = AttemptHooks(
            submitted=submitted,
            rendering=rendering,
            stopped=lambda: self.stopped,
            unsure=self._unsure,
        )
        attempt = Attempt(
            job,
            self.pool,
            JobOutputs(store.file_store, self.partition, job.id),
            slot=slot,
            prev_server=prev,
            prev_number=prev_number(item, rec, prev),
            prev_unsettled=item.prev_unsettled and prev is not None,
            deadline_s=cfg.timeout_s,
            stall_s=self.blame.stall_s(item),
            wedge_s=cfg.wedge_s,
            poll_s=cfg.poll_s,
            catch_up_s=cfg.catch_up_s,
            fresh=item.fresh,
            hooks=hooks,
            label=f"job {job.id}",
            max_output_bytes=cfg.max_output_bytes,
            locate=self.chain.locate,
            subdir=take_folder(job.take),
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
                await asyncio.shield(
                    self.settler.cancelled(job, attempt, attempt_number, rec.attempts_before)
                )
                raise
            me.uncancel()  # only the attempt was stopped, not the batch
            # The lease still keeps other processes away while our prompt is removed.
            what = await asyncio.shield(attempt.cancel_cleanup())
            await self.threads.landed()  # a transition still being written lands first
            if isinstance(attempt.store_failed, StoreUnavailable):
                self.report(f"job {job.id}: the store failed ({attempt.store_failed}); {what}")
                raise attempt.store_failed from None
            if attempt.claim_lost:
                await self.settler.left_to_holder(
                    job, attempt, attempt_number, attempt.aborted, what
                )
                return None
            result = attempt.aborted_result(what)
        except ClaimLost as e:
            what = await attempt.cancel_cleanup()  # our prompt, if posted, is stale: remove it
            await self.settler.left_to_holder(
                job, attempt, attempt_number, f"claim lost ({e})", what
            )
            return None
        except NotPosted:
            self.claims.release(job.id)  # the batch stopped first: the job stays pending
            return None
        except StoreUnavailable as e:
            # The store failed under the attempt (writing `submitted`): the batch stops,
            # and a prompt of ours is not left to run on the server with nobody to record
            # it.
            what = await asyncio.shield(attempt.cancel_cleanup())
            self.report(f"job {job.id}: the store failed ({e}); {what}")
            raise
        except NoServerReachable:
            self.claims.release(job.id)  # nothing posted: the job stays pending
            raise
        finally:
            self.attempts.pop(job.id, None)
        self.settling.add(job.id)
        try:
            await self.settler.settle(item, attempt_number, result)
        except ClaimLost as e:
            outcome = f"its result ({result.kind}) not recorded"
            await self.settler.left_to_holder(
                job, attempt, attempt_number, f"claim lost ({e})", outcome
            )
        finally:
            self.settling.discard(job.id)  # resolved, or back in line for a retry
        self._check_finished()
        kept = attempt.slot if attempt.slot is not None and not attempt.slot.released else None
        return kept

    def _stop_unreachable(self, e: NoServerReachable) -> None:
        if not self.stopped:
            self.no_server = True
            self.stopped = f"stopped: {e}; the jobs not done stay pending (run again)"
            self.report(self.stopped)
        self._check_finished()

    def _stop_fatal(self, why: str) -> None:
        """The delivery policy stops the batch at a storyboard's first dead letter."""
        self.stopped = why
        self.report(f"delivery policy: {why}; no new shots are submitted")

    async def _write_rendering(self, job_id: str, move: RenderingStart) -> None:
        """``DeferredRendering``'s write: the job's move to rendering, with our claim."""
        await self.threads.call(
            self.store.transition,
            job_id,
            "rendering",
            owner=self.owner,
            from_state="submitted",
            via=Via(server=move.server, attempt=move.attempt),
            number=move.number,
            now=move.at,
        )

    def _rendering_failed(self, job_id: str, error: BaseException) -> bool:
        """The rendering write of ``job_id`` raised ``error``: an attempt still following
        its prompt is stopped as if its own write had raised it (the store failed: the
        batch stops; the claim lost: the job is left to its holder). False when no
        attempt can be stopped so: the attempt's last record raises it."""
        attempt = self.attempts.get(job_id)
        if attempt is None or not isinstance(error, StoreUnavailable | ClaimLost):
            return False
        claim = isinstance(error, ClaimLost)
        if not self._abort(job_id, f"claim lost ({error})" if claim else str(error), claim=claim):
            return False
        attempt.store_failed = error
        return True

    def _on_lost_slot(self, slot: Slot) -> None:
        """The pool lost the server lease of ``slot``: stop the attempt holding it (its
        prompt is removed while the lease still keeps other processes away)."""
        for job_id, attempt in self.attempts.items():
            if attempt.slot is slot:
                self._abort(job_id, f"server lease lost ({slot.lost})")

    def _abort(self, job_id: str, why: str, *, claim: bool = False) -> bool:
        """Stop the running attempt of ``job_id`` from outside: its consumer is cancelled
        once, and ``_run_item`` tells that from a cancelled batch (``cancelling() == 1``
        with ``aborted`` set), cleans up and goes on; ``claim``: the job is no longer ours.
        False when no attempt of the job runs, or it is already being stopped."""
        attempt, task = self.attempts.get(job_id), self._tasks.get(job_id)
        if attempt is None or task is None or attempt.aborted is not None:
            return False
        attempt.aborted = why
        attempt.claim_lost = claim
        task.cancel()
        return True

    async def _unsure(self) -> str | None:
        """Why nothing may be posted now (``AttemptHooks.unsure``), once our heartbeat
        is found stale for the store's budget or gone (``OwnerHeartbeat.unsure``)."""
        if self.heartbeat is None:
            return None
        return await self.heartbeat.unsure(self.store.retry_s, lambda: self.stopped)

    def _claim_gone(self, job_id: str, why: str) -> None:
        """Our claim on ``job_id`` is gone (``Claims``): stop its attempt, if one runs."""
        if job_id in self.attempts:
            self._abort(job_id, why, claim=True)
        else:
            # Waiting for a server or its retry: the next claim finds out who holds it.
            self.claims.forget(job_id)
