"""Registering a job file's jobs, and the claims on them (a lease per job, so one worker
runs it at a time)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from comfy_assets.jobs.events import log_event
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.states import (
    DONE,
    FAILED_FATAL,
    PENDING,
)
from comfy_assets.store import one_trip
from comfy_assets.store import statements as q
from comfy_assets.store.base import _event, _job_record, folder_name
from comfy_assets.store.owners import Owners, owner_of
from comfy_assets.store.records import (
    ClaimStatus,
    JobRecord,
    PartitionConflict,
    RegisterResult,
)
from comfy_assets.store.register import (
    foreign_jobs,
    register,
    register_row,
    registered_detail,
)
from comfy_assets.store.retry import (
    retried,
)


class Claims(Owners):
    """Registration and job claims (a part of ``Store``)."""

    @retried
    def check_partition(self, partition: str, job_ids: Iterable[str]) -> None:
        """Raise PartitionConflict if any of ``job_ids`` is registered under another
        partition: what ``register_jobs`` would raise, asked before a job file registered
        a chunk at a time registers its first (``job_ids`` is read once)."""
        with self._read() as conn:
            conflicts = foreign_jobs(conn, partition, job_ids)
        if conflicts:
            raise PartitionConflict(partition, conflicts)

    @retried
    def register_jobs(
        self,
        partition: str,
        jobs: Sequence[Job],
        *,
        now: float | None = None,
        forward_only: bool = False,
    ) -> RegisterResult:
        """Record ``jobs`` (a job file's, say) under ``partition``, in one transaction.

        New jobs start pending (event "registered"). A known job with the same
        prompt_id keeps its state: a done job stays done (shot, line and flags are
        refreshed). A known job whose prompt_id changed (its inputs changed) goes back to
        pending with attempts 0 and no claim (event "inputs changed"); one in flight
        passes through failed_retryable first, so its old attempt cannot finish it.
        ``forward_only``: a known job of a higher take than the given one is left as it
        is (``superseded``), compared under the rows' lock: a worker's message or an
        API request of an older take never moves a job back.
        Raises PartitionConflict if an id is registered in another partition, ValueError
        for an id given twice or a bad partition name.
        """
        folder_name(partition, "partition")
        now = self._now(now)
        with self._write() as conn:
            result, events = register(
                conn, self.dialect, partition, jobs, now, forward_only=forward_only
            )
            events = self._insert_events(conn, events)
        for event in events:
            log_event(event)
        return result

    @retried
    def register_claimed(
        self,
        partition: str,
        job: Job,
        owner: str,
        lease_s: float = 3600.0,
        *,
        now: float | None = None,
    ) -> tuple[RegisterResult, JobRecord | None]:
        """``register_jobs(partition, [job], forward_only=True)`` that also claims a
        job new to the store for ``owner`` until ``now + lease_s`` (seconds): its
        registration, claim and event in one statement on PostgreSQL, one transaction on
        SQLite. Returns what the registration did and the record of the job so claimed
        (as ``claim_job`` would return it), or None when the job was known already (then
        it is registered as ``register_jobs`` does, and not claimed). Raises what
        ``register_jobs`` raises."""
        folder_name(partition, "partition")
        now = self._now(now)
        values = {
            **register_row(job),
            "partition": partition,
            "state": PENDING.value,
            "attempts": 0,
            "attempts_before": 0,
            "claimed_by": owner,
            "claim_expires_at": now + lease_s,
            "created_at": now,
            "updated_at": now,
        }
        detail = registered_detail(job)
        if self.dialect == "postgresql":
            params = {f"v_{k}": v for k, v in values.items()}
            params.update(b_lock=f"register:{partition}", e_time=now, e_detail=detail)
            row = self._autocommit_first(one_trip.register_claimed(), params)
            event = None
            if row is not None:
                event = _event(now, row, PENDING, detail)
                event = dataclasses.replace(event, id=row.event_id, from_state=None)
        else:
            with self._write() as conn:
                row = conn.execute(q.INSERT_NEW_JOB, values).first()
                event = None
                if row is not None:
                    event = dataclasses.replace(_event(now, row, PENDING, detail), from_state=None)
                    event = self._insert_events(conn, [event])[0]
        if row is None or event is None:
            return self.register_jobs(partition, [job], now=now, forward_only=True), None
        log_event(event)
        values = {k: v for k, v in row._mapping.items() if k != "event_id"}
        return RegisterResult(inserted=[job.id], unchanged=[], changed=[]), _job_record(values)

    def claim(self, job_id: str, owner: str, *args: Any, **kwargs: Any) -> ClaimStatus:
        """``claim_job`` (the same arguments) without the record: CLAIMED if ``job_id``
        was free, expired (taken over: an event names the old owner) or already ours;
        HELD if another owner's claim is live; DONE for succeeded/degraded; DEAD_LETTERED
        for failed_fatal; CHANGED when ``prompt_id`` is given and is not the stored one.
        Raises UnknownJob."""
        return self.claim_job(job_id, owner, *args, **kwargs)[0]

    @retried
    def claim_job(
        self,
        job_id: str,
        owner: str,
        lease_s: float = 3600.0,
        now: float | None = None,
        prompt_id: str | None = None,
    ) -> tuple[ClaimStatus, JobRecord]:
        """Try to take ``job_id`` for ``owner`` until ``now + lease_s`` (seconds): the
        claim's status (see ``claim``) and the job's record as the claim left it, in one
        transaction. With ``prompt_id``, a job whose stored prompt_id is another (a newer
        take or other inputs registered since the caller's) is not claimed: CHANGED, so
        a run never renders an older prompt under a newer registration. A claim whose lease runs on is taken over all the same when its
        holder is gone (``store/owners.py``: released, or no heartbeat): the holder is
        then marked found gone, so it can never act on the job again. Raises UnknownJob."""
        now = self._now(now)
        event = None
        # The usual case, a job nobody holds: one statement (on PostgreSQL, autocommit:
        # the claim of a job free or already ours can be taken again on a retry).
        params = {
            "b_id": job_id,
            "b_prompt": prompt_id,
            "v_owner": owner,
            "v_expires": now + lease_s,
            "v_now": now,
        }
        if self.dialect == "postgresql":
            claimed = self._autocommit_first(q.CLAIM_FREE, params)
            if claimed is not None:
                return ClaimStatus.CLAIMED, _job_record(claimed)
        with self._write() as conn:
            claimed = conn.execute(q.CLAIM_FREE, params).first()
            if claimed is not None:
                return ClaimStatus.CLAIMED, _job_record(claimed)
            row = self._lock(conn, job_id)
            record = _job_record(row)
            if prompt_id is not None and row.prompt_id != prompt_id:
                return ClaimStatus.CHANGED, record
            if row.state in DONE:
                return ClaimStatus.DONE, record
            if row.state == FAILED_FATAL:
                return ClaimStatus.DEAD_LETTERED, record
            holder = row.claimed_by
            live = row.claim_expires_at is not None and row.claim_expires_at > now
            gone = None
            if holder not in (None, owner) and live:
                gone = self._gone_reason(conn, owner_of(holder), lock=True)
                if gone is None:
                    return ClaimStatus.HELD, record
                self._mark_gone(conn, owner_of(holder))
            params = {
                "b_id": job_id,
                "b_state": row.state,
                "b_holder": holder,
                "v_owner": owner,
                "v_expires": now + lease_s,
                "v_now": now,
            }
            q.expect_rows(conn.execute(q.CLAIM, params), 1, f"claim job {job_id}")
            if holder not in (None, owner):
                why = f"its holder is gone: {gone}" if gone else "its lease expired"
                detail = f"claim taken over from {holder} ({why})"
                event = _event(now, row, row.state, detail)
                event = self._insert_events(conn, [event])[0]
        if event:
            log_event(event)
        taken = dataclasses.replace(
            record,
            claimed_by=owner,
            claim_expires_at=now + lease_s,
            updated_at=now,
            taken_over=event.detail if event else None,
        )
        return ClaimStatus.CLAIMED, taken

    @retried
    def renew_claim(
        self, job_id: str, owner: str, lease_s: float = 3600.0, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s claim to ``now + lease_s``. False if lost (released, taken
        over, or the job finished). An expired claim nobody took over is renewed."""
        now = self._now(now)
        params = {"b_id": job_id, "b_owner": owner, "v_expires": now + lease_s, "v_now": now}
        return self._write_one(q.RENEW_CLAIM, params) == 1

    @retried
    def release_claim(self, job_id: str, owner: str) -> bool:
        """Drop ``owner``'s claim. False, and nothing changes, if ``owner`` lacks it."""
        return self._write_one(q.RELEASE_CLAIM, {"b_id": job_id, "b_owner": owner}) == 1
