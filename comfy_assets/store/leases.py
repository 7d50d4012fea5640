"""Server leases: one prompt of ours per ComfyUI server across every process (an atomic
upsert each), and the marks of pools waiting for a server (fairness across runs)."""

from __future__ import annotations

from collections.abc import Sequence

from comfy_assets.store import statements as q
from comfy_assets.store.base import StoreBase
from comfy_assets.store.records import ServerLease
from comfy_assets.store.retry import retried


class ServerLeases(StoreBase):
    """Leases on servers (a part of ``Store``; the pool's ``ServerLeaseStore``)."""

    @retried
    def acquire_server(
        self,
        server: str,
        owner: str,
        lease_s: float,
        prompt_id: str | None = None,
        now: float | None = None,
    ) -> bool:
        """Take ``server`` for ``owner`` until ``now + lease_s`` (seconds), only if it is
        free, expired, held by a gone owner (``store/owners.py``) or already ours: one
        atomic upsert, so two processes never hold it at once. True if ``owner`` holds it
        now."""
        now = self._now(now)
        params = {
            "v_server": server,
            "v_owner": owner,
            "v_expires": now + lease_s,
            "v_prompt": prompt_id,
            "v_now": now,
        }
        return self._write_one(q.acquire_server(self.dialect), params) == 1

    @retried
    def renew_server(
        self, server: str, owner: str, lease_s: float, now: float | None = None
    ) -> bool:
        """Extend ``owner``'s lease to ``now + lease_s``; False if it is not ours now."""
        now = self._now(now)
        params = {"b_server": server, "b_owner": owner, "v_expires": now + lease_s, "v_now": now}
        return self._write_one(q.RENEW_SERVER, params) == 1

    @retried
    def release_server(
        self, server: str, owner: str, last_model: str | None = None, now: float | None = None
    ) -> bool:
        """Free ``server`` if ``owner`` holds it, remembering ``last_model`` (unchanged
        when None). False, and nothing changes, if ``owner`` did not hold it."""
        params = {
            "b_server": server,
            "b_owner": owner,
            "v_model": last_model,
            "v_now": self._now(now),
        }
        return self._write_one(q.RELEASE_SERVER, params) == 1

    @retried
    def note_server_model(
        self, server: str, last_model: str | None, now: float | None = None
    ) -> None:
        """Remember that ``server`` holds ``last_model`` now (None: nothing, as after a
        restart), whoever holds its lease: every process sharing the servers plans with
        it (``pool/plan.py``)."""
        params = {"v_server": server, "v_model": last_model, "v_now": self._now(now)}
        self._write_one(q.note_server_model(self.dialect), params)

    @retried
    def server_leases(self) -> dict[str, ServerLease]:
        """Every server ever leased, by name (a released one has ``owner`` None;
        ``holder_gone``: its owner is gone, so the lease is free to take)."""
        with self._read() as conn:
            rows = conn.execute(q.server_leases(self.dialect))
            return {
                r.server: ServerLease(**{**r._mapping, "holder_gone": bool(r.holder_gone)})
                for r in rows
            }

    @retried
    def mark_waiting(
        self,
        owner: str,
        wait_s: float,
        servers: Sequence[str] | None = None,
        now: float | None = None,
        priority: int = 0,
    ) -> None:
        """Say that ``owner`` waits for one of ``servers`` (None: any), for the next
        ``wait_s`` seconds, for a batch of ``priority`` (higher first)."""
        listed = None if servers is None else " " + " ".join(servers) + " "
        params = {
            "owner": owner,
            "expires_at": self._now(now) + wait_s,
            "servers": listed,
            "priority": priority,
        }
        self._write_one(q.upsert_waiter(self.dialect), params)

    @retried
    def waiting_marks(self, owner: str, now: float | None = None) -> list[tuple[str | None, int]]:
        """The marks of owners other than ``owner`` standing at ``now``: (the servers
        waited for as " gpu0 gpu1 ", None for any; the batch's priority), one statement
        (on PostgreSQL without BEGIN and COMMIT)."""
        params = {"b_owner": owner, "b_now": self._now(now)}
        if self.dialect == "postgresql":
            with self._connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                return [(r.servers, r.priority) for r in conn.execute(q.WAITING_MARKS, params)]
        with self._read() as conn:
            return [(r.servers, r.priority) for r in conn.execute(q.WAITING_MARKS, params)]

    @retried
    def others_waiting(
        self, owner: str, server: str, now: float | None = None, priority: int | None = None
    ) -> bool:
        """True when another owner waits now for ``server`` (see ``mark_waiting``), for
        a batch of at least ``priority`` (None: any)."""
        escaped = server.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = f"% {escaped} %"
        floor = -(2**31) if priority is None else priority
        params = {
            "b_owner": owner,
            "b_server": pattern,
            "b_now": self._now(now),
            "b_priority": floor,
        }
        if self.dialect == "postgresql":  # one statement, no BEGIN and COMMIT around it
            return self._autocommit_first(q.OTHERS_WAITING, params) is not None
        with self._read() as conn:
            return conn.execute(q.OTHERS_WAITING, params).first() is not None
