"""PostgreSQL statements that write a job's whole change in one round trip: data-modifying
CTEs, each built once per shape and cached.

A job of a worker costs its database a handful of statements (``bench/farm.py``:
``db_statements_per_job``); each statement here takes the place of several: a new job
registered with its claim and its event, and a done record's attempt row, job row,
files and events after its row lock. Bind names follow ``statements.py``: ``b_`` for
WHERE, ``v_`` for values, ``e<i>_`` for the i-th event, ``f<i>_`` for the i-th file.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from comfy_assets.store.schema import (
    attempts_table,
    events_table,
    files_table,
    jobs_table,
    model_loads_table,
)
from comfy_assets.store.statements import ATTEMPT_COLUMNS, EVENT, FILE, JOB, guarded_update

# The columns of a job row a registration sets (the rest keep their defaults).
REGISTERED_COLUMNS = (
    "job_id",
    "partition",
    "line",
    "prompt_id",
    "shot",
    "optional",
    "duration_s",
    "set_json",
    "take",
    "inputs_json",
    "state",
    "attempts",
    "attempts_before",
    "claimed_by",
    "claim_expires_at",
    "created_at",
    "updated_at",
)
EVENT_COLUMNS = ("time", "job_id", "partition", "from_state", "to_state", "server", "attempt")
FILE_COLUMNS = ("job_id", "path", "prompt_id", "sha256", "bytes", "node_id", "key")
_FILE_UPDATED = ("prompt_id", "sha256", "bytes", "node_id", "key")


def _typed(name: str, column: sa.Column[Any]) -> sa.Cast[Any]:
    """The bind ``name`` cast to ``column``'s type: PostgreSQL cannot tell the type of a
    parameter in a SELECT list, and a NULL needs one too."""
    return sa.cast(sa.bindparam(name, type_=column.type), column.type)


@cache
def register_claimed() -> sa.Select[Any]:
    """A new job inserted pending and claimed (binds ``v_<column>`` of
    ``REGISTERED_COLUMNS``), with its "registered" event (binds ``e_time``,
    ``e_detail``), returning the job's row and the event's id (``event_id``); no rows
    when the job id exists already (then nothing is written). Taken under the shared
    form of the partition's registration lock (bind ``b_lock``: ``register:<partition>``,
    as ``store/register.py`` takes it exclusively), so a whole file's registration
    never sees a job appear under it, while single jobs of one partition do not wait
    for each other."""
    lock = sa.select(
        sa.func.pg_advisory_xact_lock_shared(
            sa.func.hashtext(sa.bindparam("b_lock", type_=sa.String))
        ).label("locked")
    ).cte("registration_lock")
    source = sa.select(*(_typed(f"v_{c}", JOB[c]) for c in REGISTERED_COLUMNS)).select_from(lock)
    inserted = (
        postgresql.insert(jobs_table)
        .from_select(list(REGISTERED_COLUMNS), source)
        .on_conflict_do_nothing(index_elements=["job_id"])
        .returning(*jobs_table.c)
        .cte("inserted")
    )
    event_source = sa.select(
        _typed("e_time", EVENT.time),
        inserted.c.job_id,
        inserted.c.partition,
        sa.cast(sa.null(), EVENT.from_state.type),
        inserted.c.state,
        sa.cast(sa.null(), EVENT.server.type),
        sa.cast(sa.null(), EVENT.attempt.type),
        _typed("e_detail", EVENT.detail),
    )
    event = (
        events_table.insert()
        .from_select([*EVENT_COLUMNS, "detail"], event_source)
        .returning(EVENT.id)
        .cte("registered")
    )
    return sa.select(inserted, event.c.id.label("event_id")).select_from(
        inserted.join(event, sa.true())
    )


@cache
def finish(
    columns: tuple[str, ...], files: int, events: int, *, attempt: bool, models: bool
) -> sa.Select[Any]:
    """A job's end after its row lock, in one statement: the guarded update of
    ``columns`` (``statements.guarded_update``: binds ``b_id``, ``b_state``, ``b_holder``,
    ``v_<column>``), with ``attempt`` the attempt row (binds ``a_<column>``) and,
    with ``models``, its model row (binds ``m_models``, ``m_loaded``); ``files`` output
    files that replace the job's others (binds ``f<i>_<column>``, ``b_paths``: their
    paths), and ``events`` events (binds ``e<i>_<column>``), their ids in their order.
    Returns one row per event, its ``id`` (ascending), and ``moved``, the job rows updated
    (1, or 0 when the row is not as read: a bug, not a race, under the lock). ``files`` < 0: the
    job's files are left as they are."""
    ctes: list[Any] = []
    moved = guarded_update(columns).returning(JOB.job_id).cte("moved")
    if attempt:
        attempt_row = postgresql.insert(attempts_table).values(
            {c: sa.bindparam(f"a_{c}", type_=attempts_table.c[c].type) for c in ATTEMPT_COLUMNS}
        )
        ctes.append(
            attempt_row.on_conflict_do_update(
                index_elements=["job_id", "attempt"],
                set_={
                    c: attempt_row.excluded[c]
                    for c in ATTEMPT_COLUMNS
                    if c not in ("job_id", "attempt")
                },
            ).cte("attempt_row")
        )
        if models:
            model_row = postgresql.insert(model_loads_table).values(
                job_id=sa.bindparam("a_job_id"),
                attempt=sa.bindparam("a_attempt"),
                server=sa.bindparam("a_server", type_=sa.String),
                models=sa.bindparam("m_models", type_=sa.Text),
                loaded=sa.bindparam("m_loaded", type_=sa.Boolean),
            )
            ctes.append(
                model_row.on_conflict_do_update(
                    index_elements=["job_id", "attempt"],
                    set_={c: model_row.excluded[c] for c in ("server", "models", "loaded")},
                ).cte("model_row")
            )
    if files >= 0:
        paths = sa.bindparam("b_paths", type_=postgresql.ARRAY(sa.Text))
        ctes.append(
            files_table.delete()
            .where(FILE.job_id == sa.bindparam("b_id"), sa.not_(FILE.path == sa.any_(paths)))
            .cte("old_files")
        )
    if files > 0:
        new_files = postgresql.insert(files_table).values(
            [
                {c: sa.bindparam(f"f{i}_{c}", type_=FILE[c].type) for c in FILE_COLUMNS}
                for i in range(files)
            ]
        )
        ctes.append(
            new_files.on_conflict_do_update(
                index_elements=["job_id", "path"],
                set_={c: new_files.excluded[c] for c in _FILE_UPDATED},
            ).cte("new_files")
        )
    names = [*EVENT_COLUMNS, "detail"]
    rows = sa.union_all(
        *(
            sa.select(
                *(_typed(f"e{i}_{c}", EVENT[c]).label(c) for c in names),
                sa.literal_column(str(i)).label("ord"),
            )
            for i in range(events)
        )
    ).subquery("new_events")
    logged = (
        events_table.insert()
        .from_select(names, sa.select(*(rows.c[c] for c in names)).order_by(rows.c.ord))
        .returning(EVENT.id)
        .cte("logged")
    )
    count = sa.select(sa.func.count()).select_from(moved).scalar_subquery()
    return sa.select(logged.c.id, count.label("moved")).add_cte(*ctes).order_by(logged.c.id)
