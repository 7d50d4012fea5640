"""The farm bench's database: a PostgreSQL server of its own, and what it counts.

A server of the bench's own (``initdb`` in a temporary folder, started with
``pg_stat_statements`` preloaded) keeps the counts apart from anything else using the
machine's server, and gives every statement the store sends, counted by PostgreSQL
itself. ``Counters`` reads them from another database of that server (``postgres``), so
the bench's own queries are never counted with the store's.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg

from tests.farm.database import PrivatePostgres

DATABASE = "render"  # the store's database; the bench's queries go to "postgres"


@contextmanager
def private_postgres(address: str) -> Iterator[str]:
    """A PostgreSQL server of its own listening on ``address`` (and 127.0.0.1) with the
    settings of a packaged server (fsync on: the farm's ``PrivatePostgres``, durable),
    ``pg_stat_statements`` preloaded and created, and an empty database ``render``.
    Yields its SQLAlchemy URL (``postgresql+psycopg://postgres@ADDRESS:PORT/render``); the
    server is stopped and its folder removed at the end. Raises DatabaseError (with the
    tool's output) without the server programs or when it does not start."""
    db = PrivatePostgres(address, durable=True, database=DATABASE, preload=("pg_stat_statements",))
    try:
        with psycopg.connect(
            db.admin_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True
        ) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        yield db.url
    finally:
        db.close()


def server_cpu_s(url: str) -> float:
    """CPU seconds (user + system) the server at ``url`` has used so far: its postmaster
    and every process it runs now (backends, writers), from /proc. A backend that has
    exited is no longer counted: compare readings taken while the same sessions live."""
    host, port = url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
    del host
    pids = [
        int(p.split("/")[2]) for p in glob.glob("/proc/[0-9]*/cmdline") if _is_postmaster(p, port)
    ]
    ticks = 0
    todo = list(pids)
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue  # gone meanwhile
    return ticks / os.sysconf("SC_CLK_TCK")


def _is_postmaster(cmdline_path: str, port: str) -> bool:
    try:
        with open(cmdline_path, "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return (
        bool(args) and args[0].endswith(b"/postgres") and f"-p {port}".encode() in b" ".join(args)
    )


@dataclass
class Snapshot:
    """The store database's counts at one moment (``at``: time.monotonic()).

    ``statements``: calls per statement text as ``pg_stat_statements`` normalises it
    (every statement a client sent and the server ran, BEGIN/COMMIT/ROLLBACK included;
    not the statements run inside functions and triggers, nor one that failed to parse).
    ``rows``: rows those calls returned or changed, per statement text; ``exec_ms``: the
    server's time running them (milliseconds, lock waits included, not the network).
    ``commits``, ``rollbacks``: ``pg_stat_database`` of the store's database; a backend
    reports them when it goes idle, at most once a second, and at its exit.
    ``wal_bytes``, ``wal_syncs``: ``pg_stat_wal``, the whole server (the store's database
    is the only one written to), reported as the transaction counts are.
    """

    at: float
    commits: int
    rollbacks: int
    statements: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    exec_ms: dict[str, float] = field(default_factory=dict)
    wal_bytes: int = 0
    wal_syncs: int = 0

    @property
    def calls(self) -> int:
        return sum(self.statements.values())

    def minus(self, earlier: Snapshot) -> Snapshot:
        """The counts between ``earlier`` and this snapshot."""
        return Snapshot(
            self.at - earlier.at,
            self.commits - earlier.commits,
            self.rollbacks - earlier.rollbacks,
            {q: n - earlier.statements.get(q, 0) for q, n in self.statements.items()},
            {q: n - earlier.rows.get(q, 0) for q, n in self.rows.items()},
            {q: t - earlier.exec_ms.get(q, 0.0) for q, t in self.exec_ms.items()},
            self.wal_bytes - earlier.wal_bytes,
            self.wal_syncs - earlier.wal_syncs,
        )


class Counters:
    """Reads the store database's counts and connections from the ``postgres`` database
    of the same server (``url``: the store's SQLAlchemy URL)."""

    def __init__(self, url: str) -> None:
        plain = url.replace("postgresql+psycopg://", "postgresql://", 1)
        self._conn = psycopg.connect(plain.rsplit("/", 1)[0] + "/postgres", autocommit=True)
        self.database = plain.rsplit("/", 1)[1].split("?")[0]
        self.statements_available = bool(
            self._conn.execute(
                "SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'"
            ).fetchone()
        )
        self.peak_connections = 0
        self.peak_active = 0

    def snapshot(self) -> Snapshot:
        commits, rollbacks = self._conn.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
            (self.database,),
        ).fetchone()
        wal_bytes, wal_syncs = self._conn.execute(
            "SELECT wal_bytes, wal_sync FROM pg_stat_wal"
        ).fetchone()
        statements: dict[str, int] = {}
        rows: dict[str, int] = {}
        exec_ms: dict[str, float] = {}
        if self.statements_available:
            found = self._conn.execute(
                "SELECT query, calls, rows, total_exec_time FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s)",
                (self.database,),
            ).fetchall()
            for query, calls, n, ms in found:
                key = " ".join(query.split())
                statements[key] = statements.get(key, 0) + calls
                rows[key] = rows.get(key, 0) + n
                exec_ms[key] = exec_ms.get(key, 0.0) + ms
        return Snapshot(
            time.monotonic(),
            commits,
            rollbacks,
            statements,
            rows,
            exec_ms,
            int(wal_bytes),
            wal_syncs,
        )

    def sample_connections(self) -> tuple[int, int]:
        """Connections to the store's database now (all, and those running a statement);
        the peaks are kept in ``peak_connections`` and ``peak_active``."""
        total, active = self._conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'active') FROM pg_stat_activity "
            "WHERE datname = %s",
            (self.database,),
        ).fetchone()
        self.peak_connections = max(self.peak_connections, total)
        self.peak_active = max(self.peak_active, active)
        return total, active

    def close(self) -> None:
        self._conn.close()
