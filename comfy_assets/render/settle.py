"""What an attempt's result does to its job: succeeded (the done record), tried again
after a backoff delay, degraded (draft policy) or dead-lettered (and, under the delivery
policy, the storyboard stopped); and an attempt cut short by a cancelled run, recorded."""

from __future__ import annotations

import time
from typing import Any

from comfy_assets.jobs.model import Job
from comfy_assets.render.attempt import Attempt
from comfy_assets.render.outcome import AttemptResult
from comfy_assets.render.outputs import remove_stale_outputs
from comfy_assets.render.blame import Ownership
from comfy_assets.render.queue import Item
from comfy_assets.store import AttemptEntry, ClaimLost, StoreUnavailable


class Settle(Ownership):
    """The store's side of each attempt's end (a part of ``Batch``); whose failure it
    was is decided first (``Ownership``)."""

    async def _settle(self, item: Item, attempt_number: int, r: AttemptResult) -> None:
        job, store, cfg = item.job, self.store, self.config
        r, at_once = await self._owned(item, r)
        if at_once:
            item.elsewhere += 1
        counted = attempt_number - item.elsewhere  # the job's own attempts
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
        if r.kind == "success":
            remove_stale_outputs(store.job_dir(self.partition, job.id), r.files, job.take)
            self.claims.finishing_now(job.id)
            await self._db(
                store.mark_done,
                job.id,
                self.owner,
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
        if r.kind == "transient" and counted < cfg.attempts:
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
            if self.stopped:  # no consumer takes it any more: the next run does
                self.claims.release(job.id)
                self.report(
                    f"job {job.id}: attempt {attempt_number} failed{where}, {r.reason}; not retried "
                    f"in this run ({self.stopped})"
                )
                self._resolve("not_run", job.id)
                return
            delay = 0.0 if at_once else cfg.retry.delay(attempt_number)
            when = "retry at once" if at_once else f"retry in {delay * 1000:.0f} ms"
            self.report(
                f"job {job.id}: attempt {attempt_number} failed{where}, {r.reason}; "
                f"{when}, ahead of the jobs not yet tried"
            )
            again = Item(
                job,
                prev_server=r.server,
                fresh=r.outputs_missing,
                prev_number=r.number,
                failed_on=item.failed_on,
                elsewhere=item.elsewhere,
                kinds=item.kinds,
            )
            self.queue.push_later(again, delay)
            return
        sick = await self._sick_farm(item) if r.kind == "transient" else None
        if sick is not None:  # no evidence that it is the job's: it waits for a server
            await self._db(
                store.transition,
                job.id,
                "failed_retryable",
                owner=self.owner,
                detail=r.reason,
                **ended,
            )
            self.claims.release(job.id)
            await self._unjudged(item)
            self.report(
                f"job {job.id}: attempt {attempt_number} failed{where}, {r.reason}; not run "
                f"again, {sick}; it stays pending"
            )
            self._resolve("not_run", job.id)
            return
        plural = "s" if attempt_number > 1 else ""
        reason = (
            r.reason
            if r.kind == "permanent"
            else f"gave up after {attempt_number} attempt{plural}, last: {r.reason}"
        )
        self.claims.finishing_now(job.id)
        await self._unjudged(item)  # its failures no second server judged hold nobody back
        degraded = self.draft and (r.kind == "permanent" or job.optional)
        if degraded:
            await self._db(
                store.mark_done,
                job.id,
                self.owner,
                state="degraded",
                files=[],
                reason=reason,
                **ended,
            )
            self.report(f"job {job.id}: degraded (draft), {reason}")
        else:
            await self._db(
                store.dead_letter,
                job.id,
                self.owner,
                reason,
                **ended,
            )
            self.report(f"job {job.id}: dead-lettered, {reason}")
            if self.stop_on_fatal and not self.stopped:
                self.stopped = f"stopped after the fatal failure of job {job.id}: {reason}"
                self.report(f"delivery policy: {self.stopped}; no new shots are submitted")
        self.claims.finished(job.id)
        self._resolve("degraded" if degraded else "dead_lettered", job.id)

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
