"""The database's clock: the one clock every lease, claim and heartbeat is judged by.

Hosts' clocks drift and can be set wrong; the database is the one place every process
reaches. PostgreSQL's ``clock_timestamp()`` gives its time (``pg_postmaster_start_time()``
when it last started); a SQLite store is a file of one host, whose clock it uses.

``DbClock`` keeps the offset between this host's clock and the database's, measured
around a statement that reads the database's time (error: half that statement's round
trip), so ``now()`` costs no query; every owner heartbeat measures it again.
"""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa


def wall_time(epoch: float) -> str:
    """``epoch`` (seconds) as this host's local date, time and zone, for people:
    ``2026-12-07 08:16:13 UTC`` (a time of day alone is ambiguous across days and hosts)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(epoch))


# Epoch seconds by the database's clock, and when the database last started (SQL
# expressions by dialect; SQLite never "restarts": 0).
_NOW_SQL = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_STARTED_SQL = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM pg_postmaster_start_time()) AS DOUBLE PRECISION)",
    "sqlite": "0.0",
}


def db_now(dialect: str) -> sa.ColumnElement[float]:
    """The database's time as a SQL expression (epoch seconds, a double)."""
    return sa.literal_column(_NOW_SQL[dialect], sa.Double)


def db_started(dialect: str) -> sa.ColumnElement[float]:
    """When the database server last started, as a SQL expression (epoch seconds; 0.0
    for SQLite)."""
    return sa.literal_column(_STARTED_SQL[dialect], sa.Double)


class DbClock:
    """This host's clock corrected to the database's: ``now()`` (epoch seconds). Safe
    from any thread. Until first measured, and for a database on this host
    (``same_host``: SQLite), the offset is 0."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()
        # SQLite's time is this host's, read to the millisecond only (julianday): a
        # measure would only add up to half a millisecond of error to every time.
        self.same_host = False

    @property
    def offset_s(self) -> float:
        """The database's clock minus this host's, in seconds."""
        return self._offset

    def now(self) -> float:
        """Epoch seconds by the database's clock."""
        return time.time() + self._offset

    def measured(self, db_time: float, asked_at: float, answered_at: float) -> None:
        """Take ``db_time``, read by a statement sent at ``asked_at`` and answered at
        ``answered_at`` (this host's ``time.time()``), as the database's time midway
        (ignored for a database on this host)."""
        if self.same_host:
            return
        with self._lock:
            self._offset = db_time - (asked_at + answered_at) / 2

    def measure(self, conn: sa.Connection, dialect: str) -> None:
        """Read the database's time on ``conn`` and take the offset from it."""
        if self.same_host:
            return  # this host's clock: nothing to measure
        asked_at = time.time()
        db_time = conn.execute(sa.select(db_now(dialect))).scalar_one()
        self.measured(float(db_time), asked_at, time.time())
