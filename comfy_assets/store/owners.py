"""Owners: the processes that hold claims and server leases, and their heartbeats.

An owner (``host:pid:random``, unique across hosts by its random part) registers when
it starts and beats every ``OWNER_BEAT_S`` seconds. It is **gone** when it released
itself at its end, when another process found it gone (``gone_at``: never revived), or
when, by the database's clock, its last beat is older than ``OWNER_DEAD_S`` and the
database itself has been up that long (after a PostgreSQL restart every owner gets
``OWNER_DEAD_S`` to beat again). No host name or pid is trusted: two containers can share
both. A claim of a gone owner is taken over at once (``Claims.claim_job``), which marks
it found gone; a silent owner nobody found gone lives on when its beats land again.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from comfy_assets.store.base import StoreBase
from comfy_assets.store.clock import db_now
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import OWNER_BEAT_S, OWNER_DEAD_S, owners_table
from comfy_assets.store.statements import OWNER, gone_condition

# Rows of owners that ended more than this many seconds ago are deleted.
OWNER_KEEP_S = 7 * 86400.0

__all__ = ["OWNER_BEAT_S", "OWNER_DEAD_S", "OwnerRecord", "Owners", "gone_condition", "owner_of"]


@dataclass(frozen=True)
class OwnerRecord:
    """One owner. Times are epoch seconds by the database's clock; ``beat_age_s`` is
    the seconds since its last beat, ``gone`` whether it is gone (module docstring)."""

    owner: str
    host: str
    pid: int
    run_id: str | None
    started_at: float
    beat_at: float
    gone_at: float | None
    released_at: float | None
    beat_age_s: float
    gone: bool


def owner_of(claim_owner: str) -> str:
    """The owner a claim's holder belongs to: a worker claims each job it runs as
    ``OWNER#N`` (two deliveries of one job in one worker must not share a claim)."""
    return claim_owner.split("#", 1)[0]


class Owners(StoreBase):
    """Owners and their heartbeats (a part of ``Store``)."""

    @retried
    def register_owner(
        self,
        owner: str,
        *,
        run_id: str | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        """Record ``owner`` (this host and pid unless given; ``run_id``: the Dagster run
        it renders for) as alive now, and delete owners that ended over a week ago.
        Registering an owner again refreshes its beat unless it is gone."""
        now = db_now(self.dialect)
        with self._write() as conn:
            asked_at = time.time()
            conn.execute(
                owners_table.delete().where(
                    sa.func.coalesce(OWNER.released_at, OWNER.gone_at) < now - OWNER_KEEP_S
                )
            )
            known = conn.execute(
                sa.select(OWNER.owner).where(OWNER.owner == owner).with_for_update()
            ).first()
            if known is None:
                conn.execute(
                    owners_table.insert().values(
                        owner=owner,
                        host=host if host is not None else socket.gethostname(),
                        pid=pid if pid is not None else os.getpid(),
                        run_id=run_id,
                        started_at=now,
                        beat_at=now,
                    )
                )
            else:
                self._beat(conn, owner)
            db_time = conn.execute(sa.select(now)).scalar_one()
            self.clock.measured(float(db_time), asked_at, time.time())

    @retried
    def beat_owner(self, owner: str) -> bool:
        """One heartbeat of ``owner`` (the database's clock is measured by it). False
        when ``owner`` released itself or was found gone (or is unknown): it is never
        revived, and whatever it held is another's to take."""
        with self._write() as conn:
            return self._beat(conn, owner)

    def _beat(self, conn: sa.Connection, owner: str) -> bool:
        now = db_now(self.dialect)
        asked_at = time.time()
        # A silent owner nobody found gone yet lives on (a blip of its network); one found
        # gone, whose claims others may hold now, never comes back.
        beat = (
            owners_table.update()
            .where(OWNER.owner == owner, OWNER.gone_at.is_(None), OWNER.released_at.is_(None))
            .values(beat_at=now)
            .returning(OWNER.beat_at)
        )
        row = conn.execute(beat).first()
        if row is None:
            return False
        self.clock.measured(float(row.beat_at), asked_at, time.time())
        return True

    @retried
    def release_owner(self, owner: str) -> None:
        """``owner`` ended by itself: gone from now on (its claims are free to take)."""
        with self._write() as conn:
            conn.execute(
                owners_table.update()
                .where(OWNER.owner == owner, OWNER.released_at.is_(None))
                .values(released_at=db_now(self.dialect))
            )

    @retried
    def owner_gone(self, owner: str) -> str | None:
        """Why ``owner`` is gone ("released at its end", "no heartbeat for 12 s", "found
        gone by another process"), or None while it is alive or unknown here."""
        with self._read() as conn:
            return self._gone_reason(conn, owner, lock=False)

    def _gone_reason(self, conn: sa.Connection, owner: str, *, lock: bool) -> str | None:
        """``owner_gone`` on ``conn``; ``lock`` holds the owner's row (FOR UPDATE) so
        that a heartbeat of it waits for this transaction."""
        query = sa.select(
            OWNER.released_at,
            OWNER.gone_at,
            (db_now(self.dialect) - OWNER.beat_at).label("age"),
            gone_condition(self.dialect).label("gone"),
        ).where(OWNER.owner == owner)
        row = conn.execute(query.with_for_update(of=owners_table) if lock else query).first()
        if row is None or not row.gone:
            return None
        if row.released_at is not None:
            return "released at its end"
        if row.gone_at is not None:
            return "found gone by another process"
        return f"no heartbeat for {row.age:.0f} s"

    @retried
    def mark_owner_gone(self, owner: str) -> str | None:
        """Record ``owner`` as gone if it is (``owner_gone``): its next heartbeat fails,
        so it can never act again. Returns why it is gone, or None (alive: unchanged)."""
        with self._write() as conn:
            reason = self._gone_reason(conn, owner, lock=True)
            if reason is not None:
                self._mark_gone(conn, owner)
            return reason

    def _mark_gone(self, conn: sa.Connection, owner: str) -> None:
        """Record that ``owner`` was found gone: its next heartbeat fails."""
        conn.execute(
            owners_table.update()
            .where(OWNER.owner == owner, OWNER.gone_at.is_(None), OWNER.released_at.is_(None))
            .values(gone_at=db_now(self.dialect))
        )

    @retried
    def owners(self, run_ids: Sequence[str] | None = None) -> list[OwnerRecord]:
        """Every owner known (or those of ``run_ids``), oldest first."""
        with self._read() as conn:
            return read_owners(conn, self.dialect, run_ids)


def read_owners(
    conn: sa.Connection, dialect: str, run_ids: Sequence[str] | None = None
) -> list[OwnerRecord]:
    """``Owners.owners`` read on ``conn`` (within a transaction of the caller's)."""
    query = sa.select(
        owners_table,
        (db_now(dialect) - OWNER.beat_at).label("beat_age_s"),
        gone_condition(dialect).label("gone"),
    ).order_by(OWNER.started_at, OWNER.owner)
    if run_ids is not None:
        query = query.where(OWNER.run_id.in_(list(run_ids)))
    rows = conn.execute(query).all()
    return [
        OwnerRecord(**{**r._mapping, "gone": bool(r.gone), "beat_age_s": float(r.beat_age_s)})
        for r in rows
    ]
