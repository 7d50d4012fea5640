"""Reading the store: a job, a partition's jobs, files, attempts, model loads, events,
dead letters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict, TypeVar, Unpack

import sqlalchemy as sa

from comfy_assets.jobs.events import Event
from comfy_assets.jobs.states import (
    FAILED_FATAL,
    State,
)
from comfy_assets.store import statements as q
from comfy_assets.store.base import StoreBase, _job_record, _model_load_record
from comfy_assets.store.records import (
    AttemptRecord,
    FileRecord,
    JobBrief,
    JobRecord,
    ModelLoadRecord,
)
from comfy_assets.store.retry import (
    retried,
)
from comfy_assets.store.schema import (
    attempts_table,
    events_table,
    files_table,
    jobs_table,
)

R = TypeVar("R")
IDS_PER_QUERY = 500  # ids per IN (...): well under SQLite's and PostgreSQL's parameter limits


class EventsWhich(TypedDict, total=False):
    """Which events ``Queries.events`` reads and ``Queries.count_events`` counts: those
    of one job, partition and/or shot number, whose ``id`` is below ``before`` (a key
    absent or None: any)."""

    job_id: str | None
    partition: str | None
    shot: int | None
    before: int | None


def id_range(
    column: sa.ColumnElement[Any], after: str | None, upto: str | None
) -> list[sa.ColumnElement[bool]]:
    """The conditions of ``column`` (a job id) sorting after ``after`` and not after
    ``upto`` (either None: no bound): one page of ``job_page``, a range of the primary
    key's index."""
    bounds = []
    if after is not None:
        bounds.append(column > after)
    if upto is not None:
        bounds.append(column <= upto)
    return bounds


class Queries(StoreBase):
    """What the store holds (a part of ``Store``)."""

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
            .where(q.JOB.partition == partition)
            .order_by(sa.nulls_last(q.JOB.shot.asc()), q.JOB.line, q.JOB.job_id)
        )
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    @retried
    def job_page(self, partition: str, after: str, size: int) -> list[JobRecord]:
        """Up to ``size`` jobs of ``partition`` whose id sorts after ``after`` (""
        for the first page), by id: a partition of millions of jobs read a page at a
        time, each page one indexed look."""
        stmt = (
            sa.select(jobs_table)
            .where(q.JOB.partition == partition, q.JOB.job_id > after)
            .order_by(q.JOB.job_id)
            .limit(size)
        )
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    @retried
    def job_brief_page(self, partition: str, after: str, size: int) -> list[JobBrief]:
        """``job_page`` of the columns ``JobBrief`` holds: a page of a million-job
        partition read for a summary without building its records."""
        j = q.JOB
        stmt = (
            sa.select(j.job_id, j.prompt_id, j.state, j.line, j.shot, j.server)
            .where(j.partition == partition, j.job_id > after)
            .order_by(j.job_id)
            .limit(size)
        )
        with self._read() as conn:
            return [JobBrief(*row) for row in conn.execute(stmt)]

    @retried
    def files(self, job_id: str) -> list[FileRecord]:
        """Files of the job's done record, by path."""
        return self._job_rows(files_table, job_id, files_table.c.path, FileRecord)

    @retried
    def files_of(self, job_ids: Sequence[str]) -> dict[str, list[FileRecord]]:
        """Files of the done records of ``job_ids``: job id -> its files, by path (a job
        without files is not a key). One query a few hundred ids, where ``files`` is one
        a job."""
        t = files_table.c
        chunks = (job_ids[i : i + IDS_PER_QUERY] for i in range(0, len(job_ids), IDS_PER_QUERY))
        stmts = [sa.select(files_table).where(t.job_id.in_(list(ids))) for ids in chunks]
        return self._files_by_job(stmts)

    @retried
    def partition_files(
        self, partition: str, after: str | None = None, upto: str | None = None
    ) -> dict[str, list[FileRecord]]:
        """Files of every done record in ``partition``: job id -> its files, by path (a
        job without files is not a key). One query, where ``files`` per job is one per
        job. ``after`` and ``upto``: of the jobs whose id sorts after ``after`` and not
        after ``upto`` only (a ``job_page``'s)."""
        t = files_table.c
        stmt = (
            sa.select(files_table)
            .join(jobs_table, jobs_table.c.job_id == t.job_id)
            .where(jobs_table.c.partition == partition, *id_range(t.job_id, after, upto))
        )
        return self._files_by_job([stmt])

    def _files_by_job(self, stmts: Sequence[sa.Select[Any]]) -> dict[str, list[FileRecord]]:
        """The file rows ``stmts`` select, in one read: job id -> its files, by path."""
        t = files_table.c
        by_job: dict[str, list[FileRecord]] = {}
        with self._read() as conn:
            for stmt in stmts:
                for r in conn.execute(stmt.order_by(t.job_id, t.path)):
                    by_job.setdefault(r.job_id, []).append(FileRecord(**r._mapping))
        return by_job

    @retried
    def model_loads(
        self, partition: str, after: str | None = None, upto: str | None = None
    ) -> list[ModelLoadRecord]:
        """Every try of ``partition``'s jobs that load models, by job and attempt: their
        model files, whether the server had to load one, outcome and GPU seconds.
        ``after`` and ``upto``: of a range of job ids only, as ``partition_files``."""
        m = q.MODEL_LOAD
        stmt = q.MODEL_TRIES.join(jobs_table, jobs_table.c.job_id == m.job_id).where(
            jobs_table.c.partition == partition, *id_range(m.job_id, after, upto)
        )
        with self._read() as conn:
            return [_model_load_record(r) for r in conn.execute(stmt)]

    @retried
    def attempts(self, job_id: str) -> list[AttemptRecord]:
        """Tries of the job, by attempt number."""
        return self._job_rows(attempts_table, job_id, attempts_table.c.attempt, AttemptRecord)

    def _job_rows(
        self, table: sa.Table, job_id: str, order: sa.ColumnElement[Any], record: type[R]
    ) -> list[R]:
        """The rows of ``table`` that belong to ``job_id``, by ``order``, each as a
        ``record`` (one field per column)."""
        stmt = sa.select(table).where(table.c.job_id == job_id).order_by(order)
        with self._read() as conn:
            return [record(**r._mapping) for r in conn.execute(stmt)]

    @retried
    def events(
        self,
        job_id: str | None = None,
        partition: str | None = None,
        *,
        shot: int | None = None,
        limit: int | None = None,
        before: int | None = None,
    ) -> list[Event]:
        """Events, oldest first, of one job, partition and/or shot number:
        ``events(partition="film", shot=17)`` tells what happened to shot 17. ``limit``:
        only the latest ``limit`` of them (None: all); ``before``: only those whose ``id``
        is below it (a page further back)."""
        t = events_table.c
        which = EventsWhich(job_id=job_id, partition=partition, shot=shot, before=before)
        stmt = self._events_where(sa.select(events_table), which)
        if limit is None:
            stmt = stmt.order_by(t.id)
        else:
            # The latest, by a backward range of ``ix_comfy_events_partition_id`` (or of
            # the job's events): a partition's millions of events are not sorted.
            stmt = stmt.order_by(t.id.desc()).limit(limit)
        with self._read() as conn:
            events = [Event(**r._mapping) for r in conn.execute(stmt)]
        return events if limit is None else events[::-1]

    @retried
    def count_events(self, *, at_most: int | None = None, **which: Unpack[EventsWhich]) -> int:
        """How many events ``events`` with the same arguments and no ``limit`` returns;
        ``at_most``: counted no further than that (a count in bounded time: a partition
        has millions)."""
        matching = self._events_where(sa.select(events_table.c.id), which).limit(at_most)
        stmt = sa.select(sa.func.count()).select_from(matching.subquery())
        with self._read() as conn:
            return int(conn.execute(stmt).scalar_one())

    @staticmethod
    def _events_where(stmt: sa.Select[Any], which: EventsWhich) -> sa.Select[Any]:
        """``stmt`` (over ``comfy_events``) narrowed to ``which``."""
        t = events_table.c
        job_id, partition = which.get("job_id"), which.get("partition")
        shot, before = which.get("shot"), which.get("before")
        if job_id is not None:
            stmt = stmt.where(t.job_id == job_id)
        if partition is not None:
            stmt = stmt.where(t.partition == partition)
        if shot is not None:
            # The shot's jobs first (``ix_comfy_jobs_partition_shot``), then their events
            # by job: a join would read every event of a million-job partition.
            shot_jobs = sa.select(q.JOB.job_id).where(q.JOB.shot == shot)
            if partition is not None:
                shot_jobs = shot_jobs.where(q.JOB.partition == partition)
            stmt = stmt.where(t.job_id.in_(shot_jobs))
        if before is not None:
            stmt = stmt.where(t.id < before)
        return stmt

    @retried
    def dead_letters(
        self, partition: str | None = None, limit: int | None = None
    ) -> list[JobRecord]:
        """failed_fatal jobs, of one partition or all, by partition, shot, line; the
        first ``limit`` of them (None: every one)."""
        stmt = (
            sa.select(jobs_table)
            .where(q.JOB.state == FAILED_FATAL.value)
            .order_by(q.JOB.partition, sa.nulls_last(q.JOB.shot.asc()), q.JOB.line, q.JOB.job_id)
            .limit(limit)
        )
        if partition is not None:
            stmt = stmt.where(q.JOB.partition == partition)
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    @retried
    def counts(self, partition: str) -> dict[str, int]:
        """Jobs of ``partition`` per state; every state is present (0 if none)."""
        stmt = (
            sa.select(q.JOB.state, sa.func.count())
            .where(q.JOB.partition == partition)
            .group_by(q.JOB.state)
        )
        counts = {s.value: 0 for s in State}
        with self._read() as conn:
            counts.update({state: n for state, n in conn.execute(stmt)})
        return counts

    @retried
    def partitions(self) -> list[str]:
        """Partitions that have jobs, sorted."""
        stmt = sa.select(q.JOB.partition).distinct().order_by(q.JOB.partition)
        with self._read() as conn:
            return list(conn.execute(stmt).scalars())
