"""Server health in the store: the failures that may be a server's, whose they turned out
to be, workflows known to fail, and each server's quarantine, shared by every process.

Who decides what (docs/health.md):

- an attempt's failure that may be the server's is written as an **open failure** of that
  server (``server_failed``); an infrastructure error counts against the server at once;
- the job's next attempt elsewhere judges it: a success there makes every open failure
  of the job the failing servers' (``job_rendered``: a strike each); the same failure
  there makes it the job's (``job_failed_alike``), and the workflow is **learned**, so its
  other jobs failing that way are dead letters at once (``known_workflow_failure``);
- a server with ``QUARANTINE_STRIKES`` strikes in a row, or an infrastructure error, is
  **quarantined** for a cool-down of ``COOLDOWN_S`` doubled at each quarantine in a row
  (at most ``COOLDOWN_MAX_S``); once it ends the server is **on trial**: one job, whose
  success re-admits it and whose failure (its strike) quarantines it again, for longer.
  Each success after that halves the cool-down level back towards ``COOLDOWN_S``.

Every method is one transaction; times are the database's clock (``store/clock.py``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from comfy_assets.store.base import StoreBase
from comfy_assets.store.clock import wall_time
from comfy_assets.store.errors import StoreError
from comfy_assets.store.queries import id_range
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import (
    attempts_table,
    jobs_table,
    server_events_table,
    server_failures_table,
    server_health_table,
    server_leases_table,
    workflow_failures_table,
)
from comfy_assets.store.statements import insert_for

# Jobs in a row that failed on a server and then rendered elsewhere before it is
# quarantined: three, as Flamenco's blocklist threshold and Afanasy's errors_avoid_host;
# an infrastructure error quarantines at once (a CUDA context after an illegal memory
# access and a full disk stay broken until someone acts).
QUARANTINE_STRIKES = 3
# The first cool-down, doubled at each quarantine in a row, up to COOLDOWN_MAX_S: a
# minute lets a transient fault (a disk being cleaned) pass; an hour keeps a dead GPU
# from costing more than one job an hour (Afanasy forgives after 5 h, Tractor pauses
# 120 s).
COOLDOWN_S = 60.0
COOLDOWN_MAX_S = 3600.0
# An open failure older than this no longer holds its server back: its job was never
# tried elsewhere (its run stopped, say).
OPEN_FAILURE_S = 600.0
# The last jobs that failed on a server, kept for people (health, events).
FAILED_JOBS_KEPT = 5

Verdict = Literal["server", "job", "unknown"]
HealthState = Literal["ok", "quarantined", "trial"]


@dataclass(frozen=True)
class ServerHealthRecord:
    """One server's health. ``state``: ok, quarantined (until ``until``, epoch seconds)
    or trial (its cool-down is over: one job decides). ``strikes``: jobs in a row that
    failed there and rendered elsewhere; ``level``: cool-downs in a row (the next one is
    ``COOLDOWN_S * 2**level``); counts since the store was made; ``failed_jobs``: the
    last jobs that failed there, as (job id, where it rendered or "", reason);
    ``open_failures``: failures there not judged yet."""

    server: str
    state: HealthState
    until: float | None
    strikes: int
    level: int
    quarantines: int
    failures_server: int
    failures_job: int
    reason: str | None
    failed_jobs: tuple[tuple[str, str, str], ...] = ()
    open_failures: int = 0

    def line(self) -> str:
        """The server's state for people: ``gpu2 quarantined until 2026-12-07 12:04:10
        UTC: 3 jobs
        failed here that rendered on gpu0, gpu1 (last: ...)``, ``gpu2 on trial (its
        cool-down is over: its next job decides)``, ``gpu0 ok``, with its strikes and
        open failures when it has some."""
        if self.state == "quarantined":
            return f"{self.server} quarantined until {wall_time(self.until or 0)}: {self.reason}"
        if self.state == "trial":
            text = f"{self.server} on trial (its cool-down is over: its next job decides)"
        else:
            text = f"{self.server} ok"
        notes = []
        if self.strikes and self.state == "ok":
            notes.append(f"{self.strikes} of {QUARANTINE_STRIKES} strikes (last: {self.reason})")
        if self.open_failures:
            n = self.open_failures
            notes.append(f"{n} failure{'s' if n > 1 else ''} here not judged elsewhere yet")
        return text + (f"; {'; '.join(notes)}" if notes else "")

    def blocked(self) -> str | None:
        """Why no job may start there now (quarantined, or on trial with its one job
        failed and not judged yet), else None."""
        if self.state == "quarantined":
            return "quarantined"
        if self.state == "trial" and self.open_failures:
            return "on trial, its job failed there"
        return None


class UnknownServer(StoreError, KeyError):
    """``readmit_server`` of a server the store has no word of (no health row, no
    lease): ``known`` lists those it has."""

    def __init__(self, server: str, known: list[str]) -> None:
        listed = ", ".join(known) if known else "none"
        super().__init__(f"unknown server {server!r} (the store knows: {listed})")
        self.server = server
        self.known = known

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class HealthChange:
    """A server's state changed: ``kind`` quarantined (``until``, ``cooldown_s``) or
    readmitted; ``detail`` says why for people."""

    server: str
    kind: Literal["quarantined", "readmitted"]
    detail: str
    until: float | None = None
    cooldown_s: float | None = None


def _cooldown(level: int) -> float:
    return min(COOLDOWN_S * 2**level, COOLDOWN_MAX_S)


class ServerHealth(StoreBase):
    """Server health (a part of ``Store``); see the module docstring."""

    def _health_row(self, conn: sa.Connection, server: str, now: float) -> dict[str, Any]:
        """The server's row, locked (created ok when missing)."""
        t = server_health_table
        row = conn.execute(sa.select(t).where(t.c.server == server).with_for_update()).first()
        if row is not None:
            return dict(row._mapping)
        values = {
            "server": server,
            "state": "ok",
            "until": None,
            "strikes": 0,
            "level": 0,
            "quarantines": 0,
            "failures_server": 0,
            "failures_job": 0,
            "reason": None,
            "failed_jobs": "[]",
            "updated_at": now,
        }
        conn.execute(insert_for(self.dialect, t).values(**values).on_conflict_do_nothing())
        row = conn.execute(sa.select(t).where(t.c.server == server).with_for_update()).one()
        return dict(row._mapping)

    def _save(self, conn: sa.Connection, values: dict[str, Any], now: float) -> None:
        t = server_health_table
        values = {**values, "updated_at": now}
        conn.execute(sa.update(t).where(t.c.server == values["server"]).values(**values))

    def _event(self, conn: sa.Connection, server: str, kind: str, detail: str, now: float) -> None:
        conn.execute(
            server_events_table.insert().values(time=now, server=server, kind=kind, detail=detail)
        )

    def _strike(
        self,
        conn: sa.Connection,
        row: dict[str, Any],
        reason: str,
        now: float,
        *,
        at_once: bool,
        cooldown_s: float | None = None,
    ) -> HealthChange | None:
        """Count a failure owned by the server; quarantine it when due (``at_once``: an
        infrastructure error; a failure on trial; else ``QUARANTINE_STRIKES``), for
        ``cooldown_s`` when given."""
        row["failures_server"] += 1
        row["strikes"] += 1
        state = _state(row, now)
        change = None
        if state != "quarantined":  # a quarantine's reason stands while it lasts
            row["reason"] = reason
            if at_once or state == "trial" or row["strikes"] >= QUARANTINE_STRIKES:
                change = self._quarantine(conn, row, reason, now, cooldown_s)
        self._save(conn, row, now)
        return change

    def _quarantine(
        self,
        conn: sa.Connection,
        row: dict[str, Any],
        reason: str,
        now: float,
        cooldown_s: float | None = None,
    ) -> HealthChange:
        cooldown = _cooldown(row["level"]) if cooldown_s is None else cooldown_s
        row.update(state="quarantined", until=now + cooldown, level=row["level"] + 1)
        # Its failures not judged yet are decided with it: left open, they would keep it
        # blocked on its trial (``blocked``) when their jobs can render nowhere else.
        judged = self._judge_open(conn, server_failures_table.c.server == row["server"], "server")
        for failure in sorted(judged, key=lambda f: f.at):
            # Listed with the others: a quarantine for 3 jobs in a row names all three.
            self._note_failed_job(row, failure.job_id, "", failure.reason)
        row["quarantines"] += 1
        jobs = json.loads(row["failed_jobs"] or "[]")
        rendered = sorted({where for _, where, _ in jobs if where})
        if row["strikes"] >= QUARANTINE_STRIKES and rendered:
            why = (
                f"{row['strikes']} jobs failed here that rendered on {', '.join(rendered)} "
                f"(last: {reason})"
            )
        else:
            why = reason
        row["reason"] = why  # what ``health`` and the pool say of it while quarantined
        failed = ", ".join(job for job, _, _ in jobs)
        detail = f"quarantined for {cooldown:.0f} s: {why}; jobs that failed here: {failed}"
        self._event(conn, row["server"], "quarantined", detail, now)
        return HealthChange(row["server"], "quarantined", detail, now + cooldown, cooldown)

    def _note_failed_job(self, row: dict[str, Any], job_id: str, where: str, reason: str) -> None:
        jobs = [j for j in json.loads(row["failed_jobs"] or "[]") if j[0] != job_id]
        jobs.append([job_id, where, reason])
        row["failed_jobs"] = json.dumps(jobs[-FAILED_JOBS_KEPT:])

    @retried
    def server_failed(
        self,
        server: str,
        job_id: str,
        workflow_sha256: str,
        signature: str,
        reason: str,
        *,
        infrastructure: bool,
        cooldown_s: float | None = None,
        now: float | None = None,
    ) -> HealthChange | None:
        """Job ``job_id`` failed on ``server`` in a way that may be the server's
        (``reason`` for people, ``signature`` equal for the same failure). An
        ``infrastructure`` error counts against the server at once (and quarantines it,
        for ``cooldown_s`` when given, else the cool-down of its level); any other is an
        open failure until the job's next attempt elsewhere judges it. Returns the
        server's change of state, if any."""
        now = self._now(now)
        with self._write() as conn:
            row = self._health_row(conn, server, now)
            if infrastructure:
                self._note_failed_job(row, job_id, "", reason)
                return self._strike(conn, row, reason, now, at_once=True, cooldown_s=cooldown_s)
            conn.execute(
                server_failures_table.insert().values(
                    server=server,
                    job_id=job_id,
                    workflow_sha256=workflow_sha256,
                    signature=signature,
                    reason=reason,
                    at=now,
                    verdict=None,
                )
            )
            return None

    def _judge_open(
        self, conn: sa.Connection, where: sa.ColumnElement[bool], verdict: Verdict
    ) -> list[sa.Row]:
        """Give the open failures matching ``where`` their ``verdict``; returns them."""
        f = server_failures_table
        rows = list(conn.execute(sa.select(f).where(f.c.verdict.is_(None), where)))
        if rows:
            ids = [r.id for r in rows]
            conn.execute(sa.update(f).where(f.c.id.in_(ids)).values(verdict=verdict))
        return rows

    @retried
    def job_rendered(
        self, server: str, job_id: str, now: float | None = None
    ) -> list[HealthChange]:
        """Job ``job_id`` rendered on ``server``: the server's success (a server on trial
        is re-admitted), and a strike for each other server where the job failed in a way
        judged open until now. Returns the changes of state."""
        now = self._now(now)
        f = server_failures_table
        changes: list[HealthChange] = []
        with self._write() as conn:
            self._judge_open(conn, (f.c.job_id == job_id) & (f.c.server == server), "unknown")
            blamed = self._judge_open(conn, f.c.job_id == job_id, "server")
            for failure in sorted(blamed, key=lambda r: r.server):
                row = self._health_row(conn, failure.server, now)
                self._note_failed_job(row, job_id, server, failure.reason)
                change = self._strike(conn, row, failure.reason, now, at_once=False)
                if change is not None:
                    changes.append(change)
            row = self._health_row(conn, server, now)
            row["strikes"] = 0
            if _state(row, now) == "trial":
                row.update(state="ok", until=None)
                detail = f"re-admitted: job {job_id} rendered here after its cool-down"
                self._event(conn, server, "readmitted", detail, now)
                changes.append(HealthChange(server, "readmitted", detail))
            elif row["state"] == "ok" and row["level"] > 0:
                row["level"] -= 1  # it recovers: the next cool-down is shorter
            self._save(conn, row, now)
        return changes

    @retried
    def job_failed_alike(
        self,
        job_id: str,
        workflow_sha256: str,
        signature: str,
        servers: list[str],
        reason: str,
        now: float | None = None,
    ) -> None:
        """Job ``job_id`` failed the same way (``signature``) on ``servers`` (two or
        more): the failure is the job's workflow's. It is learned (``known_workflow_
        failure``), and the open failures of this job, and of any job of the workflow
        that failed so, are the job's (not held against their servers)."""
        now = self._now(now)
        f, w = server_failures_table, workflow_failures_table
        with self._write() as conn:
            exists = conn.execute(
                sa.select(w.c.signature).where(
                    (w.c.workflow_sha256 == workflow_sha256) & (w.c.signature == signature)
                )
            ).first()
            if exists is None:
                conn.execute(
                    w.insert().values(
                        workflow_sha256=workflow_sha256,
                        signature=signature,
                        servers=" " + " ".join(servers) + " ",
                        reason=reason,
                        at=now,
                    )
                )
            same = (f.c.job_id == job_id) | (
                (f.c.workflow_sha256 == workflow_sha256) & (f.c.signature == signature)
            )
            judged = self._judge_open(conn, same, "job")
            for server in sorted({r.server for r in judged} | set(servers)):
                row = self._health_row(conn, server, now)
                row["failures_job"] += sum(1 for r in judged if r.server == server) or 1
                self._save(conn, row, now)

    @retried
    def unlearn_workflow(self, workflow_sha256: str) -> None:
        """A job of the workflow rendered: it is not known to fail any more (two servers
        that failed it alike were sick, not it)."""
        w = workflow_failures_table
        with self._write() as conn:
            conn.execute(sa.delete(w).where(w.c.workflow_sha256 == workflow_sha256))

    @retried
    def failure_owned_by_job(self, server: str, job_id: str, now: float | None = None) -> None:
        """A failure on ``server`` judged the job's at first sight (a workflow known to
        fail so, or the only server that can run it): counted as the job's; the job's
        open failures are closed unjudged."""
        now = self._now(now)
        f = server_failures_table
        with self._write() as conn:
            self._judge_open(conn, f.c.job_id == job_id, "unknown")
            row = self._health_row(conn, server, now)
            row["failures_job"] += 1
            self._save(conn, row, now)

    @retried
    def job_unjudged(self, job_id: str) -> None:
        """The job ended without a verdict (dead letter for another reason, cancelled):
        its open failures no longer hold their servers back."""
        f = server_failures_table
        with self._write() as conn:
            self._judge_open(conn, f.c.job_id == job_id, "unknown")

    @retried
    def known_workflow_failure(self, workflow_sha256: str, signature: str) -> list[str] | None:
        """The servers a workflow failed on in the same way (``job_failed_alike``), or
        None when it is not known to fail so."""
        w = workflow_failures_table
        with self._read() as conn:
            servers = conn.execute(
                sa.select(w.c.servers).where(
                    (w.c.workflow_sha256 == workflow_sha256) & (w.c.signature == signature)
                )
            ).scalar()
        return None if servers is None else servers.split()

    @retried
    def server_health(self, now: float | None = None) -> dict[str, ServerHealthRecord]:
        """Every server with a health row, by name, with its open failures (those younger
        than ``OPEN_FAILURE_S``) counted."""
        now = self._now(now)
        t, f = server_health_table, server_failures_table
        with self._read() as conn:
            rows = list(conn.execute(sa.select(t)))
            counts: dict[str, int] = dict(
                conn.execute(
                    sa.select(f.c.server, sa.func.count())
                    .where(f.c.verdict.is_(None), f.c.at > now - OPEN_FAILURE_S)
                    .group_by(f.c.server)
                ).all()
            )
        found = {}
        for r in rows:
            values = dict(r._mapping)
            values.pop("updated_at")
            values.update(
                state=_state(values, now),
                failed_jobs=tuple(tuple(j) for j in json.loads(r.failed_jobs or "[]")),
                open_failures=int(counts.get(r.server, 0)),
            )
            found[r.server] = ServerHealthRecord(**values)
        for server, n in counts.items():
            if server not in found:
                found[server] = dataclasses.replace(ok_record(server), open_failures=int(n))
        return found

    @retried
    def readmit_server(self, server: str, by: str, now: float | None = None) -> HealthChange | None:
        """Re-admit ``server`` by hand (``by``: who, for the event): ok, no strikes, its
        open failures closed unjudged, its list of jobs that failed there emptied. None when it was not quarantined or on trial, or
        rendered and never failed (a server lease and no health row). Raises UnknownServer
        for a server the store has no word of (nothing written)."""
        now = self._now(now)
        f, t, lease = server_failures_table, server_health_table, server_leases_table.c
        with self._write() as conn:
            if conn.execute(sa.select(t.c.server).where(t.c.server == server)).first() is None:
                if conn.execute(sa.select(lease.server).where(lease.server == server)).first():
                    return None  # it rendered and never failed: ok, as ``health`` lists it
                known = conn.execute(sa.select(t.c.server).union(sa.select(lease.server)))
                raise UnknownServer(server, sorted(known.scalars()))
            row = self._health_row(conn, server, now)
            self._judge_open(conn, f.c.server == server, "unknown")
            if _state(row, now) == "ok":
                self._save(conn, {**row, "strikes": 0}, now)
                return None
            # A later quarantine lists only the jobs that failed here after this.
            row.update(state="ok", until=None, strikes=0, level=0, failed_jobs="[]")
            self._save(conn, row, now)
            detail = f"re-admitted by hand ({by})"
            self._event(conn, server, "readmitted", detail, now)
            return HealthChange(server, "readmitted", detail)

    @retried
    def failed_on(
        self, partition: str, after: str | None = None, upto: str | None = None
    ) -> dict[str, tuple[str, ...]]:
        """The servers each job of ``partition`` had a failed attempt on since its
        inputs last changed, in the order of its attempts, each once (jobs with none are
        left out). ``after`` and ``upto``: of a range of job ids only (``id_range``)."""
        a, j = attempts_table.c, jobs_table.c
        stmt = (
            sa.select(a.job_id, a.server)
            .join(jobs_table, j.job_id == a.job_id)
            .where(
                *id_range(a.job_id, after, upto),
                j.partition == partition,
                a.outcome != "success",
                a.server.is_not(None),
                a.attempt > j.attempts_before,
            )
            .order_by(a.job_id, a.attempt)
        )
        found: dict[str, list[str]] = {}
        with self._read() as conn:
            for job_id, server in conn.execute(stmt):
                servers = found.setdefault(job_id, [])
                if server not in servers:
                    servers.append(server)
        return {job_id: tuple(servers) for job_id, servers in found.items()}

    @retried
    def server_events(self, server: str | None = None) -> list[tuple[float, str, str, str]]:
        """Server events, oldest first, as (time, server, kind, detail)."""
        e = server_events_table
        stmt = sa.select(e.c.time, e.c.server, e.c.kind, e.c.detail).order_by(e.c.id)
        if server is not None:
            stmt = stmt.where(e.c.server == server)
        with self._read() as conn:
            return [tuple(r) for r in conn.execute(stmt)]


def ok_record(server: str) -> ServerHealthRecord:
    """The health of a server nothing was held against."""
    return ServerHealthRecord(server, "ok", None, 0, 0, 0, 0, 0, None)


def _state(row: dict[str, Any], now: float) -> HealthState:
    if row["state"] == "quarantined":
        return "quarantined" if (row["until"] or 0) > now else "trial"
    return "ok"
