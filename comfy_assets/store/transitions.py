"""Moving a job through its states: transitions, attempts, done records, dead letters,
requeues and notes, each with its event row and JSON log line, in one transaction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

import sqlalchemy as sa

from comfy_assets.jobs.events import Event, log_event
from comfy_assets.jobs.states import (
    DONE,
    FAILED_FATAL,
    PENDING,
    RENDERING,
    REQUEUEABLE,
    SUBMITTED,
    check_transition,
    is_allowed,
)
from comfy_assets.store import one_trip
from comfy_assets.store import statements as q
from comfy_assets.store.base import _TERMINAL, StoreBase, _event
from comfy_assets.store.files.folder import content_type
from comfy_assets.store.records import (
    NO_VIA,
    AttemptEntry,
    ClaimLost,
    OutputFileLike,
    StoreConflict,
    UnknownJob,
    Via,
)
from comfy_assets.store.retry import (
    RETRYING,
    AlreadyApplied,
    retried,
)

OUTCOMES = ("success", "transient", "permanent")
# Columns transition() may set besides state; anything else is a caller's typo.
TRANSITION_FIELDS = frozenset(
    {
        "prompt_id",
        "number",
        "reason",
        "seconds",
        "queue_wait_s",
        "gpu_seconds",
        "attempts",
        "first_submitted_at",
        "finished_at",
    }
)


class Transitions(StoreBase):
    """State changes of jobs (a part of ``Store``)."""

    @retried
    def transition(
        self,
        job_id: str,
        to_state: str,
        *,
        owner: str | None = None,
        via: Via = NO_VIA,
        detail: str | None = None,
        now: float | None = None,
        from_state: str | None = None,
        **fields: Any,
    ) -> None:
        """Move ``job_id`` to ``to_state`` if the state machine allows it from the state in
        the database, with an event row and a JSON log line, in one transaction.

        ``owner``: the caller must hold the job's claim. ``via``: the server, attempt,
        try and rendering move that lead here (``Via``), written with it; ``detail`` is
        the event's text. ``fields``: other columns (TRANSITION_FIELDS). The first
        submission stamps ``first_submitted_at``; succeeded, degraded and failed_fatal
        stamp ``finished_at`` and drop the claim.
        ``from_state`` (with ``owner``): the state the caller knows the job is in, which
        makes a move to a state neither pending nor final a guarded UPDATE and the event's
        INSERT, without reading the job first (on PostgreSQL, one statement).
        Raises InvalidTransition, UnknownJob, ClaimLost, TypeError (an unknown field).
        """
        unknown = set(fields) - TRANSITION_FIELDS
        if unknown:
            raise TypeError(f"transition() got unknown fields: {', '.join(sorted(unknown))}")
        to = str(to_state)
        now = self._now(now)
        fast = (
            from_state is not None
            and owner is not None
            and via.tried is None
            and via.rendering is None
            and to not in _TERMINAL
            and to != PENDING
            and is_allowed(from_state, to)
        )
        if fast:
            assert from_state is not None and owner is not None
            event = self._move_in_one(job_id, from_state, to, owner, via, detail, now, fields)
            if event is not None:
                log_event(event)
                return
        tried_row = _tried_row(job_id, via, now)
        with self._write_logged() as (conn, written):
            row = self._locked_for_move(conn, job_id, owner, to, tried_row, now)
            values: dict[str, Any] = {"state": to, "updated_at": now}
            if via.server is not None:
                values["server"] = via.server
            if to == SUBMITTED and row.first_submitted_at is None:
                values["first_submitted_at"] = now
            if to in _TERMINAL:
                values.update(finished_at=now, claimed_by=None, claim_expires_at=None)
            elif to == PENDING:
                values["finished_at"] = None
            values.update(fields)
            events = _events(
                via, row, values, _event(now, row, to, detail, via.server, via.attempt)
            )
            self._update(conn, row, values)
            written += self._insert_events(conn, events)

    @retried
    def record_attempt(self, job_id: str, entry: AttemptEntry, *, now: float | None = None) -> None:
        """Record try number ``entry.attempt`` (1-based) of ``job_id``; the same number
        again replaces the row. ``entry.outcome``: "success", "transient" or "permanent".

        ``ended_at`` defaults to ``now``; ``seconds`` (wall, queue included) to
        ended_at - started_at; ``started_at`` to ended_at - seconds. ``gpu_seconds``
        (time the prompt ran) is kept as given. The job's ``attempts`` becomes at least
        ``entry.attempt``. Raises UnknownJob, ValueError (unknown outcome, no duration).
        """
        now = self._now(now)
        row = _attempt_row(job_id, entry, now)
        with self._write() as conn:
            self._write_attempt(conn, row, now)

    @retried
    def mark_done(
        self,
        job_id: str,
        owner: str,
        state: str = "succeeded",
        files: Sequence[OutputFileLike] = (),
        *,
        via: Via = NO_VIA,
        seconds: float | None = None,
        queue_wait_s: float | None = None,
        gpu_seconds: float | None = None,
        number: int | None = None,
        reason: str | None = None,
        detail: str | None = None,
        now: float | None = None,
    ) -> None:
        """Finish ``job_id`` as succeeded or degraded, all in ONE transaction: its files
        (paths relative to the job dir, with sha256 and bytes; they replace earlier
        ones), totals, the transition and its event, the claim released, and ``via``
        (``Via``): its try's row (counted in the totals) and first its move to
        rendering not yet written.

        Totals default from the job and its attempts: ``seconds`` = now -
        first_submitted_at, ``queue_wait_s`` = sum of waits, ``gpu_seconds`` = sum of
        the attempts' (else their seconds minus waits). ``reason`` says why a job is
        degraded. Raises ClaimLost unless ``owner`` holds the claim, InvalidTransition,
        UnknownJob, ValueError (state not done, file path outside the job dir).
        """
        if state not in DONE:
            raise ValueError(f"mark_done state must be succeeded or degraded, got {state!r}")
        rows = [_file_row(job_id, f) for f in files]
        now = self._now(now)
        tried_row = _tried_row(job_id, via, now)
        # PostgreSQL: the row lock, then everything else in one statement (``one_trip``).
        in_one = self.dialect == "postgresql" and via.attempt is not None
        with self._write_logged() as (conn, written):
            # Its ``attempts`` is set below when ``attempt`` is given: no bump of it first.
            row = self._locked_for_move(
                conn,
                job_id,
                owner,
                state,
                None if in_one else tried_row,
                now,
                bump=via.attempt is None,
            )
            if seconds is None or queue_wait_s is None or gpu_seconds is None:
                n, total, waited, ran = self._totals(conn, row, tried_row, written=not in_one)
                if seconds is None:
                    started = row.first_submitted_at
                    seconds = total if started is None else now - started
                queue_wait_s = waited if queue_wait_s is None else queue_wait_s
                gpu_seconds = (ran if n else None) if gpu_seconds is None else gpu_seconds
            values: dict[str, Any] = {
                "state": str(state),
                "finished_at": now,
                "updated_at": now,
                "claimed_by": None,
                "claim_expires_at": None,
                "reason": reason,
                "seconds": seconds,
                "queue_wait_s": queue_wait_s,
                "gpu_seconds": gpu_seconds,
            }
            for name, value in (
                ("server", via.server),
                ("attempts", via.attempt),
                ("number", number),
            ):
                if value is not None:
                    values[name] = value
            text = detail or (f"{len(rows)} file" + ("" if len(rows) == 1 else "s"))
            if reason and not detail:
                text += f"; {reason}"
            final = _event(now, row, state, text, via.server, via.attempt)
            events = _events(via, row, values, final)
            files_rows = [{**r, "prompt_id": row.prompt_id} for r in rows]
            if in_one:
                written += _finish_in_one(conn, row, values, tried_row, files_rows, events)
            else:
                self._update(conn, row, values)
                conn.execute(q.DELETE_FILES, {"b_id": job_id})
                if rows:
                    conn.execute(q.INSERT_FILES, files_rows)
                written += self._insert_events(conn, events)

    @retried
    def dead_letter(
        self,
        job_id: str,
        owner: str,
        reason: str,
        *,
        via: Via = NO_VIA,
        now: float | None = None,
    ) -> None:
        """Give up on ``job_id``: failed_fatal with ``reason``, claim freed, and ``via``
        (``Via``: the last try's row, first its move to rendering) recorded, in one
        transaction. Raises ClaimLost unless ``owner`` holds the claim,
        InvalidTransition (a done job, say), UnknownJob."""
        now = self._now(now)
        tried_row = _tried_row(job_id, via, now)
        in_one = self.dialect == "postgresql"
        with self._write_logged() as (conn, written):
            row = self._locked_for_move(
                conn, job_id, owner, FAILED_FATAL, None if in_one else tried_row, now
            )
            values: dict[str, Any] = {
                "state": FAILED_FATAL.value,
                "reason": reason,
                "finished_at": now,
                "updated_at": now,
                "claimed_by": None,
                "claim_expires_at": None,
            }
            if via.server is not None:
                values["server"] = via.server
            final = _event(now, row, FAILED_FATAL, reason, via.server, via.attempt)
            events = _events(via, row, values, final)
            if in_one:
                if tried_row is not None:  # its ``attempts`` rises to the attempt's
                    values.setdefault("attempts", _bumped(row, tried_row["attempt"]))
                written += _finish_in_one(conn, row, values, tried_row, None, events)
            else:
                self._update(conn, row, values)
                written += self._insert_events(conn, events)

    @retried
    def note(
        self,
        job_id: str,
        detail: str,
        *,
        server: str | None = None,
        attempt: int | None = None,
        now: float | None = None,
    ) -> None:
        """Write an event that changes nothing (``from_state == to_state``): something a
        worker did to a job it no longer holds, say. Raises UnknownJob."""
        now = self._now(now)
        with self._write_logged() as (conn, written):
            row = self._lock(conn, job_id)
            event = _event(now, row, row.state, detail, server, attempt)
            written += self._insert_events(conn, [event])

    @retried
    def requeue(self, job_id: str, now: float | None = None) -> bool:
        """Send a dead-lettered or degraded job (``REQUEUEABLE``: a failure, accepted as
        done with no render under the draft policy) back to pending (reason cleared,
        attempts 0). False, and nothing changes, if it is in another state or not in the
        store."""
        now = self._now(now)
        with self._write_logged() as (conn, written):
            row = conn.execute(q.LOCK_JOB, {"b_id": job_id}).first()
            if row is None or row.state not in REQUEUEABLE:
                return False
            values = {
                "state": PENDING.value,
                "reason": None,
                "attempts": 0,
                "attempts_before": row.attempts_before + row.attempts,
                "finished_at": None,
                "updated_at": now,
            }
            self._update(conn, row, values)
            written += self._insert_events(conn, [_event(now, row, PENDING, "requeued")])
        return True

    def _move_in_one(
        self,
        job_id: str,
        from_state: str,
        to: str,
        owner: str,
        via: Via,
        detail: str | None,
        now: float,
        fields: dict[str, Any],
    ) -> Event | None:
        """``transition``'s one-statement way (PostgreSQL, autocommit); the event written,
        or None when the job is not in ``from_state`` or not ``owner``'s."""
        values: dict[str, Any] = {"state": to, "updated_at": now, **fields}
        if via.server is not None:
            values["server"] = via.server
        if to == SUBMITTED:
            values["first_submitted_at"] = now  # kept where already set (COALESCE)
        params = {f"v_{k}": v for k, v in values.items()}
        params.update(
            v_now=now,
            b_id=job_id,
            b_state=from_state,
            b_owner=owner,
            e_time=now,
            e_from=from_state,
            e_to=to,
            e_server=via.server,
            e_attempt=via.attempt,
            e_detail=detail,
        )
        columns = tuple(sorted(values))
        if self.dialect != "postgresql":
            return self._move_then_log(columns, params)
        row = self._autocommit_first(q.move_and_log(columns), params)
        if row is None:
            return None
        return Event(
            row.id, now, job_id, row.partition, from_state, to, via.server, via.attempt, detail
        )

    def _move_then_log(self, columns: tuple[str, ...], params: dict[str, Any]) -> Event | None:
        """``_move_in_one`` for SQLite, which has no data-modifying CTE: the guarded UPDATE
        ... RETURNING, then the event's INSERT, in one write transaction (``BEGIN
        IMMEDIATE`` holds the write lock throughout); None, with nothing written, when
        the job is not in ``b_state`` or not ``b_owner``'s."""
        with self._write() as conn:
            moved = conn.execute(q.move(columns), params).first()
            if moved is None:
                return None  # nothing changed: the commit of an empty transaction
            event = Event(
                None,
                params["e_time"],
                params["b_id"],
                moved.partition,
                params["e_from"],
                params["e_to"],
                params["e_server"],
                params["e_attempt"],
                params["e_detail"],
            )
            return self._insert_events(conn, [event])[0]

    def _locked_for_move(
        self,
        conn: sa.Connection,
        job_id: str,
        owner: str | None,
        to: str,
        tried_row: dict[str, Any] | None,
        now: float,
        *,
        bump: bool = True,
    ) -> sa.Row:
        """The job's row, locked, once the claim (when ``owner``) and the move to ``to``
        are checked; ``tried_row`` written (``bump``: and the job's ``attempts`` raised to
        it, unless the caller sets them itself). Raises UnknownJob, ClaimLost,
        InvalidTransition."""
        row = self._lock(conn, job_id)
        if RETRYING.get() and str(row.state) == str(to):
            raise AlreadyApplied  # the first try's commit went through after all
        if owner is not None and row.claimed_by != owner:
            raise ClaimLost(job_id, owner, row.claimed_by)
        check_transition(row.state, to, job_id=job_id)
        if tried_row is not None:
            self._write_attempt(conn, tried_row, now, bump=bump)
        return row

    def _totals(
        self,
        conn: sa.Connection,
        row: sa.Row,
        tried_row: dict[str, Any] | None,
        *,
        written: bool = True,
    ) -> tuple[int, float | None, float | None, float | None]:
        """(attempts, their seconds, queue waits and GPU seconds, summed) of the job of
        ``row``, ``tried_row`` among them (``written``: already in the table; else read
        beside the others); a job with no attempt before it (none now, none before a
        reset: ``attempts_before``) has that one's alone."""
        if tried_row is None or (written and (row.attempts or row.attempts_before)):
            return tuple(conn.execute(q.TOTALS, {"b_id": row.job_id}).one())
        seconds, waited, gpu = (
            tried_row["seconds"],
            tried_row["queue_wait_s"],
            tried_row["gpu_seconds"],
        )
        ran = seconds - (waited or 0.0) if gpu is None else gpu
        if not (row.attempts or row.attempts_before):
            return 1, seconds, waited, ran
        params = {"b_id": row.job_id, "b_attempt": tried_row["attempt"]}
        n, total, waits, gpus = conn.execute(q.TOTALS_OTHERS, params).one()
        return (
            n + 1,
            (total or 0.0) + seconds,
            waited if waits is None else waits + (waited or 0.0),
            (gpus or 0.0) + ran,
        )

    def _write_attempt(
        self, conn: sa.Connection, row: dict[str, Any], now: float, *, bump: bool = True
    ) -> None:
        """The attempt row (replacing the same number), the job's ``attempts`` when
        ``bump``, and its model row for a job that loads models."""
        if bump:
            params = {"b_id": row["job_id"], "b_attempt": row["attempt"], "v_now": now}
            if conn.execute(q.BUMP_ATTEMPTS, params).rowcount != 1:
                raise UnknownJob(row["job_id"])
        columns = {k: v for k, v in row.items() if k in q.ATTEMPT_COLUMNS}
        conn.execute(q.upsert_attempt(self.dialect), columns)
        if row.get("models"):
            model_row = {
                "job_id": row["job_id"],
                "attempt": row["attempt"],
                "server": row["server"],
                "models": json.dumps(sorted(row["models"])),
                "loaded": bool(row["model_loaded"]),
            }
            conn.execute(q.upsert_model_load(self.dialect), model_row)


def _tried_row(job_id: str, via: Via, now: float) -> dict[str, Any] | None:
    """The attempt row of ``via.tried`` (``_attempt_row``), or None when it names none."""
    return None if via.tried is None else _attempt_row(job_id, via.tried, now)


def _events(via: Via, row: sa.Row, values: dict[str, Any], final: Event) -> list[Event]:
    """The events of a move to ``final.to_state``: that one alone, or with
    ``via.rendering`` (the job's move to rendering, not yet written) first, its event at
    its own time (kept between the job's last move and ``final``'s) and the final one
    from rendering; ``values`` get its run number and server unless they have them.
    Raises InvalidTransition when the job is not submitted."""
    rendering = via.rendering
    if rendering is None:
        return [final]
    check_transition(row.state, RENDERING, job_id=row.job_id)
    check_transition(RENDERING, final.to_state, job_id=row.job_id)
    values.setdefault("number", rendering.number)
    values.setdefault("server", rendering.server)
    # Between the move to submitted and the final one, whatever the clock did meanwhile
    # (a step back of the host's clock): a job's events read in the order they happened.
    at = min(max(rendering.at, row.updated_at or rendering.at), final.time)
    started = _event(at, row, RENDERING, None, rendering.server, rendering.attempt)
    return [started, dataclasses.replace(final, from_state=RENDERING.value)]


def _bumped(row: sa.Row, attempt: int) -> int:
    """The job's ``attempts`` once try number ``attempt`` (numbered on from
    ``attempts_before``) is recorded: ``statements.BUMP_ATTEMPTS`` in Python."""
    return max(row.attempts, attempt - row.attempts_before)


def _finish_in_one(
    conn: sa.Connection,
    row: sa.Row,
    values: dict[str, Any],
    tried_row: dict[str, Any] | None,
    files: list[dict[str, Any]] | None,
    events: list[Event],
) -> list[Event]:
    """PostgreSQL: ``values`` set on the job of ``row`` (locked, as read), with
    ``tried_row`` (the attempt and its models), ``files`` (replacing the job's others;
    None: left as they are) and ``events``, in one statement (``one_trip.finish``);
    returns the events with their ids. Raises StoreConflict when the job row is not as
    read."""
    models = bool(tried_row and tried_row.get("models"))
    stmt = one_trip.finish(
        tuple(sorted(values)),
        -1 if files is None else len(files),
        len(events),
        attempt=tried_row is not None,
        models=models,
    )
    params: dict[str, Any] = {f"v_{k}": v for k, v in values.items()}
    params.update(b_id=row.job_id, b_state=row.state, b_holder=row.claimed_by)
    if tried_row is not None:
        params.update({f"a_{k}": v for k, v in tried_row.items() if k in q.ATTEMPT_COLUMNS})
        if models:
            params.update(
                m_models=json.dumps(sorted(tried_row["models"])),
                m_loaded=bool(tried_row["model_loaded"]),
            )
    if files is not None:
        params["b_paths"] = [f["path"] for f in files]
        for i, f in enumerate(files):
            params.update({f"f{i}_{k}": f.get(k) for k in one_trip.FILE_COLUMNS})
    for i, event in enumerate(events):
        params.update({f"e{i}_{k}": v for k, v in event.to_dict().items() if k != "id"})
    found = conn.execute(stmt, params).all()
    if len(found) != len(events) or any(r.moved != 1 for r in found):
        raise StoreConflict(f"finish job {row.job_id}: the job row is not as read under its lock")
    return [dataclasses.replace(e, id=r.id) for e, r in zip(events, found, strict=True)]


def _attempt_row(job_id: str, entry: AttemptEntry, now: float) -> dict[str, Any]:
    """The attempts-table row of ``entry``; raises ValueError (outcome, no duration)."""
    if entry.outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {entry.outcome!r}")
    if entry.started_at is None and entry.seconds is None:
        raise ValueError(f"job {job_id} attempt {entry.attempt}: give started_at or seconds")
    ended_at = now if entry.ended_at is None else entry.ended_at
    seconds = entry.seconds
    if seconds is None:
        seconds = ended_at - entry.started_at  # type: ignore[operator]
    started_at = ended_at - seconds if entry.started_at is None else entry.started_at
    return {
        "job_id": job_id,
        "attempt": entry.attempt,
        "server": entry.server,
        "prompt_id": entry.prompt_id,
        "number": entry.number,
        "started_at": started_at,
        "ended_at": ended_at,
        "seconds": seconds,
        "queue_wait_s": entry.queue_wait_s,
        "gpu_seconds": entry.gpu_seconds,
        "outcome": entry.outcome,
        "reason": entry.reason,
        "models": entry.models,
        "model_loaded": entry.model_loaded,
    }


def _file_row(job_id: str, f: OutputFileLike) -> dict[str, Any]:
    path = PurePosixPath(f.path)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"job {job_id}: file path {str(f.path)!r} is not inside the job dir")
    if f.bytes < 0 or len(f.sha256) != 64:
        raise ValueError(f"job {job_id}: file {str(path)!r} needs a sha256 hex digest and bytes")
    return {
        "job_id": job_id,
        "path": path.as_posix(),
        "sha256": f.sha256,
        "bytes": f.bytes,
        "node_id": f.node_id,
        "key": f.key,
        "content_type": f.content_type or content_type(path.name),
    }
