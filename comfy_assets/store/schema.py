"""Tables of the result store and the engine that reaches them (SQLite or PostgreSQL).

Times are seconds since the epoch (DOUBLE), durations seconds, sizes bytes.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import sqlalchemy as sa

metadata = sa.MetaData()

jobs_table = sa.Table(
    "comfy_jobs",
    metadata,
    sa.Column("job_id", sa.String(36), primary_key=True),
    sa.Column("partition", sa.String(255), nullable=False),
    sa.Column("line", sa.Integer, nullable=False),  # order within the job file
    sa.Column("prompt_id", sa.String(36), nullable=False),
    sa.Column("shot", sa.Integer),
    sa.Column("optional", sa.Boolean, nullable=False),
    sa.Column("duration_s", sa.Double),
    sa.Column("set_json", sa.Text, nullable=False),
    # The job's take (part of its prompt_id) and its input files (JSON list, see
    # store/register.py): what the results table names for each job.
    sa.Column("take", sa.Integer, nullable=False, server_default="1"),
    sa.Column("inputs_json", sa.Text),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    # Tries before the last requeue or change of inputs: attempt rows are numbered on
    # from there, so a rerun never overwrites the history (and cost) of earlier tries.
    sa.Column("attempts_before", sa.Integer, nullable=False, server_default="0"),
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
    # A partition's jobs by state, and its pending ones by whether anybody claims them:
    # counted by ``status`` without reading a million rows (``store/live.py``).
    sa.Index("ix_comfy_jobs_partition_state_claim", "partition", "state", "claimed_by"),
    # A storyboard's shot (``events --partition P --shot N``) without a partition's scan.
    sa.Index("ix_comfy_jobs_partition_shot", "partition", "shot"),
    # results.csv built from what changed (render/segments.py): a partition's jobs changed
    # since its last write, and a segment's jobs by their lines, each an indexed look.
    sa.Index("ix_comfy_jobs_partition_updated", "partition", "updated_at"),
    sa.Index("ix_comfy_jobs_partition_line", "partition", "line"),
)

attempts_table = sa.Table(
    "comfy_attempts",
    metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("comfy_jobs.job_id"), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("server", sa.String(255)),
    sa.Column("prompt_id", sa.String(36)),
    sa.Column("number", sa.Integer),
    sa.Column("started_at", sa.Double, nullable=False),
    sa.Column("ended_at", sa.Double, nullable=False),
    sa.Column("seconds", sa.Double, nullable=False),
    sa.Column("queue_wait_s", sa.Double),
    sa.Column("gpu_seconds", sa.Double),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text),
)

files_table = sa.Table(
    "comfy_files",
    metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("comfy_jobs.job_id"), primary_key=True),
    sa.Column("path", sa.Text, primary_key=True),  # relative to the job dir, "/" separated
    sa.Column("prompt_id", sa.String(36), nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("node_id", sa.String(64)),
    sa.Column("key", sa.String(64)),
    # Its media type (image/png, video/mp4): with path, bytes and sha256 the job's
    # manifest. NULL in rows made before (their readers judge it from the name).
    sa.Column("content_type", sa.String(255)),
)

events_table = sa.Table(
    "comfy_events",
    metadata,
    # SQLite auto-increments only an INTEGER PRIMARY KEY.
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
    sa.Column("time", sa.Double, nullable=False),
    sa.Column("job_id", sa.String(36), sa.ForeignKey("comfy_jobs.job_id"), nullable=False),
    sa.Column("partition", sa.String(255), nullable=False),
    sa.Column("from_state", sa.String(20)),
    sa.Column("to_state", sa.String(20), nullable=False),
    sa.Column("server", sa.String(255)),
    sa.Column("attempt", sa.Integer),
    sa.Column("detail", sa.Text),
    sa.Index("ix_comfy_events_job_id", "job_id"),
    # A partition's latest events (``events --partition P``, ``--before ID``) and their
    # count, as ranges: PostgreSQL's index on partition alone sorted millions of rows.
    sa.Index("ix_comfy_events_partition_id", "partition", "id"),
)

server_leases_table = sa.Table(
    "comfy_server_leases",
    metadata,
    sa.Column("server", sa.String(255), primary_key=True),
    sa.Column("owner", sa.String(255)),
    sa.Column("expires_at", sa.Double),
    sa.Column("prompt_id", sa.String(36)),
    sa.Column("last_model", sa.Text),
    sa.Column("updated_at", sa.Double, nullable=False),
)

# The model files of an attempt's job and whether its server had to load one for it
# (the pool's view when it sent the job there: pool/plan.py); written with the attempt
# row, for jobs that load models only.
model_loads_table = sa.Table(
    "comfy_model_loads",
    metadata,
    sa.Column("job_id", sa.String(36), sa.ForeignKey("comfy_jobs.job_id"), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("server", sa.String(255)),
    sa.Column("models", sa.Text, nullable=False),  # a JSON list of file names
    sa.Column("loaded", sa.Boolean, nullable=False),
)

# Pools with a consumer waiting for a server, so a pool that frees one hands it to another
# process instead of keeping it for its own next job (fairness across concurrent runs).
pool_waiters_table = sa.Table(
    "comfy_pool_waiters",
    metadata,
    sa.Column("owner", sa.String(255), primary_key=True),
    sa.Column("expires_at", sa.Double, nullable=False),
    # The servers it waits for, as " gpu0 gpu1 " (server names hold no spaces); NULL:
    # any server. A pool yields a server only to a process that could take it.
    sa.Column("servers", sa.Text),
    # The priority of the batch waiting (higher first): a freed server goes to the
    # highest waiting, equal ones take turns.
    sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
)

# What each running batch says of itself every few seconds, for `comfy-assets status`
# and the metrics (store/live.py): one row per (owner, kind, subject), a JSON detail.
live_table = sa.Table(
    "comfy_live",
    metadata,
    sa.Column("owner", sa.String(255), primary_key=True),
    sa.Column("kind", sa.String(16), primary_key=True),  # "partition" or "server"
    sa.Column("subject", sa.String(255), primary_key=True),  # its name
    sa.Column("detail", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

# Each server's health as every process sharing the store judges it (store/health.py):
# its state (ok, quarantined until ``until``, on trial after a cool-down), its strikes
# (jobs in a row that failed there and rendered elsewhere), the cool-down level, and its
# counts. ``failed_jobs``: a JSON list of the last jobs that failed there, each
# [job id, where it rendered, reason].
server_health_table = sa.Table(
    "comfy_server_health",
    metadata,
    sa.Column("server", sa.String(255), primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("until", sa.Double),
    sa.Column("strikes", sa.Integer, nullable=False),
    sa.Column("level", sa.Integer, nullable=False),
    sa.Column("quarantines", sa.Integer, nullable=False),
    sa.Column("failures_server", sa.Integer, nullable=False),
    sa.Column("failures_job", sa.Integer, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("failed_jobs", sa.Text),
    sa.Column("updated_at", sa.Double, nullable=False),
)

# Failures that may be the server's, until the job's next attempt elsewhere says whose
# they are (``verdict`` NULL: open; "server", "job" or "unknown" once judged). A server
# with open failures takes no job that has not failed elsewhere while a server without
# any can run it (render/queue.py).
server_failures_table = sa.Table(
    "comfy_server_failures",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
    sa.Column("server", sa.String(255), nullable=False),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("workflow_sha256", sa.String(64), nullable=False),
    sa.Column("signature", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("at", sa.Double, nullable=False),
    sa.Column("verdict", sa.String(8)),
    sa.Index("ix_comfy_server_failures_job", "job_id"),
    sa.Index("ix_comfy_server_failures_open", "server", "verdict"),
)

# Workflows (by sha256) known to fail in one node with one error on two servers: their
# jobs are dead letters at their first such failure.
workflow_failures_table = sa.Table(
    "comfy_workflow_failures",
    metadata,
    sa.Column("workflow_sha256", sa.String(64), primary_key=True),
    sa.Column("signature", sa.String(400), primary_key=True),
    sa.Column("servers", sa.Text, nullable=False),  # " gpu2 gpu0 "
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("at", sa.Double, nullable=False),
)

# What happened to a server: quarantined, on trial, re-admitted (by whom and why).
server_events_table = sa.Table(
    "comfy_server_events",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
    sa.Column("time", sa.Double, nullable=False),
    sa.Column("server", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
    sa.Index("ix_comfy_server_events_server", "server"),
)


# The object store whose records the database holds (one row, ``id`` 1), written by the
# first object store that opens it (store/belongs.py): a database serves one store, so
# another prefix or a folder store opening it is refused. Folder stores write none (one
# shared folder is mounted at different paths on different hosts).
store_table = sa.Table(
    "comfy_store",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("location", sa.Text, nullable=False),  # s3://BUCKET/PREFIX, no credential
    sa.Column("recorded_at", sa.Double, nullable=False),
)

# Seconds between an owner's heartbeats, and the silence after which it is gone.
OWNER_BEAT_S = 2.0
OWNER_DEAD_S = 10.0

# The processes that hold claims and leases (owners), with their heartbeats: an owner is
# known to be gone when it released itself or its heartbeat stopped (store/owners.py),
# whatever its host name and pid say. Times are the database's clock.
owners_table = sa.Table(
    "comfy_owners",
    metadata,
    sa.Column("owner", sa.String(255), primary_key=True),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("run_id", sa.String(64)),  # the Dagster run it renders for, if any
    sa.Column("started_at", sa.Double, nullable=False),
    sa.Column("beat_at", sa.Double, nullable=False),
    sa.Column("gone_at", sa.Double),  # when another process found it gone
    sa.Column("released_at", sa.Double),  # when it ended by itself
    sa.Index("ix_comfy_owners_run_id", "run_id"),
)

# Jobs submitted through the HTTP API (comfy_assets/api): the client that owns each, the
# request's content (to tell a retry from a conflict), the queue message to publish (again
# after a crash or a requeue) and the job's webhook; store/api_jobs.py reads and writes
# them, with the webhook outbox.
api_jobs_table = sa.Table(
    "comfy_api_jobs",
    metadata,
    sa.Column("job_id", sa.String(36), primary_key=True),
    sa.Column("client", sa.String(255), nullable=False),
    sa.Column("content_json", sa.Text, nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("webhook", sa.Text),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("published_at", sa.Double),
    sa.Column("notified_at", sa.Double),  # the finished_at its last webhook was made for
    # The take of ``content_json``, compared in SQL: a request's take is accepted once.
    sa.Column("take", sa.Integer, nullable=False, server_default="1"),
    sa.Index("ix_comfy_api_jobs_client", "client"),
    sa.Index("ix_comfy_api_jobs_published_at", "published_at"),  # NULL: to publish
)

api_webhooks_table = sa.Table(
    "comfy_api_webhooks",
    metadata,
    sa.Column("webhook_id", sa.String(64), primary_key=True),
    sa.Column("job_id", sa.String(36), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_at", sa.Double),  # NULL once delivered or given up
    sa.Column("delivered_at", sa.Double),
    sa.Column("given_up_at", sa.Double),
    sa.Column("last_error", sa.Text),
    # Whose deliveries these are, for the outbox's shares: the URL's scheme://host:port
    # and the job's client (NULL in rows made before: judged from the URL and the job).
    sa.Column("receiver", sa.Text),
    sa.Column("client", sa.String(255)),
    sa.Index("ix_comfy_api_webhooks_next_at", "next_at"),
)

# Seconds a PostgreSQL connect may take before it counts as a failed one (then retried).
CONNECT_TIMEOUT_S = 10
# Seconds a pooled PostgreSQL connection may wait in the pool and be handed out unchecked.
PING_IDLE_S = 1.0

# Checkpoint the SQLite WAL every this many pages (of 4 KiB), and truncate it to this
# many bytes after a checkpoint.
WAL_PAGES = 256
WAL_BYTES = 1 << 20


# How long a SQLite statement waits for another process's lock before it fails.
SQLITE_BUSY_S = 60.0


def _set_wal(cur: Any) -> None:
    """Put the database in WAL mode, waiting for the lock like any write: SQLite does not
    call its busy handler for the switch, so two processes opening a new store at once
    would otherwise see "database is locked" at once. Raises sqlite3.OperationalError
    for any other failure, or once SQLITE_BUSY_S have passed."""
    give_up_at = time.monotonic() + SQLITE_BUSY_S
    delay = 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= give_up_at:
                raise
        time.sleep(delay)  # another process holds the lock: its switch takes milliseconds
        delay = min(delay * 2, 0.2)


def make_engine(db_url: str) -> sa.Engine:
    """An engine for ``db_url``. SQLite gets WAL, a busy timeout, and no transaction of
    the driver's: each transaction starts with ``begin`` (below)."""
    url = sa.make_url(db_url)
    if url.get_backend_name() != "sqlite":
        connect_args: dict[str, Any] = {}
        if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
            # A server that drops our packets (a partition, a failover's new address not
            # up yet) would otherwise hold a connect for minutes, past any retry budget.
            connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
        if url.get_backend_name() != "postgresql" or url.get_driver_name() != "psycopg":
            return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
        engine = sa.create_engine(url, connect_args=connect_args)
        sa.event.listen(engine, "checkin", _idle_since)
        sa.event.listen(engine, "checkout", _ping_if_idle)
        return engine
    # Last in, first out: a transaction takes the connection used last, whose page cache
    # is still valid (SQLite drops a connection's cache when another one has written), so
    # a job's pages are not read again from the WAL at every transaction.
    engine = sa.create_engine(url, connect_args={"timeout": 60.0}, pool_use_lifo=True)

    @sa.event.listens_for(engine, "connect")
    def _configure(dbapi_conn: Any, _record: Any) -> None:
        # We emit BEGIN ourselves (``begin``): the driver's own comes too late, at the
        # first write, which turns a read-then-write into a lock upgrade that can fail.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_S * 1000:.0f}")
        _set_wal(cur)
        # NORMAL in WAL mode survives a process crash; a power cut may lose the last
        # commits, which idempotent prompt_ids make cheap to redo.
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        # The WAL is folded into the database every WAL_PAGES pages and cut back to
        # WAL_BYTES after: left at SQLite's 1000 pages and no limit, it alone can fill
        # a small disk (4 MB of page versions), and stays that size after.
        cur.execute(f"PRAGMA wal_autocheckpoint = {WAL_PAGES}")
        cur.execute(f"PRAGMA journal_size_limit = {WAL_BYTES}")
        cur.close()

    return engine


def _idle_since(_dbapi_conn: Any, record: Any) -> None:
    """Note when a connection went back to the pool (``_ping_if_idle``)."""
    if record is not None:
        record.info["idle_since"] = time.monotonic()


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Check a pooled psycopg connection that waited in the pool more than ``PING_IDLE_S``
    as the pool hands it out (what SQLAlchemy's ``pool_pre_ping`` does at every
    checkout), with an empty query. Any query, an empty one too, is a transaction in
    PostgreSQL's statistics and a round trip: at every checkout it was one more per store
    call (about 5 a job of ``bench/farm.py``). A connection in steady use is not checked:
    one lost meanwhile (a restart) fails its next statement as a lost connection, which
    the store's calls try again (``store/retry.py``) on a new one. Raises
    DisconnectionError for a connection the server no longer answers on, which the pool
    replaces with a new one."""
    idle_since = record.info.get("idle_since")
    if idle_since is None or time.monotonic() - idle_since < PING_IDLE_S:
        return  # new, or back in the pool a moment ago
    from psycopg import pq  # its engine loaded psycopg already

    try:
        answer = dbapi_conn.pgconn.exec_(b"")
    except Exception as e:  # psycopg.OperationalError: the connection is closed
        raise sa.exc.DisconnectionError(f"a pooled connection is lost ({e})") from e
    if answer.status != pq.ExecStatus.EMPTY_QUERY:
        error = answer.error_message.decode("utf-8", "replace").strip()
        raise sa.exc.DisconnectionError(f"a pooled connection is lost ({error})")


def begin(conn: sa.Connection, *, write: bool) -> None:
    """Start SQLite's transaction on ``conn``, just after ``conn.begin()``: a write one
    takes the write lock up front (``BEGIN IMMEDIATE``), so processes sharing the file
    queue for it instead of failing at a lock upgrade; a read one is a plain BEGIN (its
    statements see one moment). PostgreSQL's needs nothing more. Emitted here, not from
    an engine event: a listener on the engine makes every statement of every connection
    dispatch events, which costs more than the statements themselves."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


# Columns added to a table after stores were made without them: (table, column), each
# nullable or with a server default, so existing rows read as before.
ADDED_COLUMNS: tuple[tuple[sa.Table, str], ...] = (
    (jobs_table, "take"),
    (jobs_table, "inputs_json"),
    (pool_waiters_table, "servers"),
    (pool_waiters_table, "priority"),
    (api_jobs_table, "take"),
    (api_webhooks_table, "receiver"),
    (api_webhooks_table, "client"),
    (files_table, "content_type"),
)


# Indexes added to a table after stores were made without them (``create_all`` makes
# the indexes of the tables it creates only): (table, index name).
ADDED_INDEXES: tuple[tuple[sa.Table, str], ...] = (
    (jobs_table, "ix_comfy_jobs_partition_state_claim"),
    (jobs_table, "ix_comfy_jobs_partition_shot"),
    (events_table, "ix_comfy_events_partition_id"),
    (jobs_table, "ix_comfy_jobs_partition_updated"),
    (jobs_table, "ix_comfy_jobs_partition_line"),
)

# Indexes a store made earlier has that an added one replaces: (table, index name),
# dropped when the store is opened (each costs a write per row and serves no query).
REPLACED_INDEXES: tuple[tuple[sa.Table, str], ...] = (
    (jobs_table, "ix_comfy_jobs_partition_state"),
    (events_table, "ix_comfy_events_partition"),
)


def create_tables(engine: sa.Engine) -> None:
    """Create missing tables and indexes, and add the columns of ``ADDED_COLUMNS`` and
    the indexes of ``ADDED_INDEXES`` that a store made earlier lacks (an index of a big
    table takes seconds, once), dropping those of ``REPLACED_INDEXES``; safe when several
    processes start at once."""
    with engine.begin() as conn:
        begin(conn, write=True)
        if engine.dialect.name == "postgresql":
            # create_all checks, then creates: serialise first starts (SQLite's
            # BEGIN IMMEDIATE already does).
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7202411)"))
        metadata.create_all(conn)
        _add_columns(conn)
        _add_indexes(conn)


def _add_columns(conn: sa.Connection) -> None:
    inspector = sa.inspect(conn)
    for table, name in ADDED_COLUMNS:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        if name in present:
            continue
        column = table.c[name]
        kind = column.type.compile(dialect=conn.dialect)
        default = column.server_default
        # Every column added to an existing table has a plain server default or none.
        clause = f" NOT NULL DEFAULT {default.arg}" if isinstance(default, sa.DefaultClause) else ""
        conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {name} {kind}{clause}"))


def _add_indexes(conn: sa.Connection) -> None:
    inspector = sa.inspect(conn)
    present: dict[str, set[str]] = {}
    for table, name in ADDED_INDEXES:
        if table.name not in present:
            present[table.name] = {str(i["name"]) for i in inspector.get_indexes(table.name)}
        if name not in present[table.name]:
            next(i for i in table.indexes if i.name == name).create(conn)
    for table, name in REPLACED_INDEXES:
        if table.name not in present:
            present[table.name] = {str(i["name"]) for i in inspector.get_indexes(table.name)}
        if name in present[table.name]:
            conn.execute(sa.text(f"DROP INDEX {name}"))
