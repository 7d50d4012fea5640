"""What running batches say of themselves (``comfy_live``): per partition its estimate
and the jobs it holds back with their reasons, per server what it renders now or why it
is not used. Written by each batch every few seconds (``render/steering.py``), read by
``comfy-assets status`` (``cli/status.py``); rows of an owner that stopped beating are
not read (``store/owners.py``), and an owner's rows are replaced whole at each write."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from comfy_assets.store.base import StoreBase
from comfy_assets.store.retry import retried
from comfy_assets.store.schema import attempts_table, jobs_table, live_table, owners_table

# Seconds after which a row nobody rewrote is stale (its batch ended or hangs).
LIVE_STALE_S = 15.0


@dataclass(frozen=True)
class LiveRow:
    """One row: ``owner`` (a process), ``kind`` (``partition`` or ``server``),
    ``subject`` (its name), ``detail`` (the JSON object written), ``age_s`` (seconds
    since it was written, by the database's clock)."""

    owner: str
    kind: str
    subject: str
    detail: dict[str, Any]
    age_s: float


class Live(StoreBase):
    """Reading and writing ``comfy_live`` (a part of ``Store``)."""

    @retried
    def publish_live(
        self,
        owner: str,
        rows: Mapping[tuple[str, str], Mapping[str, Any]],
        now: float | None = None,
    ) -> None:
        """Replace ``owner``'s rows with ``rows``: ``{(kind, subject): detail}``."""
        now = self._now(now)
        values = [
            {
                "owner": owner,
                "kind": kind,
                "subject": subject,
                "detail": json.dumps(detail, separators=(",", ":")),
                "updated_at": now,
            }
            for (kind, subject), detail in rows.items()
        ]
        with self._write() as conn:
            conn.execute(live_table.delete().where(live_table.c.owner == owner))
            if values:
                conn.execute(live_table.insert(), values)

    @retried
    def clear_live(self, owner: str) -> None:
        """Forget ``owner``'s rows (its batch ended)."""
        with self._write() as conn:
            conn.execute(live_table.delete().where(live_table.c.owner == owner))

    @retried
    def live(self, stale_s: float = LIVE_STALE_S) -> list[LiveRow]:
        """The rows written within ``stale_s`` seconds by owners not released, oldest
        owner first."""
        now = self.now()
        query = (
            sa.select(live_table)
            .join(owners_table, owners_table.c.owner == live_table.c.owner, isouter=True)
            .where(live_table.c.updated_at >= now - stale_s)
            .where(owners_table.c.released_at.is_(None), owners_table.c.gone_at.is_(None))
            .order_by(live_table.c.updated_at, live_table.c.owner)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        out = []
        for r in rows:
            try:
                detail = json.loads(r.detail)
            except ValueError:
                continue  # a row written by another version: nothing we can show
            if isinstance(detail, dict):
                out.append(LiveRow(r.owner, r.kind, r.subject, detail, now - r.updated_at))
        return out

    @retried
    def job_state_counts(self, partitions: Sequence[str] | None = None) -> dict[str, int]:
        """Jobs by state, of ``partitions`` (None: every partition), for the metrics."""
        jobs = jobs_table.c
        query = sa.select(jobs.state, sa.func.count()).group_by(jobs.state)
        if partitions is not None:
            query = query.where(jobs.partition.in_(list(partitions)))
        with self._read() as conn:
            return {str(state): int(n) for state, n in conn.execute(query)}

    @retried
    def attempt_outcome_counts(
        self, partitions: Sequence[str] | None = None
    ) -> dict[tuple[str, str], int]:
        """Attempts by (server, outcome) of the jobs of ``partitions`` (None: all)."""
        tries, jobs = attempts_table.c, jobs_table.c
        query = sa.select(tries.server, tries.outcome, sa.func.count()).group_by(
            tries.server, tries.outcome
        )
        if partitions is not None:
            query = query.join(jobs_table, jobs.job_id == tries.job_id).where(
                jobs.partition.in_(list(partitions))
            )
        with self._read() as conn:
            return {(server or "", outcome): int(n) for server, outcome, n in conn.execute(query)}

    def server_quarantined(self, server: str) -> bool:
        """Whether ``server`` is quarantined now (``store/health.py``: jobs failed there
        that rendered elsewhere), as the metrics read it."""
        record = self.server_health().get(server)  # type: ignore[attr-defined]
        return record is not None and record.state == "quarantined"
