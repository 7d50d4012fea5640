"""What running batches say of themselves (``comfy_live``): per partition its estimate
and the jobs it holds back with their reasons, per server what it renders now or why it
is not used. Written by each batch every few seconds (``render/steering.py``), read by
``comfy-assets status`` (``cli/status.py``) in one snapshot with the jobs not done
(``status_snapshot``); rows of an owner that stopped beating are not read
(``store/owners.py``), and an owner's rows are replaced whole at each write."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from comfy_assets.jobs.states import DONE, FAILED_FATAL, PENDING, State
from comfy_assets.store.base import StoreBase, _job_records
from comfy_assets.store.owners import OwnerRecord, read_owners
from comfy_assets.store.records import JobRecord
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import attempts_table, jobs_table, live_table, owners_table

# Seconds after which a row nobody rewrote is stale (its batch ended or hangs).
LIVE_STALE_S = 15.0
# Pending jobs nobody claims that ``status_snapshot`` reads of the partition asked for.
PLAIN_LISTED = 1000


@dataclass(frozen=True)
class LiveRow:
    """One row: ``owner`` (a process), ``kind`` (``partition`` or ``server``),
    ``subject`` (its name), ``detail`` (the JSON object written), ``age_s`` (seconds
    since it was written, by the database's clock)."""

    owner: str
    kind: str
    subject: str
    detail: dict[str, Any]
    age_s: float


@dataclass(frozen=True)
class StatusSnapshot:
    """What ``comfy-assets status`` reads, as the store was at one moment: ``now`` (epoch
    seconds by the database's clock), ``live`` (the rows, as ``Live.live`` gives them),
    ``owners`` (as ``Owners.owners``), ``counts`` (per partition, its jobs by state,
    every state present) and ``jobs``: the jobs not done (not succeeded nor degraded)
    of every partition (the jobs on a server among them), but for the dead letters of
    a partition not asked for (counted only) and the pending jobs nobody claims,
    counted in ``plain``, of which ``jobs`` holds only those named by a live row and
    ``PLAIN_LISTED`` of the partition asked for."""

    now: float
    live: list[LiveRow]
    owners: list[OwnerRecord]
    counts: dict[str, dict[str, int]]
    jobs: list[JobRecord]
    # Per partition its pending jobs nobody claims, whether in ``jobs`` or not: ``jobs``
    # holds those the live rows name, and with ``partition`` ``PLAIN_LISTED`` of its
    # others, not the rest: the line of a million-job partition, which all wait alike.
    plain: dict[str, int] = field(default_factory=dict)


class Live(StoreBase):
    """Reading and writing ``comfy_live`` (a part of ``Store``)."""

    @retried
    def publish_live(
        self,
        owner: str,
        rows: Mapping[tuple[str, str], Mapping[str, Any]],
        now: float | None = None,
    ) -> None:
        """Replace ``owner``'s rows with ``rows``: ``{(kind, subject): detail}``."""
        now = self._now(now)
        values = [
            {
                "owner": owner,
                "kind": kind,
                "subject": subject,
                "detail": json.dumps(detail, separators=(",", ":")),
                "updated_at": now,
            }
            for (kind, subject), detail in rows.items()
        ]
        with self._write() as conn:
            conn.execute(live_table.delete().where(live_table.c.owner == owner))
            if values:
                # One multi-row INSERT: an executemany is a statement per row.
                conn.execute(live_table.insert().values(values))

    @retried
    def clear_live(self, owner: str) -> None:
        """Forget ``owner``'s rows (its batch ended)."""
        with self._write() as conn:
            conn.execute(live_table.delete().where(live_table.c.owner == owner))

    @retried
    def live(self, stale_s: float = LIVE_STALE_S) -> list[LiveRow]:
        """The rows written within ``stale_s`` seconds by owners not released, oldest
        owner first."""
        now = self.now()
        with self._read() as conn:
            return _live_rows(conn, now, stale_s)

    @retried
    def status_snapshot(
        self, partition: str | None = None, stale_s: float = LIVE_STALE_S
    ) -> StatusSnapshot:
        """The live rows, the owners, the counts and the jobs not done of every
        partition in one snapshot (``StatusSnapshot``), so the jobs' states, their count
        and the rows' times agree; the dead letters are rows of ``partition`` only (of
        the others they are counted); an unknown ``partition`` has no counts."""
        now = self.now()
        jobs = jobs_table.c
        counted = sa.select(jobs.partition, jobs.state, sa.func.count()).group_by(
            jobs.partition, jobs.state
        )
        # Each query below is a range of ``ix_comfy_jobs_partition_state_claim`` (the
        # counts an index-only scan of it), so a million pending jobs are counted, not
        # read: only the others are rows, and the dead letters only of ``partition``
        # (another partition's line counts them, and they can be a million too). A query
        # by state alone, of every partition, would read the whole table.
        active = [s.value for s in State if s not in DONE and s != PENDING]
        dead = FAILED_FATAL.value
        plain = sa.and_(jobs.state == PENDING.value, jobs.claimed_by.is_(None))
        with self._read(snapshot=True) as conn:
            rows = _live_rows(conn, now, stale_s)
            owners = read_owners(conn, self.dialect)
            counts: dict[str, dict[str, int]] = {}
            for name, state, n in conn.execute(counted):
                per = counts.setdefault(name, {s.value: 0 for s in State})
                per[state] = int(n)
            names = sorted(counts)
            records: dict[str, JobRecord] = {}
            plains: dict[str, int] = {}
            for name in names:
                # The jobs on a server among them, of every partition: the servers'
                # lines name them.
                here = jobs.partition == name
                states = active if name == partition else [s for s in active if s != dead]
                held = _job_records(
                    conn.execute(sa.select(jobs_table).where(here, jobs.state.in_(states)))
                )
                claimed = _job_records(
                    conn.execute(
                        sa.select(jobs_table).where(
                            here, jobs.state == PENDING.value, jobs.claimed_by.is_not(None)
                        )
                    )
                )
                records.update((r.job_id, r) for r in [*held, *claimed])
                # Counted by the first query: counting them again reads the range again.
                plains[name] = counts[name][PENDING.value] - len(claimed)
            named = sorted(_named_ids(rows) - set(records))
            for i in range(0, len(named), 500):
                some = sa.select(jobs_table).where(jobs.job_id.in_(named[i : i + 500]), plain)
                records.update((r.job_id, r) for r in _job_records(conn.execute(some)))
            if partition is not None and plains.get(partition):
                # Unordered: sorting a million rows for the first thousand is the cost
                # this avoids; which ones are listed is said nowhere. By claimed_by (NULL
                # in each: no order) so that PostgreSQL reads the index's range: else it
                # takes the rows for spread over the table and scans it from its start,
                # past every job done (73 ms at 500,000).
                first = (
                    sa.select(jobs_table)
                    .where(jobs.partition == partition, plain)
                    .order_by(jobs.claimed_by)
                    .limit(PLAIN_LISTED)
                )
                records.update((r.job_id, r) for r in _job_records(conn.execute(first)))
        ordered = sorted(
            records.values(),
            key=lambda r: (r.partition, r.shot is None, r.shot or 0, r.line, r.job_id),
        )
        return StatusSnapshot(now, rows, owners, counts, ordered, plains)

    @retried
    def job_state_counts(self, partitions: Sequence[str] | None = None) -> dict[str, int]:
        """Jobs by state, of ``partitions`` (None: every partition), for the metrics."""
        jobs = jobs_table.c
        query = sa.select(jobs.state, sa.func.count()).group_by(jobs.state)
        if partitions is not None:
            query = query.where(jobs.partition.in_(list(partitions)))
        with self._read() as conn:
            return {str(state): int(n) for state, n in conn.execute(query)}

    @retried
    def attempt_outcome_counts(
        self, partitions: Sequence[str] | None = None
    ) -> dict[tuple[str, str], int]:
        """Attempts by (server, outcome) of the jobs of ``partitions`` (None: all)."""
        tries, jobs = attempts_table.c, jobs_table.c
        query = sa.select(tries.server, tries.outcome, sa.func.count()).group_by(
            tries.server, tries.outcome
        )
        if partitions is not None:
            query = query.join(jobs_table, jobs.job_id == tries.job_id).where(
                jobs.partition.in_(list(partitions))
            )
        with self._read() as conn:
            return {(server or "", outcome): int(n) for server, outcome, n in conn.execute(query)}

    def server_quarantined(self, server: str) -> bool:
        """Whether ``server`` is quarantined now (``store/health.py``: jobs failed there
        that rendered elsewhere), as the metrics read it."""
        record = self.server_health().get(server)  # type: ignore[attr-defined]
        return record is not None and record.state == "quarantined"


def _named_ids(rows: list[LiveRow]) -> set[str]:
    """The job ids the partition rows name: held back, let go, in a group's line."""
    named: set[str] = set()
    for r in rows:
        if r.kind != "partition":
            continue
        for key in ("held", "let_go"):
            ids = r.detail.get(key)
            if isinstance(ids, dict):
                named.update(str(i) for i in ids)
        for group in r.detail.get("groups") or []:
            if isinstance(group, dict):
                named.update(str(i) for i in group.get("jobs") or [])
    return named


def _live_rows(conn: sa.Connection, now: float, stale_s: float) -> list[LiveRow]:
    """``Live.live`` read on ``conn``, ages counted from ``now``."""
    query = (
        sa.select(live_table)
        .join(owners_table, owners_table.c.owner == live_table.c.owner, isouter=True)
        .where(live_table.c.updated_at >= now - stale_s)
        .where(owners_table.c.released_at.is_(None), owners_table.c.gone_at.is_(None))
        .order_by(live_table.c.updated_at, live_table.c.owner)
    )
    out = []
    for r in conn.execute(query).all():
        try:
            detail = json.loads(r.detail)
        except ValueError:
            continue  # a row written by another version: nothing we can show
        if isinstance(detail, dict):
            out.append(LiveRow(r.owner, r.kind, r.subject, detail, now - r.updated_at))
    return out
