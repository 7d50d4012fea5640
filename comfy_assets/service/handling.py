"""How the worker handles one message (``MessageHandler``, a part of
``service.worker.Worker``): parsed,
validated, run exactly once through ``run_one``, then acknowledged, published to the
dead-letter queue or given back, with one log line per message (the outcomes are in
``service.worker``'s docstring)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comfy_assets.jobs.model import Job, JobFileError
from comfy_assets.jobs.states import DONE, State
from comfy_assets.pool.pool import Pool
from comfy_assets.render.batch import Batch
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.guard import our_error, stops_the_batch
from comfy_assets.render.owners import OwnerHeartbeat
from comfy_assets.render.run import SUPERSEDED, JobEnding, run_one
from comfy_assets.service.broker import BrokerError
from comfy_assets.service.messages import parse_message
from comfy_assets.service.sources import Delivery, JobSource
from comfy_assets.store import PartitionConflict, Store, StoreError, off_loop

log = logging.getLogger("comfy_assets.service.worker")


class MessageHandler:
    """The worker's handling of its messages, one at a time each: what it uses is given
    here. ``source``: where the messages come from (its partition and dead-letter
    destination); ``store``, ``config``, ``workflows_dir``, ``max_message_bytes``: as the
    worker's; ``owner``: the worker's, each run claiming as ``<owner>#<n>``;
    ``heartbeat()``: its owner heartbeat while it runs; ``counts``: the worker's outcome
    counters (``worker.OUTCOMES``), counted here; ``batches``: where each running job's
    batch is (the status rows); ``shots``: storyboard shots run at once under the delivery
    policy.

    ``runs``: each handler task's ``run_one`` task (cancelled after a stop's grace);
    ``touched``: the partitions whose results.csv is out of date."""

    def __init__(
        self,
        *,
        source: JobSource,
        store: Store,
        config: BatchConfig,
        workflows_dir: Path,
        max_message_bytes: int,
        owner: str,
        heartbeat: Callable[[], OwnerHeartbeat | None],
        counts: Counter[str],
        batches: set[Batch],
        shots: int,
    ) -> None:
        self.source = source
        self.partition = source.partition
        self.store = store
        self.config = config
        self.workflows_dir = workflows_dir
        self.max_message_bytes = max_message_bytes
        self.owner = owner
        self._heartbeat = heartbeat
        self.counts = counts
        self.batches = batches
        self.runs: dict[asyncio.Task[Any], asyncio.Task[JobEnding]] = {}
        self.touched: set[str] = set()
        self._answered: set[Delivery] = set()  # handed to ack/requeue: never answer again
        # A storyboard's shots under the delivery policy running at once: a shot in hand
        # checks whether its storyboard stopped only once one has ended (FIFO).
        self._shots = asyncio.Semaphore(shots)
        self._run_number = 0

    async def handle(self, d: Delivery, pool: Pool) -> None:
        """Run one delivery's job and answer the delivery (see the module docstring).
        What our code raises meanwhile that is the job's (``render/guard.py``) makes the
        message a dead letter with our error as its reason, and the worker serves on.
        Whatever else stops the handling before an answer (a cancellation, the store
        failing for good, our disk, the broker) gives the message back, then is raised."""
        try:
            await self._handle_one(d, pool)
        except (Exception, asyncio.CancelledError) as e:
            if d not in self._answered and isinstance(e, Exception) and _the_jobs(e):
                await self._our_error(d, e)
                return
            if d not in self._answered:
                why = "cancelled before it finished" if isinstance(e, asyncio.CancelledError) else e
                label = d.job.id if d.job is not None else d.message_id or "(no message_id)"
                log.warning("message %s: %s; message requeued", label, why)
                await self._requeue(d)
            raise
        finally:
            self._answered.discard(d)

    async def _handle_one(self, d: Delivery, pool: Pool) -> None:
        label = f"message {d.message_id or '(no message_id)'}"
        job, policy, partition = d.job, d.policy, self.partition
        priority = 0
        if job is None:
            try:
                queued = parse_message(
                    d.body,
                    workflows_dir=self.workflows_dir,
                    source=f"{self.partition} {label}",
                    max_bytes=self.max_message_bytes,
                )
            except JobFileError as e:
                await self._invalid(d, label, "; ".join(str(x) for x in e.errors))
                return
            job, policy, priority = queued.job, queued.policy, queued.priority
            partition = queued.partition or self.partition
        config = self.config
        if config.policy is None and policy is not None:
            config = dataclasses.replace(config, policy=policy)  # --policy wins, as in run
        self.touched.add(partition)  # its results.csv is written again soon
        with pool.prioritized(priority):  # pool/priority.py
            if job.shot is not None and (config.policy or "delivery") == "delivery":
                async with self._shots:  # the shots before it have ended: their fates are known
                    await self._handle_job(d, pool, job, partition, config)
            else:
                await self._handle_job(d, pool, job, partition, config)

    async def _handle_job(
        self, d: Delivery, pool: Pool, job: Job, partition: str, config: BatchConfig
    ) -> None:
        stopped = await self._storyboard_stopped(job, partition, config)
        if stopped is not None:
            # Listed, pending, in results.csv.
            await off_loop(self.store, self.store.register_jobs, partition, [job])
            await d.dead_letter(stopped)
            await self._acked(d, "stopped", "job %s: not rendered, %s", job.id, stopped)
            return
        # A claim owner per run: two deliveries of one job in this worker must not both
        # hold its claim (the second one waits for the first, as another worker would).
        self._run_number += 1
        claim_owner = f"{self.owner}#{self._run_number}"
        me = asyncio.current_task()
        assert me is not None
        run = asyncio.create_task(
            run_one(
                job,
                partition=partition,
                pool=pool,
                store=self.store,
                config=config,
                owner=claim_owner,
                heartbeat=self._heartbeat(),
                running=self.batches,
            ),
            name=f"job {job.id}",
        )
        self.runs[me] = run
        try:
            ending = await run
        except asyncio.CancelledError:
            # The run was cancelled (grace over) and has cleaned up; or this handler is.
            if not me.cancelling() and (state := await self._done_anyway(job)) is not None:
                await self._acked(
                    d, "done", "job %s: %s as the grace ran out; message acked", job.id, state
                )
                return
            await self._requeue(d)
            log.warning("job %s: cancelled before it finished; message requeued", job.id)
            if me.cancelling():
                raise
            return
        except PartitionConflict as e:
            await self._invalid(d, f"job {job.id}", str(e))
            return
        finally:
            self.runs.pop(me, None)
            # Written again: a write while the job ran shows it unfinished.
            self.touched.add(partition)

        await self._answer(d, job, ending)

    async def _done_anyway(self, job: Job) -> State | None:
        """The state of ``job`` if its run, cancelled as the grace ran out, wrote its done
        record before it stopped (same prompt); else None. Its message is then acked,
        not delivered again to a worker that would only find it done. A store that
        cannot say (StoreError) is said in a line and counts as not done: the message
        is requeued, and its next delivery reads the store again."""
        try:
            rec = await off_loop(self.store, self.store.get, job.id)
        except StoreError as e:
            log.warning("job %s: cancelled; whether it is done is unknown (%s)", job.id, e)
            return None
        if rec is None or rec.prompt_id != job.prompt_id or rec.state not in DONE:
            return None
        return rec.state

    async def _answer(self, d: Delivery, job: Job, ending: JobEnding) -> None:
        """Answer ``d`` by how its run ended: acked (done, done before, dead-lettered now
        and published to ``<queue>.dead``, dead before, superseded, left to its holder) or,
        left pending (every server that can run it quarantined, nothing saying its
        failures are the job's), requeued; this worker then takes none while every server
        is quarantined (``Pool.until_usable``)."""
        how, state, rec = ending.how, ending.state, ending.record
        if how == SUPERSEDED:
            await self._superseded(d, job)
        elif how == "done":
            await self._acked(d, "done", "job %s: %s", job.id, state)
        elif how == "done_before":
            await self._acked(
                d, "done_before", "job %s: done before (%s), nothing posted", job.id, state
            )
        elif how in ("dead_lettered", "dead_before"):
            reason = (rec.reason if rec is not None else None) or "(no reason recorded)"
            if how == "dead_lettered":
                await d.dead_letter(reason)
                where = self.source.dead_destination
                await self._acked(
                    d, "dead_lettered", "job %s: dead-lettered to %s, %s", job.id, where, reason
                )
            else:
                await self._acked(
                    d,
                    "dead_before",
                    "job %s: dead-lettered earlier (%s); not published again",
                    job.id,
                    reason,
                )
        elif how == "left_to_holder":
            # Its claim was taken while it ran (a cancel through the API, or a worker that
            # found our claim stale): the holder finishes the job, so this message is done.
            await self._acked(
                d,
                "left_to_holder",
                "job %s: %s, its claim taken by %s, which finishes it",
                job.id,
                state,
                rec.claimed_by if rec is not None else None,
            )
        else:
            await self._requeue(d)
            why = (rec.reason if rec is not None else None) or "no server usable"
            log.warning("job %s: not run (%s), %s; message requeued", job.id, state, why)

    async def _superseded(self, d: Delivery, job: Job) -> None:
        """Ack a message whose job the store holds under another prompt (a newer take,
        or other inputs registered since), saying so in the job's events: the message
        that registered it renders it."""
        rec = await off_loop(self.store, self.store.get, job.id)
        now = rec.take if rec is not None else None
        newer = f"take {now}" if now is not None and now != job.take else "a newer registration"
        what = f"message of take {job.take} superseded by {newer}"
        await off_loop(self.store, self.store.note, job.id, f"{what}; acked, not rendered")
        await self._acked(d, "superseded", "job %s: %s, not rendered", job.id, what)

    async def _storyboard_stopped(
        self, job: Job, partition: str, config: BatchConfig
    ) -> str | None:
        """Under the delivery policy a storyboard's shots stop at its first fatal failure,
        as in ``comfy-assets run``: why this shot is not rendered (another shot of its
        partition is a dead letter), or None."""
        if job.shot is None or (config.policy or "delivery") != "delivery":
            return None
        # The first two: shots come first, so one of them is another shot's if any is
        # (a storyboard's every shot may be a dead letter, a million of them).
        dead_letters = await off_loop(self.store, self.store.dead_letters, partition, 2)
        dead = [r for r in dead_letters if r.shot is not None]
        dead = [r for r in dead if r.job_id != job.id]
        if not dead:
            return None
        first = dead[0]
        return (
            f"delivery policy: storyboard {partition} stopped after the fatal failure of "
            f"shot {first.shot} (job {first.job_id}): {first.reason}; requeue that job and "
            "enqueue the file again"
        )

    async def _our_error(self, d: Delivery, error: Exception) -> None:
        """The handling of ``d`` raised ``error``, the job's: ``d`` goes to the dead-letter
        destination with ``our_error`` as its reason, and is acked. A publication that
        fails gives the message back and raises, as any failure to answer does."""
        label = f"message {d.message_id or '(no message_id)'}"
        reason = our_error(error)
        log.error("%s: %s", label, reason, exc_info=error)
        try:
            await d.dead_letter(reason)
        except BaseException:
            await self._requeue(d)
            raise
        where = self.source.dead_destination
        await self._acked(d, "dead_lettered", "%s: dead-lettered to %s, %s", label, where, reason)

    async def _invalid(self, d: Delivery, label: str, error: str) -> None:
        reason = f"invalid job: {error}"
        await d.dead_letter(reason)
        where = self.source.dead_destination
        await self._acked(d, "invalid", "%s: dead-lettered to %s, %s", label, where, reason)

    async def _acked(self, d: Delivery, outcome: str, message: str, *args: object) -> None:
        """Ack ``d``, count it under ``outcome`` (``worker.OUTCOMES``) and log ``message %
        args`` with "; message acked": a warning for a message that was not rendered here
        (dead-lettered now, invalid, stopped by the delivery policy, left to another holder),
        else info."""
        await self._ack(d)
        self.counts[outcome] += 1
        level = (
            logging.INFO if outcome in ("done", "done_before", "dead_before") else logging.WARNING
        )
        log.log(level, message + "; message acked", *args)

    async def _ack(self, d: Delivery) -> None:
        self._answered.add(d)  # an ack that fails is not followed by a requeue
        await d.ack()
        self.counts["acked"] += 1

    async def _requeue(self, d: Delivery) -> None:
        self._answered.add(d)
        await d.requeue()
        self.counts["requeued"] += 1

    async def give_back(self, d: Delivery) -> None:
        """Requeue a delivery no handler took."""
        await self._requeue(d)
        self._answered.discard(d)


def _the_jobs(error: Exception) -> bool:
    """True when ``error``, raised handling one message, is that job's failure: not what
    stops a batch (``render/guard.py``), nor the broker's."""
    return not stops_the_batch(error) and not isinstance(error, BrokerError)
