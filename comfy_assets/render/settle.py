"""What an attempt's result does to its job: succeeded (the done record), tried again
after a backoff delay, degraded (draft policy) or dead-lettered (and, under the delivery
policy, the storyboard stopped); and an attempt cut short by a cancelled run, recorded."""

from __future__ import annotations

import time
from typing import Any

from comfy_assets.jobs.model import Job
from comfy_assets.render.attempt import Attempt
from comfy_assets.render.blame import Ownership
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
from comfy_assets.render.outcome import AttemptResult
from comfy_assets.render.outputs import remove_stale_outputs
from comfy_assets.render.queue import Item
from comfy_assets.store import AttemptEntry, ClaimLost, StoreUnavailable


class Settle(Ownership):
    """The store's side of each attempt's end (a part of ``Batch``); whose failure it
    was is decided first (``Ownership``)."""

    async def _settle(self, item: Item, attempt_number: int, r: AttemptResult) -> None:
        """Judge the attempt's result (``Blame``), decide its move (``decide``) and write
        the move. Raises ClaimLost, StoreUnavailable."""
        r, at_once = await self._owned(item, r)
        if at_once:
            item.elsewhere += 1
        counted = attempt_number - item.elsewhere  # the job's own attempts
        policy = Policy(self.config.retry, self.draft, self.stop_on_fatal)
        sick = None
        if needs_farm_look(r.kind, counted, policy):
            sick = await self._sick_farm(item)
        facts = Facts(
            r.kind,
            r.reason,
            attempt_number,
            counted,
            at_once=at_once,
            sick=sick,
            optional=item.job.optional,
            stopped=self.stopped,
        )
        await self._apply(item, attempt_number, r, decide(facts, policy, item.job.id))

    async def _apply(self, item: Item, attempt_number: int, r: AttemptResult, move: Move) -> None:
        """Write ``move`` for attempt ``attempt_number`` of ``item`` (result ``r``): its
        transition with the attempt's row in one transaction, the claim, a line, the
        job's place in line or its end in this batch."""
        job, store = item.job, self.store
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
        ended: dict[str, Any] = {
            "server": r.server,
            "attempt": attempt_number,
            "tried": tried,
            "rendering": rendering,
        }
        if isinstance(move, Done):
            remove_stale_outputs(store.job_dir(self.partition, job.id), r.files, job.take)
            self.claims.finishing_now(job.id)
            await self._write_done(
                job.id,
                state="succeeded",
                files=r.files,
                number=r.number,
                **ended,
            )
            self.claims.finished(job.id)
            self._measured(item, r)
            await self._rendered(item, r.server)
            how = "caught up, nothing posted" if r.caught_up else f"{len(r.files)} files"
            self.report(f"job {job.id} attempt {attempt_number}{where}: succeeded ({how})")
            self._resolve("done", job.id)
            return
        if isinstance(move, Retry | Pending):
            await self._db(
                store.transition,
                job.id,
                "failed_retryable",
                # With our claim: one taken meanwhile (a cancel by the API, say) raises
                # ClaimLost, and the job is left to its new holder.
                owner=self.owner,
                detail=r.reason,
                **ended,
            )
            failed = f"job {job.id}: attempt {attempt_number} failed{where}, {r.reason}"
            if isinstance(move, Retry) and self.stopped:
                # Stopped while the failure was written: no consumer takes it any more.
                move = Pending(f"not retried in this run ({self.stopped})", stopped=True)
            if isinstance(move, Retry):
                when = "retry at once" if move.at_once else f"retry in {move.delay_s * 1000:.0f} ms"
                self.report(f"{failed}; {when}, ahead of the jobs not yet tried")
                again = Item(
                    job,
                    prev_server=r.server,
                    fresh=r.outputs_missing,
                    prev_number=r.number,
                    failed_on=item.failed_on,
                    elsewhere=item.elsewhere,
                    kinds=item.kinds,
                )
                self.queue.push_later(again, move.delay_s)
                return
            self.claims.release(job.id)  # no consumer takes it any more: a later run does
            if not move.stopped:
                await self._unjudged(item)
            self.report(f"{failed}; {move.why}" + ("" if move.stopped else "; it stays pending"))
            self._resolve("not_run", job.id)
            return
        self.claims.finishing_now(job.id)
        await self._unjudged(item)  # its failures no second server judged hold nobody back
        if isinstance(move, Degraded):
            await self._write_done(
                job.id,
                state="degraded",
                files=[],
                reason=move.reason,
                **ended,
            )
            self.report(f"job {job.id}: degraded (draft), {move.reason}")
            self.claims.finished(job.id)
            self._resolve("degraded", job.id)
            return
        await self._write_dead_letter(job.id, move.reason, **ended)
        self.report(f"job {job.id}: dead-lettered, {move.reason}")
        if move.stops is not None and not self.stopped:
            self.stopped = move.stops
            self.report(f"delivery policy: {self.stopped}; no new shots are submitted")
        self.claims.finished(job.id)
        self._resolve("dead_lettered", job.id)

    async def _write_done(self, job_id: str, **fields: Any) -> None:
        """The done record of ``job_id`` (``Store.mark_done``, with our claim), noted as
        this batch's (``wrote``). Raises ClaimLost, StoreUnavailable."""
        await self._db(self.store.mark_done, job_id, self.owner, **fields)
        self.wrote.add(job_id)

    async def _write_dead_letter(self, job_id: str, reason: str, **fields: Any) -> None:
        """The dead letter of ``job_id`` (``Store.dead_letter``, with our claim), noted as
        this batch's (``wrote``). Raises ClaimLost, StoreUnavailable."""
        await self._db(self.store.dead_letter, job_id, self.owner, reason, **fields)
        self.wrote.add(job_id)

    async def _cancelled(
        self, job: Job, attempt: Attempt, attempt_number: int, before: int
    ) -> None:
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
                self.claims.forget(job.id)
                what += f"; not recorded: claim lost ({e})"
            self.report(f"job {job.id}: run cancelled, {what}")

    async def _record_cancel(
        self, job: Job, attempt: Attempt, attempt_number: int, before: int, what: str
    ) -> None:
        """Record the cancelled attempt (its job back to failed_retryable, after its
        rendering move if not yet written) and free the claim. Raises StoreUnavailable,
        ClaimLost."""
        await self._landed()  # a `submitted` still being written lands first
        rendering = await self.renderings.take(job.id)
        rec = await self._db(self.store.get, job.id)
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
            await self._db(
                self.store.transition,
                job.id,
                "failed_retryable",
                detail=reason,
                attempt=attempt_number,
                tried=tried,
                rendering=rendering if rec.state == "submitted" else None,
            )
        self.claims.release(job.id)
