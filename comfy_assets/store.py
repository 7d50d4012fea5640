"""Result store: jobs, claims, server leases, done records, dead letters and events.

SQLite (``<root>/store.db``, WAL) by default, PostgreSQL by URL, the same code for both.
Every method is one short transaction and safe when many processes share the database:
SQLite write transactions start with ``BEGIN IMMEDIATE`` (one writer at a time, no lock
upgrade deadlocks), PostgreSQL rows are locked with ``SELECT ... FOR UPDATE``, and every
UPDATE repeats what it read in its WHERE clause (compare-and-set) and checks the rowcount.

Times are seconds since the epoch (floats); every time-dependent method takes ``now``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from comfy_assets.events import Event, log_event
from comfy_assets.jobfile import Job
from comfy_assets.states import (
    DONE,
    FAILED_FATAL,
    FAILED_RETRYABLE,
    IN_FLIGHT,
    PENDING,
    SUBMITTED,
    State,
    check_transition,
)

# --- schema -------------------------------------------------------------------------

metadata = sa.MetaData()

jobs_table = sa.Table(
    "jobs",
    metadata,
    sa.Column("job_id", sa.String(36), primary_key=True),
    sa.Column("partition", sa.String(255), nullable=False),
    sa.Column("line", sa.Integer, nullable=False),  # order within the job file
    sa.Column("prompt_id", sa.String(36), nullable=False),
    sa.Column("shot", sa.Integer),
    sa.Column("optional", sa.Boolean, nullable=False),
    sa.Column("duration_s", sa.Double),
    sa.Column("set_json", sa.Text, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("server", sa.String(255)),
    sa.Column("number", sa.Integer),
    sa.Column("reason", sa.Text),
    sa.Column("claimed_by", sa.String(255)),
    sa.Column("claim_expires_at", sa.Double),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Column("first_submitted_at", sa.Double),
    sa.Column("finished_at", sa.Double),
    sa.Column("seconds", sa.Double),
    sa.Column("queue_wait_s", sa.Double),
    sa.Column("gpu_seconds", sa.Double),
    sa.Index("ix_jobs_partition_state", "partition", "state"),
)

attempts_table = sa.Table(
    "attempts",
    metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.job_id"), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("server", sa.String(255)),
    sa.Column("prompt_id", sa.String(36)),
    sa.Column("number", sa.Integer),
    sa.Column("started_at", sa.Double, nullable=False),
    sa.Column("ended_at", sa.Double, nullable=False),
    sa.Column("seconds", sa.Double, nullable=False),
    sa.Column("queue_wait_s", sa.Double),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
)

files_table = sa.Table(
    "files",
    metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.job_id"), primary_key=True),
    sa.Column("path", sa.Text, primary_key=True),  # relative to the job dir, "/" separated
    sa.Column("prompt_id", sa.String(36), nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("node_id", sa.String(64)),
    sa.Column("key", sa.String(64)),
)

events_table = sa.Table(
    "events",
    metadata,
    sa.Column(
        "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True
    ),  # SQLite only auto-increments INTEGER PRIMARY KEY
    sa.Column("time", sa.Double, nullable=False),
    sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.job_id"), nullable=False),
    sa.Column("partition", sa.String(255), nullable=False),
    sa.Column("from_state", sa.String(20)),
    sa.Column("to_state", sa.String(20), nullable=False),
    sa.Column("server", sa.String(255)),
    sa.Column("attempt", sa.Integer),
    sa.Column("detail", sa.Text),
    sa.Index("ix_events_job_id", "job_id"),
    sa.Index("ix_events_partition", "partition"),
)

server_leases_table = sa.Table(
    "server_leases",
    metadata,
    sa.Column("server", sa.String(255), primary_key=True),
    sa.Column("owner", sa.String(255)),
    sa.Column("expires_at", sa.Double),
    sa.Column("prompt_id", sa.String(36)),
    sa.Column("last_model", sa.Text),
    sa.Column("updated_at", sa.Double, nullable=False),
)

J = jobs_table.c
L = server_leases_table.c
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
_CHUNK = 500  # ids per IN (...): well under SQLite's and PostgreSQL's parameter limits
_READ_ONLY = "comfy_assets_read_only"
_TERMINAL = DONE | {FAILED_FATAL}


# --- records and errors ---------------------------------------------------------------


class ClaimStatus(StrEnum):
    """Answer of ``Store.claim``; members compare equal to their strings."""

    CLAIMED = "claimed"  # the caller holds the job now
    HELD = "held"  # another owner holds a live claim
    DONE = "done"  # succeeded or degraded: nothing to do
    DEAD_LETTERED = "dead_lettered"  # failed_fatal: needs a requeue


@dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs``. Times in epoch seconds; durations in seconds.

    ``seconds`` is the job's total wall time, ``queue_wait_s`` the time its prompts waited
    in ComfyUI's queue, ``gpu_seconds`` the time they ran (all attempts).
    """

    job_id: str
    partition: str
    line: int
    prompt_id: str
    shot: int | None
    optional: bool
    duration_s: float | None
    set: dict[str, Any]
    state: State
    attempts: int
    server: str | None
    number: int | None
    reason: str | None
    claimed_by: str | None
    claim_expires_at: float | None
    created_at: float
    updated_at: float
    first_submitted_at: float | None
    finished_at: float | None
    seconds: float | None
    queue_wait_s: float | None
    gpu_seconds: float | None

    @property
    def done(self) -> bool:
        """True for succeeded and degraded."""
        return self.state in DONE


@dataclass(frozen=True)
class OutputFile:
    """A file to record with a done job: ``path`` relative to the job dir, size in bytes.

    ``node_id`` / ``key`` say which output produced it (node "9", key "images").
    """

    path: str | PurePosixPath
    sha256: str
    bytes: int
    node_id: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class FileRecord:
    """One row of ``files``: an output of ``prompt_id`` (path relative to the job dir)."""

    job_id: str
    prompt_id: str
    path: str
    sha256: str
    bytes: int
    node_id: str | None
    key: str | None


@dataclass(frozen=True)
class AttemptRecord:
    """One try of a job on one server. ``seconds`` = ended_at - started_at (queue included).

    ``outcome`` is "success", "transient" (may be retried) or "permanent".
    """

    job_id: str
    attempt: int
    server: str | None
    prompt_id: str | None
    number: int | None
    started_at: float
    ended_at: float
    seconds: float
    queue_wait_s: float | None
    outcome: str
    reason: str | None


@dataclass(frozen=True)
class ServerLease:
    """Who holds a GPU server and until when. ``owner`` is None once released;
    ``last_model`` survives the release (model affinity)."""

    server: str
    owner: str | None
    expires_at: float | None
    prompt_id: str | None
    last_model: str | None
    updated_at: float

    def held(self, now: float | None = None) -> bool:
        """True if an owner holds it at ``now`` (epoch seconds)."""
        now = time.time() if now is None else now
        return self.owner is not None and self.expires_at is not None and self.expires_at > now


@dataclass(frozen=True)
class RegisterResult:
    """Job ids sorted into what ``register_jobs`` did with them."""

    inserted: list[str]
    unchanged: list[str]
    changed: list[str]  # inputs changed: reset to pending, attempts 0


class UnknownJob(LookupError):
    """No job with that id in the store."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: not in the store")
        self.job_id = job_id


class ClaimLost(RuntimeError):
    """The caller does not hold the job's claim (never had it, released, or taken over)."""

    def __init__(self, job_id: str, owner: str, holder: str | None) -> None:
        held = f"held by {holder}" if holder else "not held by anyone"
        super().__init__(f"job {job_id}: claim lost by {owner}, now {held}")
        self.job_id = job_id
        self.owner = owner
        self.holder = holder


class PartitionConflict(ValueError):
    """Job ids already registered under another partition (ids are global)."""

    def __init__(self, partition: str, conflicts: dict[str, str]) -> None:
        shown = ", ".join(f"{j} (in {p!r})" for j, p in sorted(conflicts.items())[:5])
        more = f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""
        super().__init__(
            f"cannot register in partition {partition!r}: job ids already in another "
            f"partition: {shown}{more}"
        )
        self.conflicts = conflicts


class StoreConflict(RuntimeError):
    """A guarded UPDATE matched no row although its row was locked: a bug, not a race."""


# --- the store ------------------------------------------------------------------------


class Store:
    """Jobs and their history in SQLite (``<root>/store.db``) or PostgreSQL (``db_url``,
    e.g. ``postgresql+psycopg://user@host/db``). Creates missing tables.

    ``root`` also holds the outputs: ``job_dir(partition, job_id)``. Use one Store per
    process (after fork, make a new one); it is safe to share between threads.
    """

    def __init__(self, root: Path, db_url: str | None = None) -> None:
        self.root = Path(root)
        if db_url is None:
            self.root.mkdir(parents=True, exist_ok=True)
            db_url = f"sqlite:///{self.root / 'store.db'}"
        self.engine = _make_engine(db_url)
        self._pg = self.engine.dialect.name == "postgresql"
        with self.engine.begin() as conn:
            if self._pg:
                # create_all is check-then-create: serialise concurrent first starts.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7202411)"))
            metadata.create_all(conn)

    def close(self) -> None:
        """Close pooled connections."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def job_dir(self, partition: str, job_id: str) -> Path:
        """``<root>/<partition>/<job id>/`` (not created). Raises ValueError for a name
        that would escape the root (empty, ".", "..", or containing a slash)."""
        return self.root / _safe_name(partition, "partition") / _safe_name(job_id, "job id")

    # --- registration --------------------------------------------------------------

    def register_jobs(
        self, partition: str, jobs: Sequence[Job], *, now: float | None = None
    ) -> RegisterResult:
        """Record ``jobs`` under ``partition`` in one transaction.

        New jobs start pending. A known job with the same prompt_id keeps its state (a
        done job stays done; shot, line and flags are refreshed). A known job whose
        prompt_id changed (its inputs changed) goes back to pending with attempts 0 and
        its claim dropped; an in-flight one first passes through failed_retryable, so its
        old attempt can no longer finish it. Raises ``PartitionConflict`` if an id is
        registered in another partition, ValueError for an id given twice.
        """
        _safe_name(partition, "partition")
        now = _now(now)
        by_id: dict[str, Job] = {}
        for job in jobs:
            if job.id in by_id:
                raise ValueError(f"job {job.id} given twice to register_jobs")
            by_id[job.id] = job
        logged: list[Event] = []
        with self._write() as conn:
            known = self._lock_rows(conn, list(by_id))
            conflicts = {j: r.partition for j, r in known.items() if r.partition != partition}
            if conflicts:
                raise PartitionConflict(partition, conflicts)
            inserted = self._insert_new(conn, partition, by_id, known, now)
            if len(inserted) < len(by_id) - len(known):
                # Another process inserted some of them meanwhile (PostgreSQL): treat those
                # as known, now that its transaction has committed.
                done = set(inserted) | known.keys()
                known.update(self._lock_rows(conn, [j for j in by_id if j not in done]))
            changed = [j for j, r in known.items() if r.prompt_id != by_id[j].prompt_id]
            unchanged = [j for j, r in known.items() if r.prompt_id == by_id[j].prompt_id]
            events = [
                _event(now, j, partition, None, PENDING, detail="registered") for j in inserted
            ]
            events += self._reset_changed(conn, partition, changed, by_id, known, now)
            self._refresh_metadata(conn, [by_id[j] for j in unchanged], known, now)
            logged = self._insert_events(conn, events)
        for e in logged:
            log_event(e)
        return RegisterResult(inserted=inserted, unchanged=unchanged, changed=changed)

    def _lock_rows(self, conn: sa.Connection, job_ids: list[str]) -> dict[str, sa.Row]:
        found: dict[str, sa.Row] = {}
        for i in range(0, len(job_ids), _CHUNK):
            stmt = (
                sa.select(jobs_table).where(J.job_id.in_(job_ids[i : i + _CHUNK])).with_for_update()
            )
            found.update((r.job_id, r) for r in conn.execute(stmt))
        return found

    def _insert_new(
        self,
        conn: sa.Connection,
        partition: str,
        by_id: dict[str, Job],
        known: dict[str, sa.Row],
        now: float,
    ) -> list[str]:
        rows = [
            {
                "job_id": job.id,
                "partition": partition,
                "line": job.line,
                "prompt_id": job.prompt_id,
                "shot": job.shot,
                "optional": job.optional,
                "duration_s": job.duration_s,
                "set_json": _set_json(job.set),
                "state": PENDING.value,
                "attempts": 0,
                "created_at": now,
                "updated_at": now,
            }
            for job in by_id.values()
            if job.id not in known
        ]
        if not rows:
            return []
        stmt = self._insert(jobs_table).on_conflict_do_nothing().returning(J.job_id)
        inserted = {r.job_id for r in conn.execute(stmt, rows)}
        return [row["job_id"] for row in rows if row["job_id"] in inserted]

    def _reset_changed(
        self,
        conn: sa.Connection,
        partition: str,
        changed: list[str],
        by_id: dict[str, Job],
        known: dict[str, sa.Row],
        now: float,
    ) -> list[Event]:
        if not changed:
            return []
        events: list[Event] = []
        params = []
        for job_id in changed:
            job, old = by_id[job_id], known[job_id]
            if old.state in IN_FLIGHT:
                events.append(
                    _event(
                        now,
                        job_id,
                        partition,
                        old.state,
                        FAILED_RETRYABLE,
                        detail="inputs changed while in flight; attempt abandoned",
                    )
                )
                events.append(
                    _event(now, job_id, partition, FAILED_RETRYABLE, PENDING, "inputs changed")
                )
            else:
                events.append(_event(now, job_id, partition, old.state, PENDING, "inputs changed"))
            params.append({"b_id": job_id, "b_old": old.prompt_id, **_metadata(job)})
            params[-1]["b_prompt"] = job.prompt_id
        stmt = (
            jobs_table.update()
            .where(J.job_id == sa.bindparam("b_id"), J.prompt_id == sa.bindparam("b_old"))
            .values(
                prompt_id=sa.bindparam("b_prompt"),
                state=PENDING.value,
                attempts=0,
                reason=None,
                server=None,
                number=None,
                claimed_by=None,
                claim_expires_at=None,
                first_submitted_at=None,
                finished_at=None,
                seconds=None,
                queue_wait_s=None,
                gpu_seconds=None,
                updated_at=now,
                **_metadata_binds(),
            )
        )
        _expect_rows(conn.execute(stmt, params), len(params), "reset changed jobs")
        return events

    def _refresh_metadata(
        self, conn: sa.Connection, jobs: list[Job], known: dict[str, sa.Row], now: float
    ) -> None:
        params = []
        for job in jobs:
            new = _metadata(job)
            old = known[job.id]
            if any(getattr(old, k[2:]) != v for k, v in new.items()):
                params.append({"b_id": job.id, **new})
        if params:
            stmt = (
                jobs_table.update()
                .where(J.job_id == sa.bindparam("b_id"))
                .values(updated_at=now, **_metadata_binds())
            )
            _expect_rows(conn.execute(stmt, params), len(params), "refresh job metadata")

    # --- claims --------------------------------------------------------------------

    def claim(
        self, job_id: str, owner: str, lease_s: float = 3600.0, now: float | None = None
    ) -> ClaimStatus:
        """Try to take ``job_id`` for ``owner`` for ``lease_s`` seconds.

        CLAIMED if it was free, expired (taken over, with an event naming the old owner)
        or already ours (the lease is extended); HELD if another owner's claim is live;
        DONE for succeeded/degraded; DEAD_LETTERED for failed_fatal. Raises UnknownJob.
        """
        now = _now(now)
        event = None
        with self._write() as conn:
            row = self._lock_job(conn, job_id)
            if row.state in DONE:
                return ClaimStatus.DONE
            if row.state == FAILED_FATAL:
                return ClaimStatus.DEAD_LETTERED
            holder = row.claimed_by
            live = row.claim_expires_at is not None and row.claim_expires_at > now
            if holder not in (None, owner) and live:
                return ClaimStatus.HELD
            stmt = (
                jobs_table.update()
                .where(
                    J.job_id == job_id,
                    J.state == row.state,
                    J.claimed_by.is_not_distinct_from(holder),
                )
                .values(claimed_by=owner, claim_expires_at=now + lease_s, updated_at=now)
            )
            _expect_rows(conn.execute(stmt), 1, f"claim job {job_id}")
            if holder not in (None, owner):
                event = _event(
                    now,
                    job_id,
                    row.partition,
                    row.state,
                    row.state,
                    f"claim taken over from {holder}",
                )
                event = self._insert_events(conn, [event])[0]
        if event:
            log_event(event)
        return ClaimStatus.CLAIMED

    def renew_claim(
        self, job_id: str, owner: str, lease_s: float = 3600.0, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s claim to ``now + lease_s``. False if the claim is lost
        (released, taken over, or the job finished). An expired claim that nobody took
        over is still ours and is renewed."""
        now = _now(now)
        stmt = (
            jobs_table.update()
            .where(J.job_id == job_id, J.claimed_by == owner)
            .values(claim_expires_at=now + lease_s, updated_at=now)
        )
        with self._write() as conn:
            return conn.execute(stmt).rowcount == 1

    def release_claim(self, job_id: str, owner: str) -> bool:
        """Drop ``owner``'s claim. False if ``owner`` did not hold it (nothing changes)."""
        stmt = (
            jobs_table.update()
            .where(J.job_id == job_id, J.claimed_by == owner)
            .values(claimed_by=None, claim_expires_at=None)
        )
        with self._write() as conn:
            return conn.execute(stmt).rowcount == 1

    # --- transitions ---------------------------------------------------------------

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
        **fields: Any,
    ) -> None:
        """Move ``job_id`` to ``to_state`` and write an event row and a JSON log line.

        The transition is checked against the state in the database. ``fields`` sets
        other columns (TRANSITION_FIELDS: prompt_id, number, reason, seconds, ...);
        ``server`` and ``attempt`` (1-based) are stored on the job and in the event.
        First submission stamps ``first_submitted_at``; a finished or dead state stamps
        ``finished_at`` and drops the claim. With ``owner``, the caller must hold the
        claim. Raises InvalidTransition, UnknownJob, ClaimLost, TypeError for an unknown
        field.
        """
        unknown = set(fields) - TRANSITION_FIELDS
        if unknown:
            raise TypeError(f"transition() got unknown fields: {', '.join(sorted(unknown))}")
        to = str(to_state)
        now = _now(now)
        with self._write() as conn:
            row = self._lock_job(conn, job_id)
            if owner is not None and row.claimed_by != owner:
                raise ClaimLost(job_id, owner, row.claimed_by)
            check_transition(row.state, to, job_id=job_id)
            values: dict[str, Any] = {"state": to, "updated_at": now}
            if server is not None:
                values["server"] = server
            if attempt is not None:
                values["attempts"] = attempt
            if to == SUBMITTED and row.first_submitted_at is None:
                values["first_submitted_at"] = now
            if to in _TERMINAL:
                values.update(finished_at=now, claimed_by=None, claim_expires_at=None)
            elif to == PENDING:
                values["finished_at"] = None
            values.update(fields)
            self._guarded_update(conn, row, values)
            event = _event(now, job_id, row.partition, row.state, to, detail, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    def record_attempt(
        self,
        job_id: str,
        attempt: int,
        *,
        outcome: str,
        started_at: float,
        ended_at: float | None = None,
        server: str | None = None,
        prompt_id: str | None = None,
        number: int | None = None,
        queue_wait_s: float | None = None,
        reason: str | None = None,
        now: float | None = None,
    ) -> None:
        """Record try number ``attempt`` (1-based) of ``job_id``; recording the same number
        again replaces it. ``outcome`` is "success", "transient" or "permanent";
        ``ended_at`` defaults to ``now``; seconds = ended_at - started_at. Raises
        UnknownJob, ValueError for an unknown outcome."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        now = _now(now)
        ended_at = now if ended_at is None else ended_at
        row = {
            "job_id": job_id,
            "attempt": attempt,
            "server": server,
            "prompt_id": prompt_id,
            "number": number,
            "started_at": started_at,
            "ended_at": ended_at,
            "seconds": ended_at - started_at,
            "queue_wait_s": queue_wait_s,
            "outcome": outcome,
            "reason": reason,
        }
        insert = self._insert(attempts_table).values(**row)
        upsert = insert.on_conflict_do_update(
            index_elements=["job_id", "attempt"],
            set_={k: insert.excluded[k] for k in row if k not in ("job_id", "attempt")},
        )
        bump = (
            jobs_table.update()
            .where(J.job_id == job_id)
            .values(
                attempts=sa.case((J.attempts < attempt, attempt), else_=J.attempts),
                updated_at=now,
            )
        )
        with self._write() as conn:
            if conn.execute(bump).rowcount != 1:
                raise UnknownJob(job_id)
            conn.execute(upsert)

    def mark_done(
        self,
        job_id: str,
        owner: str,
        state: str = "succeeded",
        files: Sequence[OutputFile] = (),
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
    ) -> None:
        """Finish ``job_id`` as succeeded or degraded in ONE transaction: its files
        (replacing any earlier ones), totals, the transition with its event, and the
        claim released.

        Totals default from the attempts table: ``seconds`` = now - first_submitted_at,
        ``queue_wait_s`` = sum of queue waits, ``gpu_seconds`` = sum of attempt seconds
        minus queue waits. Raises ClaimLost unless ``owner`` holds the claim,
        InvalidTransition, UnknownJob, ValueError for a bad state or file path.
        """
        if state not in DONE:
            raise ValueError(f"mark_done state must be succeeded or degraded, got {state!r}")
        rows = [_file_row(job_id, f) for f in files]
        now = _now(now)
        with self._write() as conn:
            row = self._lock_job(conn, job_id)
            if row.claimed_by != owner:
                raise ClaimLost(job_id, owner, row.claimed_by)
            check_transition(row.state, state, job_id=job_id)
            totals = self._totals(conn, job_id, row, now)
            values: dict[str, Any] = {
                "state": state,
                "finished_at": now,
                "updated_at": now,
                "claimed_by": None,
                "claim_expires_at": None,
                "reason": reason,
                "seconds": totals[0] if seconds is None else seconds,
                "queue_wait_s": totals[1] if queue_wait_s is None else queue_wait_s,
                "gpu_seconds": totals[2] if gpu_seconds is None else gpu_seconds,
            }
            for name, value in (("server", server), ("attempts", attempt), ("number", number)):
                if value is not None:
                    values[name] = value
            self._guarded_update(conn, row, values)
            conn.execute(files_table.delete().where(files_table.c.job_id == job_id))
            if rows:
                for r in rows:
                    r["prompt_id"] = row.prompt_id
                conn.execute(files_table.insert(), rows)
            text = detail or f"{len(rows)} file{'s' if len(rows) != 1 else ''}"
            event = _event(now, job_id, row.partition, row.state, state, text, server, attempt)
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    def dead_letter(
        self,
        job_id: str,
        owner: str,
        reason: str,
        *,
        server: str | None = None,
        attempt: int | None = None,
        now: float | None = None,
    ) -> None:
        """Give up on ``job_id``: failed_fatal with ``reason``, claim freed, one
        transaction. Raises ClaimLost unless ``owner`` holds the claim, InvalidTransition
        (e.g. a done job), UnknownJob."""
        now = _now(now)
        with self._write() as conn:
            row = self._lock_job(conn, job_id)
            if row.claimed_by != owner:
                raise ClaimLost(job_id, owner, row.claimed_by)
            check_transition(row.state, FAILED_FATAL, job_id=job_id)
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
            self._guarded_update(conn, row, values)
            event = _event(
                now, job_id, row.partition, row.state, FAILED_FATAL, reason, server, attempt
            )
            event = self._insert_events(conn, [event])[0]
        log_event(event)

    def requeue(self, job_id: str, now: float | None = None) -> bool:
        """Send a dead-lettered job back to pending (reason cleared, attempts 0).
        False, and nothing changes, if it is not failed_fatal. Raises UnknownJob."""
        now = _now(now)
        with self._write() as conn:
            row = self._lock_job(conn, job_id)
            if row.state != FAILED_FATAL:
                return False
            values = {
                "state": PENDING.value,
                "reason": None,
                "attempts": 0,
                "finished_at": None,
                "updated_at": now,
            }
            self._guarded_update(conn, row, values)
            event = _event(now, job_id, row.partition, FAILED_FATAL, PENDING, "requeued")
            event = self._insert_events(conn, [event])[0]
        log_event(event)
        return True

    # --- reading -------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        """The job's row, or None if unknown."""
        with self._read() as conn:
            row = conn.execute(sa.select(jobs_table).where(J.job_id == job_id)).first()
        return None if row is None else _job_record(row)

    def jobs(self, partition: str) -> list[JobRecord]:
        """Jobs of ``partition`` by shot (jobs without one last), then line."""
        stmt = (
            sa.select(jobs_table)
            .where(J.partition == partition)
            .order_by(sa.nulls_last(J.shot.asc()), J.line, J.job_id)
        )
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    def files(self, job_id: str) -> list[FileRecord]:
        """Files of the job's done record, by path."""
        t = files_table
        stmt = sa.select(t).where(t.c.job_id == job_id).order_by(t.c.path)
        with self._read() as conn:
            return [FileRecord(**r._mapping) for r in conn.execute(stmt)]

    def attempts(self, job_id: str) -> list[AttemptRecord]:
        """Tries of the job, by attempt number."""
        t = attempts_table
        stmt = sa.select(t).where(t.c.job_id == job_id).order_by(t.c.attempt)
        with self._read() as conn:
            return [AttemptRecord(**r._mapping) for r in conn.execute(stmt)]

    def events(
        self,
        job_id: str | None = None,
        partition: str | None = None,
        *,
        shot: int | None = None,
    ) -> list[Event]:
        """Events, oldest first, filtered by job, partition and/or shot number
        (``events(partition="film", shot=17)``: what happened to shot 17)."""
        t = events_table
        stmt = sa.select(t).order_by(t.c.id)
        if job_id is not None:
            stmt = stmt.where(t.c.job_id == job_id)
        if partition is not None:
            stmt = stmt.where(t.c.partition == partition)
        if shot is not None:
            stmt = stmt.join(jobs_table, J.job_id == t.c.job_id).where(J.shot == shot)
        with self._read() as conn:
            return [Event(**r._mapping) for r in conn.execute(stmt)]

    def dead_letters(self, partition: str | None = None) -> list[JobRecord]:
        """failed_fatal jobs (of one partition, or all), by partition, shot, line."""
        stmt = (
            sa.select(jobs_table)
            .where(J.state == FAILED_FATAL.value)
            .order_by(J.partition, sa.nulls_last(J.shot.asc()), J.line, J.job_id)
        )
        if partition is not None:
            stmt = stmt.where(J.partition == partition)
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    def counts(self, partition: str) -> dict[str, int]:
        """Number of jobs of ``partition`` in each state (every state present, 0 if none)."""
        stmt = sa.select(J.state, sa.func.count()).where(J.partition == partition).group_by(J.state)
        counts = {s.value: 0 for s in State}
        with self._read() as conn:
            counts.update({state: n for state, n in conn.execute(stmt)})
        return counts

    def partitions(self) -> list[str]:
        """Partitions that have jobs, sorted."""
        stmt = sa.select(J.partition).distinct().order_by(J.partition)
        with self._read() as conn:
            return list(conn.execute(stmt).scalars())

    # --- server leases -------------------------------------------------------------

    def acquire_server(
        self,
        server: str,
        owner: str,
        lease_s: float,
        prompt_id: str | None = None,
        now: float | None = None,
    ) -> bool:
        """Take ``server`` for ``owner`` until ``now + lease_s``, in one atomic upsert:
        only if it is free, expired or already ours. True if ``owner`` holds it now."""
        now = _now(now)
        insert = self._insert(server_leases_table).values(
            server=server,
            owner=owner,
            expires_at=now + lease_s,
            prompt_id=prompt_id,
            updated_at=now,
        )
        stmt = insert.on_conflict_do_update(
            index_elements=["server"],
            set_={
                "owner": insert.excluded.owner,
                "expires_at": insert.excluded.expires_at,
                "prompt_id": insert.excluded.prompt_id,
                "updated_at": insert.excluded.updated_at,
            },
            where=sa.or_(L.owner.is_(None), L.owner == owner, L.expires_at <= now),
        )
        with self._write() as conn:
            return conn.execute(stmt).rowcount == 1

    def renew_server(
        self, server: str, owner: str, lease_s: float, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s lease to ``now + lease_s``; False if it is not ours any more."""
        now = _now(now)
        stmt = (
            server_leases_table.update()
            .where(L.server == server, L.owner == owner)
            .values(expires_at=now + lease_s, updated_at=now)
        )
        with self._write() as conn:
            return conn.execute(stmt).rowcount == 1

    def release_server(
        self,
        server: str,
        owner: str,
        last_model: str | None = None,
        now: float | None = None,
    ) -> bool:
        """Free ``server`` if ``owner`` holds it, remembering ``last_model`` (kept as it
        was when None). False, and nothing changes, if ``owner`` did not hold it."""
        now = _now(now)
        stmt = (
            server_leases_table.update()
            .where(L.server == server, L.owner == owner)
            .values(
                owner=None,
                expires_at=None,
                prompt_id=None,
                last_model=sa.func.coalesce(last_model, L.last_model),
                updated_at=now,
            )
        )
        with self._write() as conn:
            return conn.execute(stmt).rowcount == 1

    def server_leases(self) -> dict[str, ServerLease]:
        """Every server ever leased, by name (released ones have ``owner`` None)."""
        with self._read() as conn:
            rows = conn.execute(sa.select(server_leases_table))
            return {r.server: ServerLease(**r._mapping) for r in rows}

    # --- plumbing ------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn:
            conn.execution_options(**{_READ_ONLY: True})
            with conn.begin():
                yield conn

    def _insert(self, table: sa.Table) -> Any:
        """INSERT with ON CONFLICT support for this database."""
        return (postgresql.insert if self._pg else sqlite.insert)(table)

    def _lock_job(self, conn: sa.Connection, job_id: str) -> sa.Row:
        stmt = sa.select(jobs_table).where(J.job_id == job_id).with_for_update()
        row = conn.execute(stmt).first()
        if row is None:
            raise UnknownJob(job_id)
        return row

    def _guarded_update(self, conn: sa.Connection, row: sa.Row, values: dict[str, Any]) -> None:
        # Compare-and-set on what was read: state and claim must be as we saw them.
        stmt = (
            jobs_table.update()
            .where(
                J.job_id == row.job_id,
                J.state == row.state,
                J.claimed_by.is_not_distinct_from(row.claimed_by),
            )
            .values(**values)
        )
        _expect_rows(conn.execute(stmt), 1, f"update job {row.job_id}")

    def _totals(
        self, conn: sa.Connection, job_id: str, row: sa.Row, now: float
    ) -> tuple[float | None, float | None, float | None]:
        t = attempts_table.c
        stmt = sa.select(
            sa.func.count(),
            sa.func.sum(t.seconds),
            sa.func.sum(t.queue_wait_s),
            sa.func.sum(sa.func.coalesce(t.queue_wait_s, 0.0)),
        ).where(t.job_id == job_id)
        n, seconds, waited, waited_or_0 = conn.execute(stmt).one()
        total = seconds if row.first_submitted_at is None else now - row.first_submitted_at
        gpu = seconds - waited_or_0 if n else None
        return total, waited, gpu

    def _insert_events(self, conn: sa.Connection, events: list[Event]) -> list[Event]:
        """Insert event rows; the same events with their ids."""
        if not events:
            return []
        rows = [e.to_dict() for e in events]
        for r in rows:
            del r["id"]
        stmt = events_table.insert().returning(events_table.c.id, sort_by_parameter_order=True)
        ids = conn.execute(stmt, rows).scalars().all()
        return [_with_id(e, i) for e, i in zip(events, ids, strict=True)]


# --- helpers --------------------------------------------------------------------------


def _make_engine(db_url: str) -> sa.Engine:
    url = sa.make_url(db_url)
    if url.get_backend_name() != "sqlite":
        return sa.create_engine(url, pool_pre_ping=True)
    engine = sa.create_engine(url, connect_args={"timeout": 60.0})

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_conn: Any, _record: Any) -> None:
        # We emit BEGIN ourselves (below); the driver's own would start too late.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 60000")
        cur.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode survives a process crash; a power cut may lose the last
        # commits, which idempotent prompt_ids make cheap to redo.
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        # IMMEDIATE takes the write lock up front: a deferred transaction that reads and
        # then writes fails with "database is locked" when another writer got in between.
        read_only = conn.get_execution_options().get(_READ_ONLY)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _now(now: float | None) -> float:
    return time.time() if now is None else now


def _safe_name(name: str, what: str) -> str:
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{what} {name!r} cannot be used as a folder name")
    return name


def _set_json(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def _metadata(job: Job) -> dict[str, Any]:
    """Columns that describe a job without changing what it renders (bind names)."""
    return {
        "b_line": job.line,
        "b_shot": job.shot,
        "b_optional": job.optional,
        "b_duration_s": job.duration_s,
        "b_set_json": _set_json(job.set),
    }


def _metadata_binds() -> dict[str, Any]:
    return {
        name: sa.bindparam(f"b_{name}")
        for name in ("line", "shot", "optional", "duration_s", "set_json")
    }


def _expect_rows(result: sa.CursorResult, expected: int, what: str) -> None:
    if result.rowcount != expected:
        raise StoreConflict(f"{what}: {result.rowcount} rows changed, expected {expected}")


def _event(
    now: float,
    job_id: str,
    partition: str,
    from_state: str | None,
    to_state: str,
    detail: str | None = None,
    server: str | None = None,
    attempt: int | None = None,
) -> Event:
    return Event(
        id=None,
        time=now,
        job_id=job_id,
        partition=partition,
        from_state=None if from_state is None else str(from_state),
        to_state=str(to_state),
        server=server,
        attempt=attempt,
        detail=detail,
    )


def _with_id(event: Event, event_id: int) -> Event:
    return dataclasses.replace(event, id=event_id)


def _job_record(row: sa.Row) -> JobRecord:
    values = dict(row._mapping)
    values["set"] = json.loads(values.pop("set_json"))
    values["state"] = State(values["state"])
    values["optional"] = bool(values["optional"])
    return JobRecord(**values)


def _file_row(job_id: str, f: OutputFile) -> dict[str, Any]:
    path = PurePosixPath(f.path)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"job {job_id}: file path {str(f.path)!r} must be inside the job dir")
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
