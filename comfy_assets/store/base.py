"""What every part of the ``Store`` shares: connections, transactions, row locks,
compare-and-set updates, event rows, and the small conversions between rows and records.

Every method of the store is one short transaction, safe when many processes share the
database: SQLite write transactions start with ``BEGIN IMMEDIATE`` (one writer at a
time), PostgreSQL rows are locked with ``SELECT ... FOR UPDATE``, and every UPDATE repeats
what it read in its WHERE clause (compare-and-set) and checks the rowcount. Times are
epoch seconds by the database's clock (``store/clock.py``); every time-dependent method
takes ``now``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from comfy_assets.jobs.events import Event, log_event
from comfy_assets.jobs.states import (
    DONE,
    FAILED_FATAL,
    State,
)
from comfy_assets.store import statements as q
from comfy_assets.store.clock import DbClock
from comfy_assets.store.records import (
    JobRecord,
    ModelLoadRecord,
    UnknownJob,
)
from comfy_assets.store.retry import (
    Outage,
    mark_commit_unknown,
    mark_connecting,
)
from comfy_assets.store.schema import begin

_TERMINAL = DONE | {FAILED_FATAL}


class StoreBase:
    """The engine and the transaction plumbing the store's parts share."""

    engine: sa.Engine
    dialect: str
    retry_s: float
    outage: Outage
    clock: DbClock

    def now(self) -> float:
        """Epoch seconds by the database's clock (``store/clock.py``)."""
        return self.clock.now()

    def _now(self, now: float | None) -> float:
        """``now``, or the database's time when None (``store.clock``)."""
        return self.clock.now() if now is None else now

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with self._connect() as conn:
            body_done = False
            try:
                with conn.begin():
                    begin(conn, write=True)
                    yield conn
                    body_done = True
            except sa.exc.DBAPIError as error:
                if body_done:  # the commit itself failed: done or not, nobody knows
                    mark_commit_unknown(error)
                raise

    @contextmanager
    def _write_logged(self) -> Iterator[tuple[sa.Connection, list[Event]]]:
        """A write transaction (``_write``) and a list for the events it writes: their
        JSON log lines once it commits, none when it does not."""
        written: list[Event] = []
        with self._write() as conn:
            yield conn, written
        for event in written:
            log_event(event)

    @contextmanager
    def _read(self, *, snapshot: bool = False) -> Iterator[sa.Connection]:
        """A read transaction. ``snapshot``: its statements all see the database at one
        moment (SQLite's reads within a transaction do; PostgreSQL's need REPEATABLE READ,
        its READ COMMITTED giving each statement its own moment)."""
        with self._connect() as conn:
            if snapshot and self.dialect == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                begin(conn, write=False)
                yield conn

    def _connect(self) -> sa.Connection:
        try:
            return self.engine.connect()
        except sa.exc.DBAPIError as error:
            mark_connecting(error)
            raise

    def _autocommit_first(self, stmt: sa.Executable, params: dict[str, Any]) -> sa.Row | None:
        """PostgreSQL: the first row of ``stmt``, run as one autocommit statement (one
        round trip, atomic on its own). An error marks the commit as unknown (``retry``):
        the statement may have been applied."""
        with self._connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            try:
                return conn.execute(stmt, params).first()
            except sa.exc.DBAPIError as error:
                mark_commit_unknown(error)
                raise

    def _write_one(self, stmt: sa.Executable, params: dict[str, Any]) -> int:
        """Run ``stmt``, one write statement, as a transaction of its own; the rows it
        changed. On PostgreSQL an autocommit statement (no BEGIN and COMMIT to send:
        ``_autocommit_first``), on SQLite a write transaction (``_write``)."""
        if self.dialect != "postgresql":
            with self._write() as conn:
                return int(conn.execute(stmt, params).rowcount)
        with self._connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            try:
                return int(conn.execute(stmt, params).rowcount)
            except sa.exc.DBAPIError as error:
                mark_commit_unknown(error)
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
            conn.execute(q.INSERT_EVENTS, [{**r, "id": i} for r, i in zip(rows, ids, strict=True)])
        return [dataclasses.replace(e, id=i) for e, i in zip(events, ids, strict=True)]

    def _event_ids(self, conn: sa.Connection, n: int) -> list[int]:
        if self.dialect == "postgresql":
            return sorted(conn.execute(q.NEXT_EVENT_IDS, {"n": n}).scalars())
        # SQLite: this transaction holds the write lock, so nobody else takes these ids.
        last = conn.execute(q.LAST_EVENT_ID).scalar_one()
        return list(range(last + 1, last + 1 + n))


# C0 control characters and DEL.
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def folder_name(name: str, what: str) -> str:
    """``name`` when it can be a folder of the store (a partition, a job id); raises
    ValueError naming ``what`` for "", ".", "..", a separator, a control character (NUL
    and newlines included), white space at either end, more than 255 bytes of UTF-8
    (a file name's limit on Linux and macOS), or store.db*."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\"):
        raise ValueError(f"{what} {name!r} cannot be used as a folder name")
    if _CONTROL.search(name) or name != name.strip():
        raise ValueError(
            f"{what} {name!r} cannot be used as a folder name (control characters, or white "
            "space at an end)"
        )
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise ValueError(
            f"{what} {name[:40]!r}... is {len(name.encode('utf-8', 'surrogatepass'))} bytes "
            "long: a folder name has at most 255"
        )
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


def _job_record(row: sa.Row[Any] | Mapping[str, Any]) -> JobRecord:
    """The record of a jobs row, or of its columns by name."""
    values = dict(row._mapping if isinstance(row, sa.Row) else row)
    values["set"] = json.loads(values.pop("set_json"))
    values["inputs"] = tuple(json.loads(values.pop("inputs_json") or "[]"))
    values["state"] = State(values["state"])
    values["optional"] = bool(values["optional"])
    return JobRecord(**values)


def _job_records(result: sa.CursorResult[Any]) -> list[JobRecord]:
    """The records of ``result``'s jobs rows, each column's name read once: a row's
    ``_mapping`` costs as much as the rest of ``_job_record``."""
    keys = list(result.keys())
    return [_job_record(dict(zip(keys, row, strict=True))) for row in result]


def _model_load_record(row: sa.Row[*tuple[Any, ...]]) -> ModelLoadRecord:
    """The record of a row of ``statements.MODEL_TRIES``."""
    return ModelLoadRecord(
        row.job_id,
        row.attempt,
        row.server,
        tuple(json.loads(row.models)),
        bool(row.loaded),
        row.outcome,
        row.gpu_seconds,
    )
