"""The HTTP API's part of the store: which client owns each job it took, the message to
publish for it, and the webhook outbox.

A job taken by the API is a row of ``comfy_api_jobs`` (owner, content, queue message,
webhook) beside its ordinary row of ``comfy_jobs`` (state, attempts, files), which the
workers write as for any other job. ``published_at`` is set once the broker confirmed the
message: a row without it is published (again) by whichever API process finds it, so a
crash between the store and the broker loses nothing. A job's ending (its
``finished_at``) that a webhook has not been made for becomes one row of
``comfy_api_webhooks``, the outbox, delivered and retried from there.

Every method is one short transaction (see ``store/base.py``) and is retried while the
database is away, like the ``Store``'s own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from comfy_assets.jobs.events import log_event
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.states import FAILED_FATAL, IN_FLIGHT, InvalidTransition, State
from comfy_assets.store.base import _TERMINAL, StoreBase, _event, _job_record
from comfy_assets.store.records import ClaimLost, JobRecord
from comfy_assets.store.register import register
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import (
    api_jobs_table,
    api_webhooks_table,
    events_table,
    jobs_table,
)
from comfy_assets.store.statements import insert_for
from comfy_assets.store.store import Store

API = api_jobs_table.c
HOOK = api_webhooks_table.c
# The claim owner of a job a cancel took from its worker: "api-cancel:<client>"; no
# heartbeat row, so nobody takes the claim before it expires.
CANCEL_PREFIX = "api-cancel:"
CANCEL_HOLD_S = 3600.0
# Seconds after which a cancelled job still in flight is dead-lettered anyway (its
# server's lease held all along), and before which it is not (its lease free).
CANCEL_SETTLE_S = 1800.0
CANCEL_QUIET_S = 5.0


def cancel_owner(client: str) -> str:
    """The claim owner a cancel of ``client``'s takes a job's claim as."""
    return CANCEL_PREFIX + client


@dataclass(frozen=True)
class ApiJob:
    """One job the API took: its ``client`` (a name of the tokens file), ``content`` (what
    tells a retry from another job: ``api.submission.content_of``), ``message`` (the queue
    message body, UTF-8 JSON), ``webhook`` URL or None; times in epoch seconds."""

    job_id: str
    client: str
    content: dict[str, Any]
    message: bytes
    webhook: str | None
    created_at: float
    published_at: float | None = None
    notified_at: float | None = None

    @property
    def take(self) -> int:
        """The take of its content (1 when the request named none)."""
        return int(self.content.get("take", 1))


@dataclass(frozen=True)
class Webhook:
    """One delivery of the outbox: ``webhook_id`` (the ``webhook-id`` header, stable
    across retries), the job it is about, the URL, the JSON ``payload``, ``attempts`` so
    far, ``next_at`` (epoch seconds; None once delivered or given up)."""

    webhook_id: str
    job_id: str
    url: str
    payload: str
    created_at: float
    attempts: int
    next_at: float | None
    delivered_at: float | None
    given_up_at: float | None
    last_error: str | None
    receiver: str | None = None  # the URL's scheme://host:port (``outbox.receiver_of``)
    client: str | None = None  # the job's client


def _api_job(row: sa.Row[Any] | Mapping[str, Any]) -> ApiJob:
    """The API job of an api_jobs row, or of its columns by name."""
    values = row._mapping if isinstance(row, sa.Row) else row
    return ApiJob(
        job_id=values["job_id"],
        client=values["client"],
        content=json.loads(values["content_json"]),
        message=values["message"].encode(),
        webhook=values["webhook"],
        created_at=values["created_at"],
        published_at=values["published_at"],
        notified_at=values["notified_at"],
    )


class ApiLedger(StoreBase):
    """The API's tables in ``store``'s database (same engine, clock and outage)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.engine = store.engine
        self.dialect = store.dialect
        self.retry_s = store.retry_s
        self.outage = store.outage
        self.clock = store.clock

    @retried
    def get(self, job_id: str) -> ApiJob | None:
        """The API's row of ``job_id``, or None when the API did not take it."""
        with self._read() as conn:
            row = conn.execute(sa.select(api_jobs_table).where(API.job_id == job_id)).first()
        return None if row is None else _api_job(row)

    @retried
    def lookup(self, job_id: str) -> tuple[ApiJob | None, bool]:
        """The API's row of ``job_id`` (or None), and whether the store has a job of that
        id at all (one the API took, or a job file's), in one read."""
        stmt = (
            sa.select(api_jobs_table, jobs_table.c.job_id.label("known"))
            .select_from(jobs_table.outerjoin(api_jobs_table, API.job_id == jobs_table.c.job_id))
            .where(jobs_table.c.job_id == job_id)
        )
        with self._read() as conn:
            row = conn.execute(stmt).first()
            if row is None:  # no job row: perhaps an API row alone (written, not registered)
                api = conn.execute(sa.select(api_jobs_table).where(API.job_id == job_id)).first()
                return (None if api is None else _api_job(api)), False
        return (None if row.client is None else _api_job(row)), True

    @retried
    def take(self, job: ApiJob, partition: str, rendered: Job) -> tuple[ApiJob, bool]:
        """Record ``job`` and register ``rendered`` (its Job) under ``partition``, in one
        transaction, unless the API has a row of that id already: returns the row that is
        there afterwards and whether this call wrote it. Raises PartitionConflict (a job
        of that id in another partition: nothing is written)."""
        values = {
            "job_id": job.job_id,
            "client": job.client,
            "content_json": json.dumps(job.content, sort_keys=True),
            "message": job.message.decode(),
            "webhook": job.webhook,
            "created_at": job.created_at,
            "take": job.take,
        }
        # One insert wins whatever number of identical requests race: the others find
        # its row (their rowcount 0) and answer as a repeat does. SQLAlchemy keeps an
        # INSERT's rowcount only when asked (else -1, which would count as inserted).
        stmt = insert_for(self.dialect, api_jobs_table).on_conflict_do_nothing()
        stmt = stmt.execution_options(preserve_rowcount=True)
        with self._write() as conn:
            inserted = conn.execute(stmt, values).rowcount == 1
            row = conn.execute(sa.select(api_jobs_table).where(API.job_id == job.job_id)).one()
            events = []
            if inserted:
                _, found = register(conn, self.dialect, partition, [rendered], self.now())
                events = self._insert_events(conn, found)
        for event in events:
            log_event(event)
        return _api_job(row), inserted

    @retried
    def retake(self, job: ApiJob, partition: str, rendered: Job) -> bool:
        """Replace ``job``'s content and message by a new take's (``rendered``, its Job,
        registered again: pending under its new prompt_id), its message to be published
        (``published_at`` cleared), in one transaction, only if the recorded take is
        older than ``rendered.take``: compared in the UPDATE itself, so of requests racing
        with one take exactly one records it, and an older take never replaces a newer.
        True when this call recorded it."""
        values = {
            "content_json": json.dumps(job.content, sort_keys=True),
            "message": job.message.decode(),
            "published_at": None,
            "take": rendered.take,
        }
        stmt = (
            api_jobs_table.update()
            .where(API.job_id == job.job_id, API.take < rendered.take)
            .values(**values)
        )
        with self._write() as conn:
            if not conn.execute(stmt).rowcount:
                return False
            _, found = register(
                conn, self.dialect, partition, [rendered], self.now(), forward_only=True
            )
            events = self._insert_events(conn, found)
        for event in events:
            log_event(event)
        return True

    @retried
    def mark_published(self, job_id: str, published: bool = True, take: int | None = None) -> None:
        """Note that the broker confirmed ``job_id``'s message (or, ``published=False``,
        that it must be published again: a requeue). With ``take``, only while the row
        is still of that take: the confirm of an older take's message does not mark a
        newer take's, which must be published too."""
        value = self.now() if published else None
        stmt = api_jobs_table.update().where(API.job_id == job_id)
        if take is not None:
            stmt = stmt.where(API.take == take)
        with self._write() as conn:
            conn.execute(stmt.values(published_at=value))

    @retried
    def unpublished(self, created_before: float, limit: int = 100) -> list[ApiJob]:
        """Rows whose message the broker has not confirmed, created before
        ``created_before`` (epoch seconds), oldest first."""
        stmt = (
            sa.select(api_jobs_table)
            .where(API.published_at.is_(None), API.created_at < created_before)
            .order_by(API.created_at)
            .limit(limit)
        )
        with self._read() as conn:
            return [_api_job(r) for r in conn.execute(stmt)]

    @retried
    def cancel(self, job_id: str, client: str) -> tuple[State, str]:
        """Cancel ``job_id`` for ``client``: returns (its state before, what happened).

        - "ended": it is done or a dead letter already; nothing changes;
        - "dead_lettered": it was waiting (pending, failed_retryable): now a dead letter
          ``cancelled by <client>``, its claim freed (a worker holding it finds it gone);
        - "taken": an attempt is in flight: its claim is taken by ``cancel_owner(client)``
          for ``CANCEL_HOLD_S`` seconds, so the worker can neither record the attempt
          nor try the job again; ``finish_cancel`` makes it a dead letter once the
          attempt has settled (its prompt interrupted: ``api.interrupting``).

        Raises UnknownJob."""
        now = self.now()
        with self._write() as conn:
            row = self._lock(conn, job_id)
            before = State(row.state)
            if before in _TERMINAL:
                return before, "ended"
            if before in IN_FLIGHT:
                owner = cancel_owner(client)
                values: dict[str, Any] = {
                    "claimed_by": owner,
                    "claim_expires_at": now + CANCEL_HOLD_S,
                    "updated_at": now,
                }
                detail = f"cancel asked by {client}: claim taken from its worker"
                event = _event(now, row, row.state, detail)
                outcome = "taken"
            else:
                values = {
                    "state": FAILED_FATAL.value,
                    "reason": f"cancelled by {client}",
                    "finished_at": now,
                    "updated_at": now,
                    "claimed_by": None,
                    "claim_expires_at": None,
                }
                event = _event(now, row, FAILED_FATAL, f"cancelled by {client}")
                outcome = "dead_lettered"
            self._update(conn, row, values)
            event = self._insert_events(conn, [event])[0]
        log_event(event)
        return before, outcome

    @retried
    def cancels(self, partitions: list[str]) -> list[JobRecord]:
        """Jobs of ``partitions`` (the clients') whose claim a cancel took (``cancel``'s
        "taken") and that are not a dead letter yet: by partition and state first, which
        the jobs' index answers."""
        unfinished = [s.value for s in State if s not in _TERMINAL]
        stmt = sa.select(jobs_table).where(
            jobs_table.c.partition.in_(partitions),
            jobs_table.c.state.in_(unfinished),
            jobs_table.c.claimed_by.like(CANCEL_PREFIX + "%"),
        )
        with self._read() as conn:
            return [_job_record(r) for r in conn.execute(stmt)]

    def finish_cancel(self, record: JobRecord, settle_s: float = CANCEL_SETTLE_S) -> bool:
        """Make a job whose claim a cancel took a dead letter ``cancelled by <client>``
        once its attempt has settled: it left submitted/rendering, or (its worker found
        the claim gone, or died) its server's lease is no longer held, a few seconds
        after the cancel (held for another prompt counts as free); or ``settle_s`` seconds after it whatever the lease says. Not
        before: a worker whose attempt is still under way records its end, and must find
        the job in flight. True when it is a dead letter now."""
        owner = record.claimed_by or ""
        if not owner.startswith(CANCEL_PREFIX):
            return False
        if record.state in IN_FLIGHT:
            waited = self.now() - record.updated_at
            lease = self.store.server_leases().get(record.server or "")
            # Held for another prompt: this job's attempt is over.
            busy = (
                lease is not None
                and lease.held(self.now())
                and lease.prompt_id in (None, record.prompt_id)
            )
            if waited < settle_s and (busy or waited < CANCEL_QUIET_S):
                return False
        client = owner[len(CANCEL_PREFIX) :]
        try:
            self.store.dead_letter(record.job_id, owner, f"cancelled by {client}")
        except (ClaimLost, InvalidTransition):
            return False  # it moved meanwhile: looked at again next time
        return True

    # -- the webhook outbox ------------------------------------------------------------

    @retried
    def last_event_id(self) -> int:
        """The id of the newest event row (0 for none)."""
        with self._read() as conn:
            return int(conn.execute(sa.select(sa.func.max(events_table.c.id))).scalar() or 0)

    @retried
    def events_after(self, event_id: int, limit: int = 5000) -> list[tuple[int, str]]:
        """``(id, job_id)`` of the events after ``event_id``, by id, at most ``limit``:
        a range of the events' primary key (the streams' wake-ups)."""
        t = events_table.c
        stmt = sa.select(t.id, t.job_id).where(t.id > event_id).order_by(t.id).limit(limit)
        with self._read() as conn:
            return [(r.id, r.job_id) for r in conn.execute(stmt)]

    @retried
    def ended_since(
        self, event_id: int, partitions: Sequence[str], limit: int = 1000
    ) -> tuple[list[str], int]:
        """The jobs of ``partitions`` with an ending (a move to succeeded, degraded or
        failed_fatal) among the events after ``event_id``, and the id of the last event
        looked at: a range of the events' primary key, however long the store's
        history."""
        t = events_table.c
        stmt = (
            sa.select(t.id, t.job_id)
            .where(
                t.id > event_id,
                t.to_state.in_([s.value for s in _TERMINAL]),
                t.partition.in_(partitions),
            )
            .order_by(t.id)
            .limit(limit)
        )
        with self._read() as conn:
            rows = conn.execute(stmt).all()
        if not rows:
            return [], event_id
        return sorted({r.job_id for r in rows}), rows[-1].id

    @retried
    def endings(
        self, job_ids: list[str] | None = None, limit: int = 100
    ) -> list[tuple[ApiJob, JobRecord]]:
        """Jobs with a webhook (of ``job_ids``, or any) that ended (done or a dead
        letter) since their last webhook was made: each with its ``JobRecord``, at most
        ``limit``."""
        terminal = [s.value for s in _TERMINAL]
        stmt = (
            sa.select(api_jobs_table, jobs_table)
            .join(jobs_table, jobs_table.c.job_id == API.job_id)
            .where(
                API.webhook.is_not(None),
                jobs_table.c.state.in_(terminal),
                jobs_table.c.finished_at.is_not(None),
                sa.or_(API.notified_at.is_(None), API.notified_at != jobs_table.c.finished_at),
            )
            .limit(limit)
        )
        if job_ids is not None:
            stmt = stmt.where(API.job_id.in_(job_ids))
        api_columns = set(api_jobs_table.c.keys())
        found = []
        with self._read() as conn:
            for row in conn.execute(stmt):
                mapping = row._mapping
                api = {k: mapping[api_jobs_table.c[k]] for k in api_columns}
                job = {k: mapping[jobs_table.c[k]] for k in jobs_table.c.keys()}
                found.append((_api_job(api), _job_record(job)))
        return found

    @retried
    def add_webhook(self, hook: Webhook, finished_at: float) -> None:
        """Put ``hook`` in the outbox (once: its id is derived from the ending) and note
        that the ending at ``finished_at`` has its webhook, in one transaction."""
        values = {k: getattr(hook, k) for k in api_webhooks_table.c.keys()}
        stmt = insert_for(self.dialect, api_webhooks_table).on_conflict_do_nothing()
        with self._write() as conn:
            conn.execute(stmt, values)
            conn.execute(
                api_jobs_table.update()
                .where(API.job_id == hook.job_id)
                .values(notified_at=finished_at)
            )

    @retried
    def due_webhooks(
        self,
        limit: int = 20,
        *,
        skip_receivers: Sequence[str] = (),
        skip_clients: Sequence[str] = (),
    ) -> list[Webhook]:
        """Deliveries whose next attempt is due, the most overdue first, but none to a
        receiver of ``skip_receivers`` or of a client of ``skip_clients`` (those with all
        their share of deliveries under way): however many of theirs are due, they never
        hide another's behind ``limit``."""
        stmt = (
            sa.select(api_webhooks_table)
            .where(HOOK.next_at.is_not(None), HOOK.next_at <= self.now())
            .order_by(HOOK.next_at)
            .limit(limit)
        )
        if skip_receivers:
            stmt = stmt.where(
                sa.or_(HOOK.receiver.is_(None), HOOK.receiver.not_in(list(skip_receivers)))
            )
        if skip_clients:
            stmt = stmt.where(sa.or_(HOOK.client.is_(None), HOOK.client.not_in(list(skip_clients))))
        with self._read() as conn:
            return [Webhook(**r._mapping) for r in conn.execute(stmt)]

    @retried
    def take_webhook(self, hook: Webhook, hold_s: float) -> bool:
        """Take ``hook``'s attempt for ``hold_s`` seconds (its ``next_at`` moved on,
        compare-and-set): False when another API process took it first."""
        stmt = (
            api_webhooks_table.update()
            .where(HOOK.webhook_id == hook.webhook_id, HOOK.next_at == hook.next_at)
            .values(next_at=self.now() + hold_s)
        )
        with self._write() as conn:
            return bool(conn.execute(stmt).rowcount)

    @retried
    def webhook_tried(self, webhook_id: str, *, error: str | None, next_at: float | None) -> None:
        """Record an attempt: delivered (``error`` None), or failed with ``error`` and
        tried again at ``next_at`` (epoch seconds; None: given up)."""
        now = self.now()
        values: dict[str, Any] = {"attempts": HOOK.attempts + 1, "last_error": error}
        if error is None:
            values.update(next_at=None, delivered_at=now)
        elif next_at is None:
            values.update(next_at=None, given_up_at=now)
        else:
            values.update(next_at=next_at)
        with self._write() as conn:
            conn.execute(
                api_webhooks_table.update().where(HOOK.webhook_id == webhook_id).values(**values)
            )

    @retried
    def webhooks(self, job_id: str) -> list[Webhook]:
        """The outbox rows of ``job_id``, oldest first."""
        stmt = (
            sa.select(api_webhooks_table)
            .where(HOOK.job_id == job_id)
            .order_by(HOOK.created_at, HOOK.webhook_id)
        )
        with self._read() as conn:
            return [Webhook(**r._mapping) for r in conn.execute(stmt)]
