"""The ``Store``: jobs, claims, transitions, done records, dead letters, server leases.

Every method is one short transaction, safe when many processes share the database:
SQLite write transactions start with ``BEGIN IMMEDIATE`` (one writer at a time),
PostgreSQL rows are locked with ``SELECT ... FOR UPDATE``, and every UPDATE repeats what
it read in its WHERE clause (compare-and-set) and checks the rowcount. Server leases are
one atomic upsert. Times are epoch seconds; every time-dependent method takes ``now``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import sqlalchemy as sa

from comfy_assets.events import Event, log_event
from comfy_assets.jobfile import Job
from comfy_assets.states import (
    DONE,
    FAILED_FATAL,
    PENDING,
    SUBMITTED,
    State,
    check_transition,
    is_allowed,
)
from comfy_assets.store import statements as q
from comfy_assets.store.records import (
    AttemptEntry,
    AttemptRecord,
    ClaimLost,
    ClaimStatus,
    FileRecord,
    JobRecord,
    OutputFileLike,
    RegisterResult,
    ServerLease,
    UnknownJob,
)
from comfy_assets.store.register import register
from comfy_assets.store.retry import (
    RETRYING,
    AlreadyApplied,
    mark_commit_unknown,
    mark_connecting,
    retried,
)
from comfy_assets.store.schema import (
    READ_ONLY,
    attempts_table,
    create_tables,
    events_table,
    files_table,
    jobs_table,
    make_engine,
    pool_waiters_table,
    server_leases_table,
)

J = q.J
OUTCOMES = ("success", "transient", "permanent")
# Columns transition() may set besides state; anything else is a caller's typo.
TRANSITION_FIELDS = frozenset(
    {
        "prompt_id",
        "number",
        "reason",
        "seconds",
        "queue_wait_s",
        "gpu_seconds",
        "attempts",
        "first_submitted_at",
        "finished_at",
    }
)
_TERMINAL = DONE | {FAILED_FATAL}
# The store's database URL from the environment, for every command and the Dagster
# resource: a password there does not show in `ps` as a --db-url would.
DB_URL_ENV = "COMFY_ASSETS_DB_URL"


class Store:
    """Jobs and their history in SQLite (``<root>/store.db``) or PostgreSQL (``db_url``
    such as ``postgresql+psycopg://postgres@127.0.0.1/db``); creates missing tables.

    ``root`` also holds the outputs (``job_dir``). Make one Store per process (a new one
    after fork); threads may share it. A call whose database connection is lost is tried
    again for ``retry_s`` seconds, then raises StoreUnavailable (``store.retry``).
    """

    def __init__(self, root: Path, db_url: str | None = None, *, retry_s: float = 30.0) -> None:
        self.root = Path(root)
        self.retry_s = retry_s  # how long a call that loses its connection is tried again
        if db_url is None:
            self.root.mkdir(parents=True, exist_ok=True)
            db_url = f"sqlite:///{self.root / 'store.db'}"
        self.engine = make_engine(db_url)
        self.dialect = self.engine.dialect.name
        create_tables(self.engine)

    def close(self) -> None:
        """Close pooled connections."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def job_dir(self, partition: str, job_id: str) -> Path:
        """``<root>/<partition>/<job id>/`` (not created). Raises ValueError for a name
        that would leave the root (empty, ".", "..", or holding a slash)."""
        return self.root / _safe_name(partition, "partition") / _safe_name(job_id, "job id")

    # --- registration --------------------------------------------------------------

    @retried
    def register_jobs(
        self, partition: str, jobs: Sequence[Job], *, now: float | None = None
    ) -> RegisterResult:
        """Record ``jobs`` (a job file's, say) under ``partition``, in one transaction.

        New jobs start pending (event "registered"). A known job with the same
        prompt_id keeps its state: a done job stays done (shot, line and flags are
        refreshed). A known job whose prompt_id changed (its inputs changed) goes back to
        pending with attempts 0 and no claim (event "inputs changed"); one in flight
        passes through failed_retryable first, so its old attempt cannot finish it.
        Raises PartitionConflict if an id is registered in another partition, ValueError
        for an id given twice or a bad partition name.
        """
        _safe_name(partition, "partition")
        now = _now(now)
        with self._write() as conn:
            result, events = register(conn, self.dialect, partition, jobs, now)
            events = self._insert_events(conn, events)
        for event in events:
            log_event(event)
        return result

    # --- claims --------------------------------------------------------------------

    def claim(
        self,
        job_id: str,
        owner: str,
        lease_s: float = 3600.0,
        now: float | None = None,
        *,
        dead_holder: str | None = None,
    ) -> ClaimStatus:
        """Try to take ``job_id`` for ``owner`` until ``now + lease_s`` (seconds).

        CLAIMED if it was free, expired (taken over: an event names the old owner) or
        already ours (the lease is extended); HELD if another owner's claim is live;
        DONE for succeeded/degraded; DEAD_LETTERED for failed_fatal. ``dead_holder``: an
        owner known to be dead (a process of this host that no longer runs), whose claim
        is taken over as if expired. Raises UnknownJob.
        """
        return self.claim_job(job_id, owner, lease_s, now, dead_holder=dead_holder)[0]

    @retried
    def claim_job(
        self,
        job_id: str,
        owner: str,
        lease_s: float = 3600.0,
        now: float | None = None,
        *,
        dead_holder: str | None = None,
    ) -> tuple[ClaimStatus, JobRecord]:
        """``claim``, and the job's record as the claim left it, in one transaction (a
        runner needs both before it posts: one read less on the way to the GPU)."""
        now = _now(now)
        event = None
        with self._write() as conn:
            row = self._lock(conn, job_id)
            record = _job_record(row)
            if row.state in DONE:
                return ClaimStatus.DONE, record
            if row.state == FAILED_FATAL:
                return ClaimStatus.DEAD_LETTERED, record
            holder = row.claimed_by
            live = row.claim_expires_at is not None and row.claim_expires_at > now
            live = live and not (dead_holder is not None and holder == dead_holder)
            if holder not in (None, owner) and live:
                return ClaimStatus.HELD, record
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
                detail = f"claim taken over from {holder}"
                event = _event(now, row, row.state, detail)
                event = self._insert_events(conn, [event])[0]
        if event:
            log_event(event)
        claimed = dataclasses.replace(
            record, claimed_by=owner, claim_expires_at=now + lease_s, updated_at=now
        )
        return ClaimStatus.CLAIMED, claimed

    @retried
    def renew_claim(
        self, job_id: str, owner: str, lease_s: float = 3600.0, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s claim to ``now + lease_s``. False if lost (released, taken
        over, or the job finished). An expired claim nobody took over is renewed."""
        now = _now(now)
        params = {"b_id": job_id, "b_owner": owner, "v_expires": now + lease_s, "v_now": now}
        with self._write() as conn:
            return conn.execute(q.RENEW_CLAIM, params).rowcount == 1

    @retried
    def release_claim(self, job_id: str, owner: str) -> bool:
        """Drop ``owner``'s claim. False, and nothing changes, if ``owner`` lacks it."""
        with self._write() as conn:
            return conn.execute(q.RELEASE_CLAIM, {"b_id": job_id, "b_owner": owner}).rowcount == 1

    # --- transitions ---------------------------------------------------------------

    @retried
    def transition(
        self,
        job_id: str,
        to_state: str,
        *,
        owner: str | None = None,
        server: str | None = None,
        attempt: int | None = None,
        detail: str | None = None,
        now: float | None = None,
        tried: AttemptEntry | None = None,
        from_state: str | None = None,
        **fields: Any,
    ) -> None:
        """Move ``job_id`` to ``to_state``; write an event row and a JSON log line.
        ``tried``: the attempt that led here, recorded in the same transaction.
        ``from_state`` (with ``owner``): the state the caller knows the job is in. On
        PostgreSQL a move to a state that is neither pending nor final is then one
        statement, one round trip (this is on the way to every POST); a job not in that
        state or not ``owner``'s goes the checked way below, which raises.

        Checked against the state in the database. ``fields`` sets other columns
        (TRANSITION_FIELDS: prompt_id, number, reason, seconds, attempts, ...); ``server``
        is stored on the job and, with ``attempt``, in the event. The first submission
        stamps ``first_submitted_at``; succeeded, degraded and failed_fatal stamp
        ``finished_at`` and drop the claim. With ``owner``, the caller must hold the
        claim. Raises InvalidTransition, UnknownJob, ClaimLost, TypeError (unknown field).
        """
        unknown = set(fields) - TRANSITION_FIELDS
        if unknown:
            raise TypeError(f"transition() got unknown fields: {', '.join(sorted(unknown))}")
        to = str(to_state)
        now = _now(now)
        fast = (
            self.dialect == "postgresql"
            and from_state is not None
            and owner is not None
            and tried is None
            and to not in _TERMINAL
            and to != PENDING
            and is_allowed(from_state, to)
        )
        if fast:
            assert from_state is not None and owner is not None
            event = self._move_in_one(
                job_id, from_state, to, owner, server, attempt, detail, now, fields
            )
            if event is not None:
                log_event(event)
                return
        tried_row = None if tried is None else _attempt_row(job_id, tried, now)
        with self._write() as conn:
            row = self._locked_for_move(conn, job_id, owner, to, tried_row, now)
            values: dict[str, Any] = {"state": to, "updated_at": now}
            if server is not None:
                values["server"] = server
            if to == SUBMITTED and row.first_submitted_at is None:
                values["first_submitted_at"] = now
            if to in _TERMINAL:
                values.update(finished_at=now, claimed_by=None, claim_expires_at=None)
            elif to == PENDING:
                values["finished_at"] = None
            values.update(fields)
            self._update(conn, row, values)
            event = _event(now, row, to, detail, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    @retried
    def record_attempt(
        self,
        job_id: str,
        attempt: int,
        *,
        outcome: str,
        server: str | None = None,
        prompt_id: str | None = None,
        number: int | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
        seconds: float | None = None,
        queue_wait_s: float | None = None,
        gpu_seconds: float | None = None,
        reason: str | None = None,
        now: float | None = None,
    ) -> None:
        """Record try number ``attempt`` (1-based) of ``job_id``; the same number again
        replaces the row. ``outcome``: "success", "transient" or "permanent".

        ``ended_at`` defaults to ``now``; ``seconds`` (wall, queue included) to
        ended_at - started_at; ``started_at`` to ended_at - seconds. ``gpu_seconds``
        (time the prompt ran) is kept as given. The job's ``attempts`` becomes at least
        ``attempt``. Raises UnknownJob, ValueError (unknown outcome, no duration).
        """
        entry = AttemptEntry(
            attempt,
            outcome,
            server=server,
            prompt_id=prompt_id,
            number=number,
            started_at=started_at,
            ended_at=ended_at,
            seconds=seconds,
            queue_wait_s=queue_wait_s,
            gpu_seconds=gpu_seconds,
            reason=reason,
        )
        now = _now(now)
        row = _attempt_row(job_id, entry, now)
        with self._write() as conn:
            self._write_attempt(conn, row, now)

    @retried
    def mark_done(
        self,
        job_id: str,
        owner: str,
        state: str = "succeeded",
        files: Sequence[OutputFileLike] = (),
        *,
        seconds: float | None = None,
        queue_wait_s: float | None = None,
        gpu_seconds: float | None = None,
        server: str | None = None,
        attempt: int | None = None,
        number: int | None = None,
        reason: str | None = None,
        detail: str | None = None,
        now: float | None = None,
        tried: AttemptEntry | None = None,
    ) -> None:
        """Finish ``job_id`` as succeeded or degraded, all in ONE transaction: its files
        (paths relative to the job dir, with sha256 and bytes; they replace earlier
        ones), totals, the transition and its event, the claim released, and ``tried``
        (the last attempt's row, counted in the totals).

        Totals default from the job and its attempts: ``seconds`` = now -
        first_submitted_at, ``queue_wait_s`` = sum of waits, ``gpu_seconds`` = sum of
        the attempts' (else their seconds minus waits). ``reason`` says why a job is
        degraded. Raises ClaimLost unless ``owner`` holds the claim, InvalidTransition,
        UnknownJob, ValueError (state not done, file path outside the job dir).
        """
        if state not in DONE:
            raise ValueError(f"mark_done state must be succeeded or degraded, got {state!r}")
        rows = [_file_row(job_id, f) for f in files]
        now = _now(now)
        tried_row = None if tried is None else _attempt_row(job_id, tried, now)
        with self._write() as conn:
            row = self._locked_for_move(conn, job_id, owner, state, tried_row, now)
            if seconds is None or queue_wait_s is None or gpu_seconds is None:
                n, total, waited, ran = conn.execute(q.TOTALS, {"b_id": job_id}).one()
                if seconds is None:
                    started = row.first_submitted_at
                    seconds = total if started is None else now - started
                queue_wait_s = waited if queue_wait_s is None else queue_wait_s
                gpu_seconds = (ran if n else None) if gpu_seconds is None else gpu_seconds
            values: dict[str, Any] = {
                "state": str(state),
                "finished_at": now,
                "updated_at": now,
                "claimed_by": None,
                "claim_expires_at": None,
                "reason": reason,
                "seconds": seconds,
                "queue_wait_s": queue_wait_s,
                "gpu_seconds": gpu_seconds,
            }
            for name, value in (("server", server), ("attempts", attempt), ("number", number)):
                if value is not None:
                    values[name] = value
            self._update(conn, row, values)
            conn.execute(q.DELETE_FILES, {"b_id": job_id})
            if rows:
                conn.execute(q.INSERT_FILES, [{**r, "prompt_id": row.prompt_id} for r in rows])
            text = detail or (f"{len(rows)} file" + ("" if len(rows) == 1 else "s"))
            if reason and not detail:
                text += f"; {reason}"
            event = _event(now, row, state, text, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    @retried
    def dead_letter(
        self,
        job_id: str,
        owner: str,
        reason: str,
        *,
        server: str | None = None,
        attempt: int | None = None,
        now: float | None = None,
        tried: AttemptEntry | None = None,
    ) -> None:
        """Give up on ``job_id``: failed_fatal with ``reason``, claim freed, ``tried``
        (the last attempt's row) recorded, in one transaction. Raises ClaimLost unless
        ``owner`` holds the claim, InvalidTransition (a done job, say), UnknownJob."""
        now = _now(now)
        tried_row = None if tried is None else _attempt_row(job_id, tried, now)
        with self._write() as conn:
            row = self._locked_for_move(conn, job_id, owner, FAILED_FATAL, tried_row, now)
            values: dict[str, Any] = {
                "state": FAILED_FATAL.value,
                "reason": reason,
                "finished_at": now,
                "updated_at": now,
                "claimed_by": None,
                "claim_expires_at": None,
            }
            if server is not None:
                values["server"] = server
            self._update(conn, row, values)
            event = _event(now, row, FAILED_FATAL, reason, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    @retried
    def note(
        self,
        job_id: str,
        detail: str,
        *,
        server: str | None = None,
        attempt: int | None = None,
        now: float | None = None,
    ) -> None:
        """Write an event that changes nothing (``from_state == to_state``): something a
        worker did to a job it no longer holds, say. Raises UnknownJob."""
        now = _now(now)
        with self._write() as conn:
            row = self._lock(conn, job_id)
            event = _event(now, row, row.state, detail, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    @retried
    def requeue(self, job_id: str, now: float | None = None) -> bool:
        """Send a dead-lettered job back to pending (reason cleared, attempts 0).
        False, and nothing changes, if it is not failed_fatal or not in the store."""
        now = _now(now)
        with self._write() as conn:
            row = conn.execute(q.LOCK_JOB, {"b_id": job_id}).first()
            if row is None or row.state != FAILED_FATAL:
                return False
            values = {
                "state": PENDING.value,
                "reason": None,
                "attempts": 0,
                "attempts_before": row.attempts_before + row.attempts,
                "finished_at": None,
                "updated_at": now,
            }
            self._update(conn, row, values)
            event = self._insert_events(conn, [_event(now, row, PENDING, "requeued")])[0]
        log_event(event)
        return True

    # --- reading -------------------------------------------------------------------

    @retried
    def get(self, job_id: str) -> JobRecord | None:
        """The job's row, or None if unknown."""
        with self._read() as conn:
            row = conn.execute(q.SELECT_JOB, {"b_id": job_id}).first()
        return None if row is None else _job_record(row)

    @retried
    def jobs(self, partition: str) -> list[JobRecord]:
        """Jobs of ``partition`` by shot (jobs without one last), then line."""
        stmt = (
            sa.select(jobs_table)
            .where(J.partition == partition)
            .order_by(sa.nulls_last(J.shot.asc()), J.line, J.job_id)
        )
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    @retried
    def files(self, job_id: str) -> list[FileRecord]:
        """Files of the job's done record, by path."""
        t = files_table.c
        stmt = sa.select(files_table).where(t.job_id == job_id).order_by(t.path)
        with self._read() as conn:
            return [FileRecord(**r._mapping) for r in conn.execute(stmt)]

    @retried
    def attempts(self, job_id: str) -> list[AttemptRecord]:
        """Tries of the job, by attempt number."""
        t = attempts_table.c
        stmt = sa.select(attempts_table).where(t.job_id == job_id).order_by(t.attempt)
        with self._read() as conn:
            return [AttemptRecord(**r._mapping) for r in conn.execute(stmt)]

    @retried
    def events(
        self,
        job_id: str | None = None,
        partition: str | None = None,
        *,
        shot: int | None = None,
    ) -> list[Event]:
        """Events, oldest first, of one job, partition and/or shot number:
        ``events(partition="film", shot=17)`` tells what happened to shot 17."""
        t = events_table.c
        stmt = sa.select(events_table).order_by(t.id)
        if job_id is not None:
            stmt = stmt.where(t.job_id == job_id)
        if partition is not None:
            stmt = stmt.where(t.partition == partition)
        if shot is not None:
            stmt = stmt.join(jobs_table, J.job_id == t.job_id).where(J.shot == shot)
        with self._read() as conn:
            return [Event(**r._mapping) for r in conn.execute(stmt)]

    @retried
    def dead_letters(self, partition: str | None = None) -> list[JobRecord]:
        """failed_fatal jobs, of one partition or all, by partition, shot, line."""
        stmt = (
            sa.select(jobs_table)
            .where(J.state == FAILED_FATAL.value)
            .order_by(J.partition, sa.nulls_last(J.shot.asc()), J.line, J.job_id)
        )
        if partition is not None:
            stmt = stmt.where(J.partition == partition)
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    @retried
    def counts(self, partition: str) -> dict[str, int]:
        """Jobs of ``partition`` per state; every state is present (0 if none)."""
        stmt = sa.select(J.state, sa.func.count()).where(J.partition == partition).group_by(J.state)
        counts = {s.value: 0 for s in State}
        with self._read() as conn:
            counts.update({state: n for state, n in conn.execute(stmt)})
        return counts

    @retried
    def partitions(self) -> list[str]:
        """Partitions that have jobs, sorted."""
        stmt = sa.select(J.partition).distinct().order_by(J.partition)
        with self._read() as conn:
            return list(conn.execute(stmt).scalars())

    # --- server leases -------------------------------------------------------------

    @retried
    def acquire_server(
        self,
        server: str,
        owner: str,
        lease_s: float,
        prompt_id: str | None = None,
        now: float | None = None,
    ) -> bool:
        """Take ``server`` for ``owner`` until ``now + lease_s`` (seconds), only if it is
        free, expired or already ours: one atomic upsert, so two processes never hold it
        at once. True if ``owner`` holds it now."""
        now = _now(now)
        params = {
            "v_server": server,
            "v_owner": owner,
            "v_expires": now + lease_s,
            "v_prompt": prompt_id,
            "v_now": now,
        }
        with self._write() as conn:
            return conn.execute(q.acquire_server(self.dialect), params).rowcount == 1

    @retried
    def renew_server(
        self, server: str, owner: str, lease_s: float, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s lease to ``now + lease_s``; False if it is not ours now."""
        now = _now(now)
        params = {"b_server": server, "b_owner": owner, "v_expires": now + lease_s, "v_now": now}
        with self._write() as conn:
            return conn.execute(q.RENEW_SERVER, params).rowcount == 1

    @retried
    def release_server(
        self, server: str, owner: str, last_model: str | None = None, now: float | None = None
    ) -> bool:
        """Free ``server`` if ``owner`` holds it, remembering ``last_model`` (unchanged
        when None). False, and nothing changes, if ``owner`` did not hold it."""
        params = {"b_server": server, "b_owner": owner, "v_model": last_model, "v_now": _now(now)}
        with self._write() as conn:
            return conn.execute(q.RELEASE_SERVER, params).rowcount == 1

    @retried
    def server_leases(self) -> dict[str, ServerLease]:
        """Every server ever leased, by name (a released one has ``owner`` None)."""
        with self._read() as conn:
            rows = conn.execute(sa.select(server_leases_table).order_by(q.L.server))
            return {r.server: ServerLease(**r._mapping) for r in rows}

    @retried
    def mark_waiting(self, owner: str, wait_s: float, now: float | None = None) -> None:
        """Say that ``owner`` waits for a server, for the next ``wait_s`` seconds."""
        now = _now(now)
        insert = q.insert_for(self.dialect, pool_waiters_table).values(
            owner=owner, expires_at=now + wait_s
        )
        upsert = insert.on_conflict_do_update(
            index_elements=["owner"], set_={"expires_at": insert.excluded.expires_at}
        )
        with self._write() as conn:
            conn.execute(upsert)

    @retried
    def others_waiting(self, owner: str, now: float | None = None) -> bool:
        """True when another owner waits for a server now (see ``mark_waiting``)."""
        t = pool_waiters_table.c
        stmt = sa.select(t.owner).where(t.owner != owner, t.expires_at > _now(now)).limit(1)
        with self._read() as conn:
            return conn.execute(stmt).first() is not None

    # --- plumbing ------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with self._connect() as conn:
            body_done = False
            try:
                with conn.begin():
                    yield conn
                    body_done = True
            except sa.exc.DBAPIError as error:
                if body_done:  # the commit itself failed: done or not, nobody knows
                    mark_commit_unknown(error)
                raise

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        with self._connect() as conn:
            conn.execution_options(**{READ_ONLY: True})
            with conn.begin():
                yield conn

    def _connect(self) -> sa.Connection:
        try:
            return self.engine.connect()
        except sa.exc.DBAPIError as error:
            mark_connecting(error)
            raise

    def _lock(self, conn: sa.Connection, job_id: str) -> sa.Row:
        row = conn.execute(q.LOCK_JOB, {"b_id": job_id}).first()
        if row is None:
            raise UnknownJob(job_id)
        return row

    def _update(self, conn: sa.Connection, row: sa.Row, values: dict[str, Any]) -> None:
        """Set ``values`` on the job only if its state and claim are still as read."""
        stmt = q.guarded_update(tuple(sorted(values)))
        params = {f"v_{k}": v for k, v in values.items()}
        params.update(b_id=row.job_id, b_state=row.state, b_holder=row.claimed_by)
        q.expect_rows(conn.execute(stmt, params), 1, f"update job {row.job_id}")

    def _move_in_one(
        self,
        job_id: str,
        from_state: str,
        to: str,
        owner: str,
        server: str | None,
        attempt: int | None,
        detail: str | None,
        now: float,
        fields: dict[str, Any],
    ) -> Event | None:
        """``transition``'s one-statement way (PostgreSQL, autocommit); the event written,
        or None when the job is not in ``from_state`` or not ``owner``'s."""
        values: dict[str, Any] = {"state": to, "updated_at": now, **fields}
        if server is not None:
            values["server"] = server
        if to == SUBMITTED:
            values["first_submitted_at"] = now  # kept where already set (COALESCE)
        params = {f"v_{k}": v for k, v in values.items()}
        params.update(
            v_now=now,
            b_id=job_id,
            b_state=from_state,
            b_owner=owner,
            e_time=now,
            e_from=from_state,
            e_to=to,
            e_server=server,
            e_attempt=attempt,
            e_detail=detail,
        )
        stmt = q.move_and_log(tuple(sorted(values)))
        with self._connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            try:
                row = conn.execute(stmt, params).first()
            except sa.exc.DBAPIError as error:
                mark_commit_unknown(error)  # autocommit: it may have been applied
                raise
        if row is None:
            return None
        return Event(row.id, now, job_id, row.partition, from_state, to, server, attempt, detail)

    def _locked_for_move(
        self,
        conn: sa.Connection,
        job_id: str,
        owner: str | None,
        to: str,
        tried_row: dict[str, Any] | None,
        now: float,
    ) -> sa.Row:
        """The job's row, locked, once the claim (when ``owner``) and the move to ``to``
        are checked; ``tried_row`` written. Raises UnknownJob, ClaimLost,
        InvalidTransition."""
        row = self._lock(conn, job_id)
        if RETRYING.get() and str(row.state) == str(to):
            raise AlreadyApplied  # the first try's commit went through after all
        if owner is not None and row.claimed_by != owner:
            raise ClaimLost(job_id, owner, row.claimed_by)
        check_transition(row.state, to, job_id=job_id)
        if tried_row is not None:
            self._write_attempt(conn, tried_row, now)
        return row

    def _write_attempt(self, conn: sa.Connection, row: dict[str, Any], now: float) -> None:
        """The attempt row (replacing the same number) and the job's ``attempts``."""
        bump = {"b_id": row["job_id"], "b_attempt": row["attempt"], "v_now": now}
        if conn.execute(q.BUMP_ATTEMPTS, bump).rowcount != 1:
            raise UnknownJob(row["job_id"])
        conn.execute(q.upsert_attempt(self.dialect), row)

    def _insert_events(self, conn: sa.Connection, events: list[Event]) -> list[Event]:
        """Write event rows; returns the events with their ids."""
        if not events:
            return []
        rows = [e.to_dict() for e in events]
        for r in rows:
            del r["id"]
        if len(rows) == 1:
            ids = [conn.execute(q.INSERT_EVENT, rows[0]).scalar_one()]
        else:
            # Ids first, then a plain executemany: far faster than INSERT ... RETURNING
            # for the 10,000 events of a big registration.
            ids = self._event_ids(conn, len(rows))
            conn.execute(
                events_table.insert(), [{**r, "id": i} for r, i in zip(rows, ids, strict=True)]
            )
        return [dataclasses.replace(e, id=i) for e, i in zip(events, ids, strict=True)]

    def _event_ids(self, conn: sa.Connection, n: int) -> list[int]:
        if self.dialect == "postgresql":
            return sorted(conn.execute(q.NEXT_EVENT_IDS, {"n": n}).scalars())
        # SQLite: this transaction holds the write lock, so nobody else takes these ids.
        last = conn.execute(q.LAST_EVENT_ID).scalar_one()
        return list(range(last + 1, last + 1 + n))


def _now(now: float | None) -> float:
    return time.time() if now is None else now


def _safe_name(name: str, what: str) -> str:
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{what} {name!r} cannot be used as a folder name")
    if name.startswith("store.db"):  # the SQLite file and its -wal/-shm live beside them
        raise ValueError(f"{what} {name!r} would collide with the store's own database file")
    return name


def _event(
    now: float,
    row: sa.Row,
    to_state: str,
    detail: str | None = None,
    server: str | None = None,
    attempt: int | None = None,
) -> Event:
    return Event(
        id=None,
        time=now,
        job_id=row.job_id,
        partition=row.partition,
        from_state=row.state,
        to_state=str(to_state),
        server=server,
        attempt=attempt,
        detail=detail,
    )


def _attempt_row(job_id: str, entry: AttemptEntry, now: float) -> dict[str, Any]:
    """The attempts-table row of ``entry``; raises ValueError (outcome, no duration)."""
    if entry.outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {entry.outcome!r}")
    if entry.started_at is None and entry.seconds is None:
        raise ValueError(f"job {job_id} attempt {entry.attempt}: give started_at or seconds")
    ended_at = now if entry.ended_at is None else entry.ended_at
    seconds = entry.seconds
    if seconds is None:
        seconds = ended_at - entry.started_at  # type: ignore[operator]
    started_at = ended_at - seconds if entry.started_at is None else entry.started_at
    return {
        "job_id": job_id,
        "attempt": entry.attempt,
        "server": entry.server,
        "prompt_id": entry.prompt_id,
        "number": entry.number,
        "started_at": started_at,
        "ended_at": ended_at,
        "seconds": seconds,
        "queue_wait_s": entry.queue_wait_s,
        "gpu_seconds": entry.gpu_seconds,
        "outcome": entry.outcome,
        "reason": entry.reason,
    }


def _job_record(row: sa.Row) -> JobRecord:
    values = dict(row._mapping)
    values["set"] = json.loads(values.pop("set_json"))
    values["state"] = State(values["state"])
    values["optional"] = bool(values["optional"])
    return JobRecord(**values)


def _file_row(job_id: str, f: OutputFileLike) -> dict[str, Any]:
    path = PurePosixPath(f.path)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"job {job_id}: file path {str(f.path)!r} is not inside the job dir")
    if f.bytes < 0 or len(f.sha256) != 64:
        raise ValueError(f"job {job_id}: file {str(path)!r} needs a sha256 hex digest and bytes")
    return {
        "job_id": job_id,
        "path": path.as_posix(),
        "sha256": f.sha256,
        "bytes": f.bytes,
        "node_id": f.node_id,
        "key": f.key,
    }
