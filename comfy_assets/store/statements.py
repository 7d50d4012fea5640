"""The store's hot statements, built once with bind parameters.

Building a Core statement and its cache key costs more than SQLite takes to run it;
prebuilt statements keep a store call near a tenth of a millisecond. Bind names start
with ``b_`` (WHERE) or ``v_`` (new values): SQLAlchemy reserves the bare column names.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from comfy_assets.jobs.states import DONE, FAILED_FATAL
from comfy_assets.store.clock import db_now, db_started
from comfy_assets.store.records import StoreConflict
from comfy_assets.store.schema import (
    OWNER_DEAD_S,
    attempts_table,
    events_table,
    files_table,
    jobs_table,
    model_loads_table,
    owners_table,
    pool_waiters_table,
    server_leases_table,
)

JOB = jobs_table.c  # columns
ATTEMPT = attempts_table.c  # columns
FILE = files_table.c  # columns
EVENT = events_table.c  # columns
LEASE = server_leases_table.c  # columns
WAITER = pool_waiters_table.c  # columns
OWNER = owners_table.c  # columns
MODEL_LOAD = model_loads_table.c  # columns


def expect_rows(result: sa.CursorResult, expected: int, what: str) -> None:
    """Raise StoreConflict unless the statement changed ``expected`` rows."""
    if result.rowcount != expected:
        raise StoreConflict(f"{what}: {result.rowcount} rows changed, expected {expected}")


def _b(name: str, type_: Any = None) -> sa.BindParameter:
    return sa.bindparam(name, type_=type_)


def insert_for(dialect: str, table: sa.Table) -> Any:
    """INSERT with ON CONFLICT support for ``dialect`` ("sqlite" or "postgresql")."""
    if dialect == "postgresql":
        # Imported here: its engine loads it anyway, and a SQLite store never needs it.
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    return sqlite.insert(table)


def gone_condition(dialect: str, dead_s: float = OWNER_DEAD_S) -> sa.ColumnElement[bool]:
    """SQL: the owner row is gone (``store/owners.py``): released, found gone, or
    silent for ``dead_s`` by the database's clock while the database has been up that long."""
    now = db_now(dialect)
    return sa.or_(
        OWNER.released_at.is_not(None),
        OWNER.gone_at.is_not(None),
        sa.and_(OWNER.beat_at < now - dead_s, db_started(dialect) < now - dead_s),
    )


def gone_owners(dialect: str) -> sa.Select:
    """SQL: the owners that are gone (``gone_condition``)."""
    return sa.select(OWNER.owner).where(gone_condition(dialect))


SELECT_JOB = sa.select(jobs_table).where(JOB.job_id == _b("b_id"))
LOCK_JOB = SELECT_JOB.with_for_update()

CLAIM = (
    jobs_table.update()
    .where(
        JOB.job_id == _b("b_id"),
        JOB.state == _b("b_state"),
        JOB.claimed_by.is_not_distinct_from(_b("b_holder", sa.String)),
    )
    .values(claimed_by=_b("v_owner"), claim_expires_at=_b("v_expires"), updated_at=_b("v_now"))
)
# The job's row while ``b_owner`` holds its claim.
# The claim of a job that is free or already ``v_owner``'s and not finished, returning
# the job's row as the claim leaves it; no rows for any other job.
CLAIM_FREE = (
    jobs_table.update()
    .where(
        JOB.job_id == _b("b_id"),
        # Not NOT IN: its list is bound anew at every execution (an expanding parameter).
        *(JOB.state != s for s in sorted(s.value for s in (*DONE, FAILED_FATAL))),
        sa.or_(JOB.claimed_by.is_(None), JOB.claimed_by == _b("v_owner")),
        # The caller's prompt, when it names one (``Claims.claim_job``).
        sa.or_(_b("b_prompt", sa.String).is_(None), JOB.prompt_id == _b("b_prompt", sa.String)),
    )
    .values(claimed_by=_b("v_owner"), claim_expires_at=_b("v_expires"), updated_at=_b("v_now"))
    .returning(*jobs_table.c)
)
# The tries that load models, each with its attempt's outcome and GPU seconds, by job and
# attempt (``Store.model_loads``, a segment's ``model_tries``): narrowed by their caller.
MODEL_TRIES = (
    sa.select(
        MODEL_LOAD.job_id,
        MODEL_LOAD.attempt,
        MODEL_LOAD.server,
        MODEL_LOAD.models,
        MODEL_LOAD.loaded,
        ATTEMPT.outcome,
        ATTEMPT.gpu_seconds,
    )
    .join(
        attempts_table,
        (ATTEMPT.job_id == MODEL_LOAD.job_id) & (ATTEMPT.attempt == MODEL_LOAD.attempt),
    )
    .order_by(MODEL_LOAD.job_id, MODEL_LOAD.attempt)
)

# SQLite: a new job's row (binds are the column names), returned; no row when its id
# is known (``Claims.register_claimed``).
INSERT_NEW_JOB = sqlite.insert(jobs_table).on_conflict_do_nothing().returning(*jobs_table.c)
_OWN_CLAIM = jobs_table.update().where(JOB.job_id == _b("b_id"), JOB.claimed_by == _b("b_owner"))
RENEW_CLAIM = _OWN_CLAIM.values(claim_expires_at=_b("v_expires"), updated_at=_b("v_now"))
RELEASE_CLAIM = _OWN_CLAIM.values(claimed_by=None, claim_expires_at=None)
BUMP_ATTEMPTS = (
    jobs_table.update()
    .where(JOB.job_id == _b("b_id"))
    .values(
        attempts=sa.case(
            (
                JOB.attempts < _b("b_attempt", sa.Integer) - JOB.attempts_before,
                _b("b_attempt") - JOB.attempts_before,
            ),
            else_=JOB.attempts,
        ),
        updated_at=_b("v_now"),
    )
)
TOTALS = sa.select(
    sa.func.count(),
    sa.func.sum(ATTEMPT.seconds),
    sa.func.sum(ATTEMPT.queue_wait_s),
    sa.func.sum(
        sa.func.coalesce(
            ATTEMPT.gpu_seconds, ATTEMPT.seconds - sa.func.coalesce(ATTEMPT.queue_wait_s, 0.0)
        )
    ),
).where(ATTEMPT.job_id == _b("b_id"))
# TOTALS of the job's attempts but ``b_attempt`` (about to be written).
TOTALS_OTHERS = TOTALS.where(ATTEMPT.attempt != _b("b_attempt"))
DELETE_FILES = files_table.delete().where(FILE.job_id == _b("b_id"))
INSERT_FILES = files_table.insert()
INSERT_EVENT = events_table.insert().returning(EVENT.id)
INSERT_EVENTS = events_table.insert()  # rows with their ids (``StoreBase._event_ids``)
LAST_EVENT_ID = sa.select(sa.func.coalesce(sa.func.max(EVENT.id), 0))
NEXT_EVENT_IDS = sa.text(
    "SELECT nextval(pg_get_serial_sequence('comfy_events', 'id')) FROM generate_series(1, :n)"
)


@cache
def server_leases(dialect: str) -> Any:
    """Every server lease, with ``holder_gone``: whether its owner is gone."""
    gone = LEASE.owner.in_(gone_owners(dialect))
    return sa.select(server_leases_table, gone.label("holder_gone")).order_by(LEASE.server)


# Another owner than ``b_owner`` waiting for a server at ``b_now``.
OTHERS_WAITING = (
    sa.select(WAITER.owner)
    .where(
        WAITER.priority >= _b("b_priority", sa.Integer),
        WAITER.owner != _b("b_owner"),
        WAITER.expires_at > _b("b_now"),
        sa.or_(
            WAITER.servers.is_(None),
            # b_server is "% name %", the name's LIKE wildcards escaped (store/leases.py).
            WAITER.servers.like(_b("b_server", sa.String), escape="\\"),
        ),
    )
    .limit(1)
)

# The marks of owners other than ``b_owner`` standing at ``b_now``.
WAITING_MARKS = sa.select(WAITER.servers, WAITER.priority).where(
    WAITER.owner != _b("b_owner"), WAITER.expires_at > _b("b_now")
)

# The server's lease row while ``b_owner`` holds it.
_OWN_LEASE = server_leases_table.update().where(
    LEASE.server == _b("b_server"), LEASE.owner == _b("b_owner")
)
RENEW_SERVER = _OWN_LEASE.values(expires_at=_b("v_expires"), updated_at=_b("v_now"))
RELEASE_SERVER = _OWN_LEASE.values(
    owner=None,
    expires_at=None,
    prompt_id=None,
    last_model=sa.func.coalesce(_b("v_model", sa.Text), LEASE.last_model),
    updated_at=_b("v_now"),
)

ATTEMPT_COLUMNS = tuple(c.name for c in attempts_table.columns)


@cache
def guarded_update(columns: tuple[str, ...]) -> sa.Update:
    """UPDATE jobs SET <columns> (binds ``v_<column>``) only if state and claim are still
    what was read (binds ``b_id``, ``b_state``, ``b_holder``): a compare-and-set."""
    return (
        jobs_table.update()
        .where(
            JOB.job_id == _b("b_id"),
            JOB.state == _b("b_state"),
            JOB.claimed_by.is_not_distinct_from(_b("b_holder", sa.String)),
        )
        .values({c: _b(f"v_{c}") for c in columns})
    )


@cache
def move(columns: tuple[str, ...]) -> sa.Update:
    """Set ``columns`` (binds ``v_<column>``; ``first_submitted_at`` only where it is
    NULL) on the job ``b_id`` if it is in state ``b_state`` and claimed by ``b_owner``,
    returning its ``job_id`` and ``partition``: no rows when the job is not as the caller
    said. UPDATE ... RETURNING: PostgreSQL, and SQLite from 3.35."""
    values: dict[str, Any] = {c: _b(f"v_{c}") for c in columns}
    if "first_submitted_at" in values:
        values["first_submitted_at"] = sa.func.coalesce(JOB.first_submitted_at, _b("v_now"))
    return (
        jobs_table.update()
        .where(
            JOB.job_id == _b("b_id"), JOB.state == _b("b_state"), JOB.claimed_by == _b("b_owner")
        )
        .values(values)
        .returning(JOB.job_id, JOB.partition)
    )


@cache
def move_and_log(columns: tuple[str, ...]) -> sa.Insert:
    """PostgreSQL only: ``move(columns)`` and the insert of its event (binds ``e_*``) in
    one statement, returning the event's id: no rows when the job is not as the caller
    said. A data-modifying CTE, so in autocommit the change is one round trip and still
    atomic."""
    moved = move(columns).cte("moved")
    event = sa.select(
        sa.cast(_b("e_time"), sa.Double),
        moved.c.job_id,
        moved.c.partition,
        sa.cast(_b("e_from"), sa.String),
        sa.cast(_b("e_to"), sa.String),
        sa.cast(_b("e_server"), sa.String),
        sa.cast(_b("e_attempt"), sa.Integer),
        sa.cast(_b("e_detail"), sa.Text),
    )
    names = ["time", "job_id", "partition", "from_state", "to_state", "server", "attempt"]
    return (
        events_table.insert()
        .from_select([*names, "detail"], event)
        .returning(EVENT.id, EVENT.partition)
        .add_cte(moved)
    )


@cache
def upsert_attempt(dialect: str) -> Any:
    """INSERT an attempt row (binds are the column names), replacing the same number."""
    insert = insert_for(dialect, attempts_table)
    return insert.on_conflict_do_update(
        index_elements=["job_id", "attempt"],
        set_={c: insert.excluded[c] for c in ATTEMPT_COLUMNS if c not in ("job_id", "attempt")},
    )


@cache
def acquire_server(dialect: str) -> Any:
    """Upsert that takes a server only if free, expired, held by a gone owner or already
    ``v_owner``'s (binds
    ``v_server``, ``v_owner``, ``v_expires``, ``v_prompt``, ``v_now``)."""
    insert = insert_for(dialect, server_leases_table).values(
        server=_b("v_server"),
        owner=_b("v_owner"),
        expires_at=_b("v_expires"),
        prompt_id=_b("v_prompt", sa.String),
        updated_at=_b("v_now"),
    )
    upsert = insert.on_conflict_do_update(
        index_elements=["server"],
        set_={
            "owner": insert.excluded.owner,
            "expires_at": insert.excluded.expires_at,
            "prompt_id": insert.excluded.prompt_id,
            "updated_at": insert.excluded.updated_at,
        },
        # Compared with the row as it stands when the conflict is found: atomic.
        where=sa.or_(
            LEASE.owner.is_(None),
            LEASE.owner == insert.excluded.owner,
            LEASE.expires_at <= insert.excluded.updated_at,
            # Its holder is gone: a prompt of its still on the server keeps the pool
            # from posting there (an orphan) until it ends or a catch-up adopts it.
            LEASE.owner.in_(gone_owners(dialect)),
        ),
    )
    # SQLAlchemy keeps an INSERT's rowcount only when asked; 0 means "not taken".
    return upsert.execution_options(preserve_rowcount=True)


@cache
def upsert_model_load(dialect: str) -> Any:
    """INSERT an attempt's model row (binds are the column names), replacing the same
    number."""
    insert = insert_for(dialect, model_loads_table)
    return insert.on_conflict_do_update(
        index_elements=["job_id", "attempt"],
        set_={c: insert.excluded[c] for c in ("server", "models", "loaded")},
    )


@cache
def note_server_model(dialect: str) -> Any:
    """Upsert that sets the models a server holds (``last_model``; binds ``v_server``,
    ``v_model``, ``v_now``) whoever holds its lease, the lease itself untouched."""
    insert = insert_for(dialect, server_leases_table).values(
        server=_b("v_server"), last_model=_b("v_model", sa.Text), updated_at=_b("v_now")
    )
    return insert.on_conflict_do_update(
        index_elements=["server"], set_={"last_model": insert.excluded.last_model}
    )


@cache
def upsert_waiter(dialect: str) -> Any:
    """INSERT a pool waiter row (binds ``owner``, ``expires_at``, ``servers``,
    ``priority``), or move its expiry, servers and priority."""
    insert = insert_for(dialect, pool_waiters_table)
    return insert.on_conflict_do_update(
        index_elements=["owner"],
        set_={
            "expires_at": insert.excluded.expires_at,
            "servers": insert.excluded.servers,
            "priority": insert.excluded.priority,
        },
    )
