"""Reading a partition's jobs a segment at a time, for results.csv built from what changed
(``render/segments.py``): the jobs changed since a time, the jobs of given ids or of a
range of lines, and their files, model tries and failed servers, each segment read in
one snapshot."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from comfy_assets.store import statements as q
from comfy_assets.store.base import StoreBase, _job_record, _model_load_record
from comfy_assets.store.records import FileRecord, JobRecord, ModelLoadRecord
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import attempts_table, files_table, jobs_table, model_loads_table

# Job ids bound in one ``IN (...)`` (SQLite allows 32,766 variables, PostgreSQL 65,535).
IDS_PER_STATEMENT = 5_000


@dataclass(frozen=True)
class ChangedJob:
    """A job of a partition changed at ``updated_at`` (the database's clock, epoch
    seconds), at ``line`` of its job file."""

    job_id: str
    line: int
    updated_at: float


@dataclass(frozen=True)
class SegmentRead:
    """Jobs of a segment as the store had them at one moment: ``records`` (in the order
    asked, those the partition has), ``files`` (job id -> its files, by path; the
    segment's jobs and the upstream jobs asked for), ``model_tries`` (by job and attempt)
    and ``failed_on`` (job id -> servers its failed attempts ran on since its inputs last
    changed, in order, each once), and ``upstream`` (each upstream job asked for that is
    in the partition -> its updated_at)."""

    records: list[JobRecord]
    files: dict[str, list[FileRecord]]
    model_tries: list[ModelLoadRecord]
    failed_on: dict[str, tuple[str, ...]]
    upstream: dict[str, float]


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for at in range(0, len(ids), IDS_PER_STATEMENT):
        yield ids[at : at + IDS_PER_STATEMENT]


class SegmentReads(StoreBase):
    """A partition's jobs a segment at a time (a part of ``Store``)."""

    @retried
    def changed_jobs(self, partition: str, since: float) -> list[ChangedJob]:
        """The jobs of ``partition`` whose row changed at or after ``since`` (epoch
        seconds, the database's clock): registered, moved on, claimed, requeued. One
        look in the index on (partition, updated_at)."""
        j = jobs_table.c
        stmt = sa.select(j.job_id, j.line, j.updated_at).where(
            j.partition == partition, j.updated_at >= since
        )
        with self._read() as conn:
            return [ChangedJob(r.job_id, r.line, r.updated_at) for r in conn.execute(stmt)]

    @retried
    def line_span(
        self, partition: str, lines: tuple[int, int] | None = None
    ) -> tuple[int, int, int] | None:
        """The first and last line of ``partition``'s jobs and how many it has, or None
        for a partition without jobs (an index-only look on (partition, line)).
        ``lines`` (first, last; inclusive): of its jobs of those lines only."""
        j = jobs_table.c
        stmt = sa.select(sa.func.min(j.line), sa.func.max(j.line), sa.func.count()).where(
            j.partition == partition
        )
        if lines is not None:
            stmt = stmt.where(j.line.between(*lines))
        with self._read() as conn:
            first, last, count = conn.execute(stmt).one()
        return None if count == 0 else (int(first), int(last), int(count))

    @retried
    def read_segment(
        self,
        partition: str,
        *,
        job_ids: Sequence[str] | None = None,
        lines: tuple[int, int] | None = None,
    ) -> SegmentRead:
        """The jobs of ``partition`` with ids ``job_ids`` (in that order, those it has),
        or with lines ``lines`` (first, last; inclusive; by line, then id), with their
        files, model tries and failed servers, and the files of the jobs of the
        partition whose files their inputs name (upstream jobs), in one snapshot. Raises ValueError for neither or both of
        ``job_ids`` and ``lines``, StoreUnavailable."""
        if (job_ids is None) == (lines is None):
            raise ValueError("read_segment: give job_ids or lines")
        j = jobs_table.c
        with self._read(snapshot=True) as conn:
            if lines is not None:
                stmt = (
                    sa.select(jobs_table)
                    .where(j.partition == partition, j.line.between(*lines))
                    .order_by(j.line, j.job_id)
                )
                records = [_job_record(r) for r in conn.execute(stmt)]
            else:
                assert job_ids is not None
                found: dict[str, JobRecord] = {}
                for chunk in _chunks(job_ids):
                    stmt = sa.select(jobs_table).where(
                        j.partition == partition, j.job_id.in_(chunk)
                    )
                    found |= {r.job_id: _job_record(r) for r in conn.execute(stmt)}
                records = [found[i] for i in job_ids if i in found]
            ids = [r.job_id for r in records]
            above: dict[str, float] = {}
            named = {str(i["job"]) for r in records for i in r.inputs if "job" in i}
            wanted = sorted(named - set(ids))
            for chunk in _chunks(wanted):
                stmt = sa.select(j.job_id, j.updated_at).where(
                    j.partition == partition, j.job_id.in_(chunk)
                )
                above |= {r.job_id: r.updated_at for r in conn.execute(stmt)}
            files: dict[str, list[FileRecord]] = {}
            for chunk in _chunks([*ids, *sorted(above)]):
                t = files_table.c
                stmt = sa.select(files_table).where(t.job_id.in_(chunk)).order_by(t.job_id, t.path)
                for r in conn.execute(stmt):
                    files.setdefault(r.job_id, []).append(FileRecord(**r._mapping))
            tries: list[ModelLoadRecord] = []
            failed: dict[str, list[str]] = {}
            for chunk in _chunks(ids):
                tries += self._model_tries(conn, chunk)
                a = attempts_table.c
                stmt = (
                    sa.select(a.job_id, a.server)
                    .join(jobs_table, j.job_id == a.job_id)
                    .where(
                        a.job_id.in_(chunk),
                        a.outcome != "success",
                        a.server.is_not(None),
                        a.attempt > j.attempts_before,
                    )
                    .order_by(a.job_id, a.attempt)
                )
                for job_id, server in conn.execute(stmt):
                    servers = failed.setdefault(job_id, [])
                    if server not in servers:
                        servers.append(server)
        return SegmentRead(
            records,
            files,
            tries,
            {job_id: tuple(servers) for job_id, servers in failed.items()},
            above,
        )

    @staticmethod
    def _model_tries(conn: sa.Connection, job_ids: Sequence[str]) -> list[ModelLoadRecord]:
        stmt = q.MODEL_TRIES.where(q.MODEL_LOAD.job_id.in_(job_ids))
        return [_model_load_record(r) for r in conn.execute(stmt)]

    @retried
    def loads_models(self, partition: str) -> bool:
        """Whether any job of ``partition`` has a try that loads models (the results
        table's ``models`` and ``model_loaded`` columns)."""
        m = model_loads_table.c
        stmt = (
            sa.select(m.job_id)
            .join(jobs_table, jobs_table.c.job_id == m.job_id)
            .where(q.JOB.partition == partition)
            .limit(1)
        )
        with self._read() as conn:
            return conn.execute(stmt).first() is not None
