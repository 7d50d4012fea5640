"""Registering a job file's jobs: bulk statements in the caller's one transaction."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from comfy_assets.jobs.events import Event
from comfy_assets.jobs.model import InputFile, Job
from comfy_assets.jobs.states import DONE, FAILED_FATAL, FAILED_RETRYABLE, IN_FLIGHT, PENDING
from comfy_assets.store.base import _job_record
from comfy_assets.store.records import PartitionConflict, RegisterResult, StoreConflict
from comfy_assets.store.schema import jobs_table
from comfy_assets.store.statements import JOB, expect_rows, insert_for

_CHUNK = 500  # ids per IN (...): well under SQLite's and PostgreSQL's parameter limits
_ENDED = frozenset(s.value for s in (*DONE, FAILED_FATAL))
# Columns that describe a job without changing what it renders.
_METADATA = ("line", "shot", "optional", "duration_s", "set_json", "take", "inputs_json")


def set_json(values: dict[str, Any]) -> str:
    """The stored form of a job's ``set`` overrides."""
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def inputs_json(job: Job) -> str | None:
    """The stored form of a job's inputs: a JSON list, one object an input: ``key``
    with ``path``, ``sha256`` and ``bytes`` (a file) or ``job``, ``node`` and ``index``
    (a file an upstream job writes); None for a job without inputs."""
    if not job.inputs:
        return None
    items: list[dict[str, Any]] = []
    for inp in job.inputs:
        if isinstance(inp, InputFile):
            items.append(
                {"key": inp.key, "path": inp.path, "sha256": inp.sha256, "bytes": inp.size}
            )
        else:
            items.append({"key": inp.key, "job": inp.job, "node": inp.node, "index": inp.index})
    return json.dumps(items, sort_keys=True, separators=(",", ":"))


def register(
    conn: sa.Connection,
    dialect: str,
    partition: str,
    jobs: Sequence[Job],
    now: float,
    *,
    forward_only: bool = False,
) -> tuple[RegisterResult, list[Event]]:
    """Insert new jobs, keep unchanged ones, reset those whose prompt_id changed.

    ``forward_only``: a known job whose stored take is higher than the given one's is
    left as it is (``superseded``): a queue message or a request of an older take never
    moves a job back. Returns what happened and the events to write. Raises
    PartitionConflict, ValueError for an id given twice. Rows are locked (PostgreSQL)
    before they are compared, so the takes are compared under the lock.
    """
    by_id: dict[str, Job] = {}
    for job in jobs:
        if job.id in by_id:
            raise ValueError(f"job {job.id} given twice to register_jobs")
        by_id[job.id] = job
    if dialect == "postgresql":
        # One registration of a partition at a time: the second sees all the first wrote.
        # (SQLite's BEGIN IMMEDIATE already serialises every write.)
        lock = sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext("register:" + partition)))
        conn.execute(lock)
    known = _lock_rows(conn, dialect, sorted(by_id))
    _check_partition(partition, known)
    new = sorted((j for j in by_id.values() if j.id not in known), key=lambda j: j.id)
    added = _insert_new(conn, dialect, partition, new, now)
    if added < len(new):
        # Only a registration under another partition can have inserted them meanwhile.
        missing = sorted(j.id for j in new)
        _check_partition(partition, _lock_rows(conn, dialect, missing))
        raise StoreConflict(
            f"register {partition!r}: {len(new) - added} jobs inserted by another process"
        )
    inserted = [j for j in by_id if j not in known]
    superseded = [j for j, row in known.items() if forward_only and (row.take or 1) > by_id[j].take]
    current = {j: row for j, row in known.items() if j not in superseded}
    changed = [j for j, row in current.items() if row.prompt_id != by_id[j].prompt_id]
    unchanged = [j for j, row in current.items() if row.prompt_id == by_id[j].prompt_id]
    events = [_event(now, j, partition, None, PENDING, _registered(by_id[j])) for j in inserted]
    events += _reset_changed(conn, partition, [by_id[j] for j in sorted(changed)], known, now)
    _refresh_metadata(conn, [by_id[j] for j in unchanged], known, now)
    order = {job_id: i for i, job_id in enumerate(by_id)}
    unchanged.sort(key=order.__getitem__)
    result = RegisterResult(
        inserted=inserted,
        unchanged=unchanged,
        changed=sorted(changed, key=order.__getitem__),
        superseded=sorted(superseded, key=order.__getitem__),
        # Read under this transaction's lock: what a claim of each would find now.
        ended={j: _job_record(known[j]) for j in unchanged if known[j].state in _ENDED},
    )
    return result, events


def foreign_jobs(conn: sa.Connection, partition: str, job_ids: Iterable[str]) -> dict[str, str]:
    """Of ``job_ids``, those registered under another partition than ``partition``, with
    that partition. One indexed look when the store holds no other partition's job; else
    one statement per ``_CHUNK`` ids (``job_ids`` is read once, a chunk at a time)."""
    others = sa.select(JOB.job_id).where(JOB.partition != partition).limit(1)
    if conn.execute(others).first() is None:
        return {}
    found: dict[str, str] = {}
    chunk: list[str] = []
    for job_id in itertools.chain(job_ids, [None]):
        if job_id is not None:
            chunk.append(job_id)
            if len(chunk) < _CHUNK:
                continue
        if chunk:
            stmt = sa.select(JOB.job_id, JOB.partition).where(
                JOB.job_id.in_(chunk), JOB.partition != partition
            )
            found.update((row.job_id, row.partition) for row in conn.execute(stmt))
        chunk = []
    return found


def _check_partition(partition: str, known: dict[str, sa.Row]) -> None:
    conflicts = {j: r.partition for j, r in known.items() if r.partition != partition}
    if conflicts:
        raise PartitionConflict(partition, conflicts)


def _lock_rows(conn: sa.Connection, dialect: str, job_ids: list[str]) -> dict[str, sa.Row]:
    """The rows of ``job_ids`` that exist, locked (PostgreSQL) in job_id order, so two
    processes locking the same rows wait for each other instead of deadlocking."""
    found: dict[str, sa.Row] = {}
    if dialect == "postgresql":
        # One array parameter: a 10,000-item IN list is slow to send and to plan.
        from sqlalchemy.dialects import postgresql  # loaded by its engine already

        ids = sa.bindparam("ids", job_ids, type_=postgresql.ARRAY(sa.String))
        stmt = sa.select(jobs_table).where(JOB.job_id == sa.any_(ids))
        rows = conn.execute(stmt.order_by(JOB.job_id).with_for_update())
        return {row.job_id: row for row in rows}
    for i in range(0, len(job_ids), _CHUNK):
        chunk = job_ids[i : i + _CHUNK]
        stmt = (
            sa.select(jobs_table)
            .where(JOB.job_id.in_(chunk))
            .order_by(JOB.job_id)
            .with_for_update()
        )
        found.update((row.job_id, row) for row in conn.execute(stmt))
    return found


def _insert_new(
    conn: sa.Connection, dialect: str, partition: str, jobs: list[Job], now: float
) -> int:
    """Insert ``jobs`` as pending, skipping ids that exist; returns how many it inserted."""
    if not jobs:
        return 0
    rows = [
        {
            "job_id": job.id,
            "partition": partition,
            "prompt_id": job.prompt_id,
            "state": PENDING.value,
            "attempts": 0,
            "created_at": now,
            "updated_at": now,
            **_metadata(job),
        }
        for job in jobs
    ]
    # executemany without RETURNING: psycopg pipelines it, SQLite runs it in C.
    stmt = insert_for(dialect, jobs_table).on_conflict_do_nothing()
    return conn.execute(stmt.execution_options(preserve_rowcount=True), rows).rowcount


def _reset_changed(
    conn: sa.Connection, partition: str, jobs: list[Job], known: dict[str, sa.Row], now: float
) -> list[Event]:
    if not jobs:
        return []
    events: list[Event] = []
    params = []
    for job in jobs:
        old = known[job.id]
        changed = "inputs changed"
        if (old.take or 1) != job.take:
            changed = f"take {old.take or 1} → {job.take}"
        if old.state in IN_FLIGHT:
            # Through failed_retryable, as the state machine wants: the old attempt can
            # no longer finish the job (its claim is gone, its state moved on).
            detail = "inputs changed while in flight; attempt abandoned"
            events.append(_event(now, job.id, partition, old.state, FAILED_RETRYABLE, detail))
            events.append(_event(now, job.id, partition, FAILED_RETRYABLE, PENDING, changed))
        else:
            events.append(_event(now, job.id, partition, old.state, PENDING, changed))
        params.append(
            {
                "b_id": job.id,
                "b_old": old.prompt_id,
                "v_prompt_id": job.prompt_id,
                **{f"v_{k}": v for k, v in _metadata(job).items()},
            }
        )
    stmt = (
        jobs_table.update()
        .where(JOB.job_id == sa.bindparam("b_id"), JOB.prompt_id == sa.bindparam("b_old"))
        .values(
            prompt_id=sa.bindparam("v_prompt_id"),
            state=PENDING.value,
            attempts_before=JOB.attempts_before + JOB.attempts,
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
            **{k: sa.bindparam(f"v_{k}") for k in _METADATA},
        )
    )
    expect_rows(conn.execute(stmt, params), len(params), "reset jobs whose inputs changed")
    return events


def _refresh_metadata(
    conn: sa.Connection, jobs: list[Job], known: dict[str, sa.Row], now: float
) -> None:
    params = []
    for job in jobs:
        new = _metadata(job)
        old = known[job.id]
        if any(getattr(old, k) != v for k, v in new.items()):
            params.append({"b_id": job.id, **{f"v_{k}": v for k, v in new.items()}})
    if params:
        stmt = (
            jobs_table.update()
            .where(JOB.job_id == sa.bindparam("b_id"))
            .values(updated_at=now, **{k: sa.bindparam(f"v_{k}") for k in _METADATA})
        )
        expect_rows(conn.execute(stmt, params), len(params), "refresh job shot/line/flags")


def _registered(job: Job) -> str:
    return "registered" if job.take == 1 else f"registered, take {job.take}"


def _metadata(job: Job) -> dict[str, Any]:
    return {
        "line": job.line,
        "shot": job.shot,
        "optional": job.optional,
        "duration_s": job.duration_s,
        "set_json": set_json(job.set),
        "take": job.take,
        "inputs_json": inputs_json(job),
    }


def _event(
    now: float,
    job_id: str,
    partition: str,
    from_state: str | None,
    to_state: str,
    detail: str,
) -> Event:
    return Event(
        id=None,
        time=now,
        job_id=job_id,
        partition=partition,
        from_state=None if from_state is None else str(from_state),
        to_state=str(to_state),
        detail=detail,
    )


def register_row(job: Job) -> dict[str, Any]:
    """The columns of ``job``'s row that say what it renders and how it is listed: its
    id, prompt_id and metadata (line, shot, flags, take, inputs), by column name."""
    return {"job_id": job.id, "prompt_id": job.prompt_id, **_metadata(job)}


def registered_detail(job: Job) -> str:
    """The detail of the event of ``job``'s first registration."""
    return _registered(job)
