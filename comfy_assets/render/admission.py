"""Claiming a job before it runs, and what its record then says: done already (its files
checked on disk), a dead letter, held by another live process (waited for), or taken
over from a holder that was lost mid-attempt (that attempt counted). ``Admission``, a part
of ``Batch``."""

from __future__ import annotations

import dataclasses

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.states import InvalidTransition, State
from comfy_assets.render.chain import Chain
from comfy_assets.render.outputs import EndedBefore, outputs_problem
from comfy_assets.render.queue import Item
from comfy_assets.render.scope import BatchScope
from comfy_assets.store import OWNER_DEAD_S, AttemptEntry, JobRecord, Via
from comfy_assets.store.files import FileStoreUnavailable


@dataclasses.dataclass(eq=False, kw_only=True)
class Admission:
    """``claim``: a job's claim (``scope.claims``) and what its record says, for one
    batch (``scope``): a job ended already is resolved (``scope.resolve``), one held by
    another process goes back in ``scope.queue`` for later, a chained one dead-lettered
    only for its upstream is requeued (``chain``); each said with ``scope.report``."""

    scope: BatchScope
    chain: Chain
    # Jobs whose "claimed by another" line was said.
    told_held: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)

    async def claim(self, item: Item) -> JobRecord | None:
        """Claim ``item``'s job; its record when it is ours to run, else None (done,
        dead-lettered, or held by another worker: then it is resolved or put back). A
        chained job dead-lettered (or degraded) only for its upstream job, which is no
        longer failed, is requeued first."""
        job, cfg, store = item.job, self.scope.config, self.scope.store
        if item.rec is not None:
            rec, item.rec = item.rec, None
            if job.id in self.scope.claims.held:  # claimed before its consumer waited in line
                return rec
        status, rec = await self.scope.claims.claim(job.id, job.prompt_id)
        if status in ("dead_lettered", "done") and await self.chain.requeue_if_upstream_fixed(
            job, rec, self.scope.report
        ):
            status, rec = await self.scope.claims.claim(job.id, job.prompt_id)
        if status == "done":
            again = await self._done_before(job, rec)
            if again is None:
                return None
            status, rec = again
        if status == "changed":
            # Registered again since this batch began (a newer take, other inputs): the
            # run that registered it renders it; rendering this prompt would give the
            # newer registration an older picture.
            self.scope.report(
                f"job {job.id}: registered again since (take {rec.take or 1} now); "
                "not rendered by this run"
            )
            self.scope.resolve("not_run", job.id)
            return None
        if status == "dead_lettered":
            self._ended(job.id, rec)
            return None
        if status == "claimed" and rec.taken_over:
            self.scope.report(f"job {job.id}: {rec.taken_over}")
        if status == "held":
            if job.id not in self.told_held:
                self.told_held.add(job.id)
                self.scope.report(
                    f"job {job.id}: claimed by {rec.claimed_by}; waiting (taken over if its "
                    f"heartbeat stops for {OWNER_DEAD_S:.0f} s)"
                )
            left = (rec.claim_expires_at or 0) - store.now()
            self.scope.queue.push_later(item, min(max(left, cfg.poll_s / 4), cfg.poll_s))
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
            await self.scope.threads.call(
                store.transition,
                job.id,
                "failed_retryable",
                detail="previous holder lost; claim taken over",
                via=Via(server=rec.server, attempt=rec.attempts + 1, tried=lost),
            )
            rec = dataclasses.replace(rec, state=State.FAILED_RETRYABLE, attempts=rec.attempts + 1)
            item.prev_unsettled = True
        if rec.state == "failed_retryable":
            await self.scope.threads.call(store.transition, job.id, "pending", detail="retry")
        return rec

    def settle_ended(self, job: Job, before: EndedBefore) -> bool:
        """Resolve ``job``, found ended by its registration in this batch (``before``:
        ``outputs.ended_before``), as its claim would, with the same line and without a
        claim or a store call: done with its outputs stored (or unchecked: the store's
        files did not answer), degraded, or dead-lettered. False when it is not resolved
        here: a done job whose outputs need fetching again, or a chained job (its
        upstream may be fixed): ``claim`` takes it as before."""
        if job.depends_on or before.problem is not None:
            return False
        unchecked = f" (its outputs not checked: {before.unchecked})" if before.unchecked else ""
        self._ended(job.id, before.rec, unchecked)
        return True

    def _ended(self, job_id: str, rec: JobRecord, unchecked: str = "") -> None:
        """Say and resolve a job ended before: ``rec`` a dead letter, degraded, or done
        (its outputs stored, or ``unchecked`` saying why they were not checked)."""
        if rec.state == State.FAILED_FATAL:
            self.scope.report(
                f"job {job_id}: dead-lettered earlier ({rec.reason}); requeue it to run again"
            )
            self.scope.resolve("dead_lettered", job_id)
        elif rec.state == State.DEGRADED:
            self.scope.report(
                f"job {job_id}: degraded earlier ({rec.reason}), nothing posted; "
                "requeue it to render again"
            )
            self.scope.resolve("degraded", job_id)
        else:
            self.scope.report(f"job {job_id}: already done, nothing posted{unchecked}")
            self.scope.resolve("done", job_id)

    async def _done_before(self, job: Job, rec: JobRecord) -> tuple[str, JobRecord] | None:
        """``job`` is done in the store (``rec``): None when its files are stored (it
        is resolved, nothing posted; also when the store's files do not answer); else it is reopened to fetch them again (a catch-up
        from the server's /history first) and claimed anew: that claim's (status,
        record)."""
        unchecked = ""
        try:
            problem = await self.scope.threads.call(
                outputs_problem, self.scope.store, self.scope.partition, job.id
            )
        except FileStoreUnavailable as e:
            # Its done record was written only once the store confirmed every output: a
            # store that does not answer now says nothing against them.
            problem, unchecked = None, f" (its outputs not checked: {e})"
        if problem is None:
            self._ended(job.id, rec, unchecked)
            return None
        try:
            await self.scope.threads.call(
                self.scope.store.transition,
                job.id,
                "pending",
                detail=f"outputs {problem}; fetching again",
            )
            self.scope.report(f"job {job.id}: outputs {problem}; fetching them again")
        except InvalidTransition:
            pass  # another worker reopened it a moment ago: claim decides who fetches
        status, rec = await self.scope.claims.claim(job.id, job.prompt_id)
        if status == "done":  # and that worker has already fetched them
            self.scope.report(f"job {job.id}: already done, nothing posted")
            self.scope.resolve("done", job.id)
            return None
        return status, rec
