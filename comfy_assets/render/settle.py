"""What an attempt's result does to its job: succeeded (the done record), tried again
after a backoff delay, degraded (draft policy) or dead-lettered (and, under the delivery
policy, the storyboard stopped); and an attempt cut short by a cancelled run, recorded."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

from comfy_assets.jobs.model import Job
from comfy_assets.render.attempt import Attempt
from comfy_assets.render.blame import Blame
from comfy_assets.render.decision import (
    Degraded,
    Done,
    Facts,
    Move,
    Pending,
    Policy,
    Retry,
    decide,
    needs_farm_look,
)
from comfy_assets.render.files_outage import FilesOutage
from comfy_assets.render.guard import our_error, stops_the_batch
from comfy_assets.render.outcome import AttemptResult
from comfy_assets.render.outputs import unconfirmed_outputs
from comfy_assets.render.progress import Ended
from comfy_assets.render.queue import Item
from comfy_assets.render.rendering import DeferredRendering
from comfy_assets.render.scope import BatchScope
from comfy_assets.store import AttemptEntry, ClaimLost, JobRecord, StoreUnavailable, Via
from comfy_assets.store.files import FileStoreUnavailable

log = logging.getLogger("comfy_assets.render.guard")


@dataclass(eq=False, kw_only=True)
class Settler:
    """The store's side of each attempt's end, for one batch (``scope``): whose failure it
    was (``blame``), the move (``decide``, with the policy: ``scope.config``'s retries,
    ``draft``, ``stop_on_fatal``), then the move written with our claim (``owner``,
    ``scope.claims``) through ``scope.threads``; a retry goes back in ``scope.queue``, an
    end is told to ``scope.resolve``, a delivery stop to ``stop`` (``stopped`` says why the
    batch stopped, if it did).

    ``wrote``: the jobs whose done record (or degraded) or dead letter this batch wrote:
    exactly one run ever writes each (the store takes it only from the claim's holder,
    once), so ``run_one`` tells a job ended now from one ended before; kept only with
    ``keep_wrote`` (a batch fed from a file a chunk at a time keeps none: memory that does
    not grow with the file)."""

    scope: BatchScope
    owner: str
    renderings: DeferredRendering
    blame: Blame
    stopped: Callable[[], str | None]
    stop: Callable[[str], None]
    draft: InitVar[bool] = False
    stop_on_fatal: InitVar[bool] = False
    keep_wrote: bool = True
    policy: Policy = field(init=False, repr=False)
    wrote: set[str] = field(default_factory=set, init=False, repr=False)
    files_outage: FilesOutage = field(init=False, repr=False)
    # The state of each done record this batch wrote (succeeded, degraded), kept like
    # ``wrote``.
    done: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self, draft: bool, stop_on_fatal: bool) -> None:
        self.policy = Policy(self.scope.config.retry, draft, stop_on_fatal)
        self.files_outage = FilesOutage(self.scope.config.files_wait_s)

    async def settle(self, item: Item, attempt_number: int, result: AttemptResult) -> None:
        """Record attempt ``attempt_number`` of ``item`` (``result``); what that raises
        that is the job's (``stops_the_batch`` False: ``render/guard.py``) makes the job a
        dead letter (``_broke``), the rest is raised (ClaimLost, StoreUnavailable...)."""
        try:
            await self._settle(item, attempt_number, result)
        except Exception as e:
            if stops_the_batch(e):
                raise
            await self._broke(item, attempt_number, e)

    async def _settle(self, item: Item, attempt_number: int, r: AttemptResult) -> None:
        """Judge the attempt's result (``Blame``), decide its move (``decide``) and write
        the move. Raises ClaimLost, StoreUnavailable."""
        if r.kind == "success":
            r = await self._confirmed(item, r)
        r, at_once = await self.blame.owned(item, r)
        if at_once or r.file_store_fault:
            item.elsewhere += 1  # not one of the job's own attempts
        if r.file_store_fault:
            item.store_faults += 1
        counted = attempt_number - item.elsewhere  # the job's own attempts
        policy = self.policy
        sick = None
        if needs_farm_look(r.kind, counted, policy):
            sick = await self.blame.sick_farm(item)
        facts = Facts(
            r.kind,
            r.reason,
            attempt_number,
            counted,
            at_once=at_once,
            sick=sick,
            optional=item.job.optional,
            stopped=self.stopped(),
        )
        move = decide(facts, policy, item.job.id)
        files_failed: FileStoreUnavailable | None = None
        if r.file_store_fault:
            # Waited out by the batch (``render/files_outage.py``), then the store's end.
            try:
                self.files_outage.failed(self.scope.store.file_store.location, r.reason)
            except FileStoreUnavailable as e:
                files_failed = e
                move = Pending(f"not run again in this run, {r.reason}", stopped=False)
            if isinstance(move, Retry):
                move = Retry(policy.retry.delay(item.store_faults), at_once=False)
        elif isinstance(move, Done):
            self.files_outage.stored()
        await self._apply(item, attempt_number, r, move)
        if files_failed is not None:
            raise files_failed

    async def _confirmed(self, item: Item, r: AttemptResult) -> AttemptResult:
        """``r`` (a success) when the store's files confirm every output it lists;
        else a transient result, the store's failure (``file_store_fault``): its done
        record is not written, and the job is tried again, its outputs caught up from
        the server's /history."""
        files = self.scope.store.file_store
        problem = await unconfirmed_outputs(files, self.scope.partition, item.job.id, r.files)
        if problem is None:
            return r
        reason = (
            f"outputs not confirmed in the store {files.location}: {problem}; the store's "
            "failure, not the job's"
        )
        return dataclasses.replace(
            r, kind="transient", reason=reason, files=[], file_store_fault=True
        )

    async def _apply(self, item: Item, attempt_number: int, r: AttemptResult, move: Move) -> None:
        """Write ``move`` for attempt ``attempt_number`` of ``item`` (result ``r``): its
        transition with the attempt's row in one transaction, the claim, a line, the
        job's place in line or its end in this batch."""
        job, store = item.job, self.scope.store
        tried = AttemptEntry(  # written with the transition below, one transaction
            item.attempts_before + attempt_number,  # rows go on numbering after a requeue
            server=r.server,
            prompt_id=r.prompt_id,
            number=r.number,
            seconds=r.seconds,
            queue_wait_s=r.queue_wait_s,
            gpu_seconds=r.gpu_seconds,
            outcome=r.kind,
            reason=r.reason or None,
            models=job.models,
            model_loaded=item.model_loaded and r.server == item.loaded_on,
        )
        where = f" on {r.server}" if r.server else ""
        # The move to rendering, unless already written: in the same transaction.
        rendering = await self.renderings.take(job.id)
        # What each store call below records of this attempt besides its own fields.
        via = Via(server=r.server, attempt=attempt_number, tried=tried, rendering=rendering)
        if isinstance(move, Done):
            store.file_store.remove_stale_outputs(self.scope.partition, job.id, r.files, job.take)
            self.scope.claims.finishing_now(job.id)
            await self.write_done(
                job.id,
                state="succeeded",
                files=r.files,
                number=r.number,
                via=via,
            )
            self.scope.claims.finished(job.id)
            self.blame.measured(item, r)
            await self.blame.rendered(item, r.server)
            how = "caught up, nothing posted" if r.caught_up else f"{len(r.files)} files"
            self.scope.report(f"job {job.id} attempt {attempt_number}{where}: succeeded ({how})")
            self.scope.resolve("done", job.id)
            return
        if isinstance(move, Retry | Pending):
            await self.scope.threads.call(
                store.transition,
                job.id,
                "failed_retryable",
                # With our claim: one taken meanwhile (a cancel by the API, say) raises
                # ClaimLost, and the job is left to its new holder.
                owner=self.owner,
                detail=r.reason,
                via=via,
            )
            failed = f"job {job.id}: attempt {attempt_number} failed{where}, {r.reason}"
            stopped = self.stopped()
            if isinstance(move, Retry) and stopped:
                # Stopped while the failure was written: no consumer takes it any more.
                move = Pending(f"not retried in this run ({stopped})", stopped=True)
            if isinstance(move, Retry):
                when = "retry at once" if move.at_once else f"retry in {move.delay_s * 1000:.0f} ms"
                self.scope.report(f"{failed}; {when}, ahead of the jobs not yet tried")
                again = item.retried(r.server, fresh=r.outputs_missing, number=r.number)
                self.scope.queue.push_later(again, move.delay_s)
                return
            self.scope.claims.release(job.id)  # no consumer takes it any more: a later run does
            if not move.stopped:
                await self.blame.unjudged(item)
            self.scope.report(
                f"{failed}; {move.why}" + ("" if move.stopped else "; it stays pending")
            )
            self.scope.resolve("not_run", job.id)
            return
        self.scope.claims.finishing_now(job.id)
        await self.blame.unjudged(item)  # its failures no second server judged hold nobody back
        if isinstance(move, Degraded):
            await self.write_done(
                job.id,
                state="degraded",
                files=[],
                reason=move.reason,
                via=via,
            )
            self.scope.report(f"job {job.id}: degraded (draft), {move.reason}")
            self.scope.claims.finished(job.id)
            self.scope.resolve("degraded", job.id)
            return
        await self.write_dead_letter(job.id, move.reason, via=via)
        self.scope.report(f"job {job.id}: dead-lettered, {move.reason}")
        if move.stops is not None and not self.stopped():
            self.stop(move.stops)
        self.scope.claims.finished(job.id)
        self.scope.resolve("dead_lettered", job.id)

    async def write_done(self, job_id: str, **fields: Any) -> None:
        """The done record of ``job_id`` (``Store.mark_done``, with our claim), noted as
        this batch's (``wrote``). Raises ClaimLost, StoreUnavailable."""
        await self.scope.threads.call(self.scope.store.mark_done, job_id, self.owner, **fields)
        if self.keep_wrote:
            self.wrote.add(job_id)
            self.done[job_id] = str(fields.get("state", "succeeded"))

    async def write_dead_letter(self, job_id: str, reason: str, **fields: Any) -> None:
        """The dead letter of ``job_id`` (``Store.dead_letter``, with our claim), noted as
        this batch's (``wrote``). Raises ClaimLost, StoreUnavailable."""
        await self.scope.threads.call(
            self.scope.store.dead_letter, job_id, self.owner, reason, **fields
        )
        if self.keep_wrote:
            self.wrote.add(job_id)

    async def cancelled(self, job: Job, attempt: Attempt, attempt_number: int, before: int) -> None:
        """The batch is cancelled during attempt ``attempt_number`` (``before``: the job's tries
        before its last requeue): remove our prompt, record the attempt, free the claim."""
        what = "cleanup did not finish"
        try:
            what = await attempt.cancel_cleanup()
        finally:
            try:
                await self._record_cancel(job, attempt, attempt_number, before, what)
                what += ", claim released"
            except StoreUnavailable as e:
                what += f"; neither recorded nor its claim released ({e})"
            except ClaimLost as e:  # raised by its rendering write, under way meanwhile
                self.scope.claims.forget(job.id)
                what += f"; not recorded: claim lost ({e})"
            self.scope.report(f"job {job.id}: run cancelled, {what}")

    async def _record_cancel(
        self, job: Job, attempt: Attempt, attempt_number: int, before: int, what: str
    ) -> None:
        """Record the cancelled attempt (its job back to failed_retryable, after its
        rendering move if not yet written) and free the claim. Raises StoreUnavailable,
        ClaimLost."""
        await self.scope.threads.landed()  # a `submitted` still being written lands first
        rendering = await self.renderings.take(job.id)
        rec = await self.scope.threads.call(self.scope.store.get, job.id)
        if rec is not None and rec.state in ("submitted", "rendering"):
            reason = f"run cancelled; {what}"
            tried = AttemptEntry(
                before + attempt_number,
                outcome="transient",
                server=rec.server,
                prompt_id=job.prompt_id,
                number=rendering.number if rendering else rec.number,
                seconds=time.monotonic() - attempt.started,
                reason=reason,
            )
            await self.scope.threads.call(
                self.scope.store.transition,
                job.id,
                "failed_retryable",
                detail=reason,
                via=Via(
                    attempt=attempt_number,
                    tried=tried,
                    rendering=rendering if rec.state == "submitted" else None,
                ),
            )
        self.scope.claims.release(job.id)

    async def left_to_holder(
        self, job: Job, attempt: Attempt, attempt_number: int, why: str, cleanup: str
    ) -> None:
        """The job's claim went to another worker while attempt ``attempt_number`` ran: say so
        (an event that changes nothing, and a line) and leave the job to its holder."""
        try:
            await self.renderings.take(job.id)  # its rendering move is not ours to write
        except ClaimLost:
            pass  # raised by that move's write under way: the loss this reports
        server = attempt.slot.name if attempt.slot is not None else None
        detail = f"{why} during attempt {attempt_number}; {cleanup}"
        await self.scope.threads.call(
            self.scope.store.note, job.id, detail, server=server, attempt=attempt_number
        )
        self.scope.claims.forget(job.id)
        self.scope.report(f"job {job.id}: {detail}; left to its holder")
        self.scope.resolve("not_run", job.id)

    async def leave_quarantined(self) -> None:
        """The jobs waiting here for servers that are all quarantined
        (``Blame.quarantined_group``) are not run in this batch: their claims are
        released, they stay pending for a later run, and a line says why."""
        for group in self.scope.queue.groups():
            reason = self.blame.quarantined_group(group)
            if reason is None:
                continue
            for item in self.scope.queue.pop_all(group):
                if item.rec is not None:
                    self.scope.claims.release(item.job.id)
                self.scope.report(f"job {item.job.id}: not run, {reason}; it stays pending")
                self.scope.resolve("not_run", item.job.id)

    async def dead_letter_now(self, item: Item, rec: JobRecord, reason: str) -> None:
        """``item`` (claimed: ``rec``) can run on no server: a dead letter (degraded in a
        draft) with ``reason``, nothing posted."""
        result = AttemptResult("permanent", reason, prompt_id=item.job.prompt_id)
        await self.settle(item, rec.attempts + 1, result)

    async def not_rendered(self, item: Item, reason: str) -> None:
        """Settle a claimed job whose upstream job failed: degraded under the draft
        policy, else a dead letter; nothing is posted. Raises ClaimLost,
        StoreUnavailable."""
        job = item.job
        self.scope.claims.finishing_now(job.id)
        if self.policy.draft:
            await self.write_done(job.id, state="degraded", reason=reason)
            self.scope.report(f"job {job.id}: degraded (draft), {reason}")
            ended: Ended = "degraded"
        else:
            await self.write_dead_letter(job.id, reason)
            self.scope.report(f"job {job.id}: dead-lettered, {reason}")
            ended = "dead_lettered"
        self.scope.claims.finished(job.id)
        self.scope.resolve(ended, job.id)

    async def _broke(self, item: Item, attempt_number: int, error: Exception) -> None:
        """Recording attempt ``attempt_number`` of ``item`` raised ``error``, the job's
        (``stops_the_batch`` is False): the job is a dead letter with ``our_error`` as its
        reason, written alone (no attempt row, nothing of the attempt's result). When even
        that cannot be written (the store answers with something other than an outage),
        the job is resolved as its record stands, said in a line. Raises what
        ``stops_the_batch`` says is not the job's."""
        job_id = item.job.id
        reason = our_error(error)
        log.error("job %s: %s", job_id, reason, exc_info=error)
        self.scope.claims.finishing_now(job_id)
        try:
            await self.write_dead_letter(job_id, reason, via=Via(attempt=attempt_number))
        except Exception as again:
            if stops_the_batch(again):
                raise
            rec = await self.scope.threads.call(self.scope.store.get, job_id)
            state = rec.state if rec is not None else "missing"
            self.scope.claims.release(job_id)
            self.scope.report(
                f"job {job_id}: {reason}; its dead letter not written either "
                f"({our_error(again)}); left {state}"
            )
            ended: dict[str, Ended] = {
                "failed_fatal": "dead_lettered",
                "succeeded": "done",
                "degraded": "degraded",
            }
            self.scope.resolve(ended.get(state, "not_run"), job_id)
            return
        self.scope.claims.finished(job_id)
        self.scope.report(f"job {job_id}: dead-lettered, {reason}")
        if self.policy.stop_on_fatal and not self.stopped():
            self.stop(f"stopped after the fatal failure of job {job_id}: {reason}")
        self.scope.resolve("dead_lettered", job_id)
