"""The job claims a batch holds: taken, renewed by a heartbeat, lost, released.

A claim is a lease on a job in the store (``Store.claim_job``): while ours, no other
worker runs the job. The heartbeat renews every claim each third of ``lease_s``; while
the store fails it tries every thirtieth, and a claim that another worker took, or that
can't be renewed before only a third of it is left, is **gone**: ``on_gone(job_id, why)``
tells the batch, which stops that job's attempt (our prompt removed) and leaves the job
to whoever holds it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from comfy_assets.store import JobRecord, Store, StoreUnavailable

log = logging.getLogger("comfy_assets.render.claim_keeping")

StoreCall = Callable[..., Awaitable[Any]]


@dataclass(eq=False)
class Claims:
    """Our claims on jobs. ``db(fn, *args)`` runs a store call (on a worker thread for
    PostgreSQL); ``on_gone(job_id, why)`` is called for a claim lost while held."""

    store: Store
    owner: str
    lease_s: float
    db: StoreCall
    on_gone: Callable[[str, str], None]
    held: set[str] = field(default_factory=set, init=False)
    # Claims asked for and not yet answered.
    asking: set[str] = field(default_factory=set, init=False)
    # Epoch time (the store's clock) until which each claim of ours stands for sure.
    until: dict[str, float] = field(default_factory=dict, init=False)
    # Jobs whose final record is being written: no longer renewed, released at the end.
    finishing: set[str] = field(default_factory=set, init=False)
    # Claims taken before the batch ran, each returned once by ``claim`` (``adopt``).
    adopted: dict[str, JobRecord] = field(default_factory=dict, init=False)

    def adopt(self, job_id: str, rec: JobRecord) -> None:
        """``rec``, the record of a claim of ours taken before the batch ran (a job
        registered claimed: ``Store.register_claimed``), is what the next ``claim`` of
        ``job_id`` returns, without asking the store; the claim is held from now."""
        self.adopted[job_id] = rec
        self.held.add(job_id)
        self.until[job_id] = rec.claim_expires_at or 0.0

    async def claim(self, job_id: str, prompt_id: str) -> tuple[str, JobRecord]:
        """``Store.claim_job`` for us, of the job whose prompt is ``prompt_id``: (status,
        record); "changed" when the store's prompt of the job is another now. A claim
        taken is held (renewed, released at the end); one asked for stays in ``asking``
        if we are cancelled meanwhile, since it may still land on its worker thread."""
        adopted = self.adopted.pop(job_id, None)
        if adopted is not None and adopted.prompt_id == prompt_id and job_id in self.held:
            return "claimed", adopted
        self.asking.add(job_id)
        status, rec = await self.db(
            self.store.claim_job, job_id, self.owner, self.lease_s, prompt_id=prompt_id
        )
        self.asking.discard(job_id)
        if status == "claimed":
            self.held.add(job_id)
            self.until[job_id] = rec.claim_expires_at or 0.0
        return status, rec

    def forget(self, job_id: str) -> None:
        """The claim is not ours any more (lost, or given to its holder): stop renewing."""
        self.held.discard(job_id)
        self.until.pop(job_id, None)

    def finishing_now(self, job_id: str) -> None:
        """The job's final record is about to be written, which drops its claim: the
        heartbeat must not take that for a lost claim."""
        self.forget(job_id)
        self.finishing.add(job_id)

    def finished(self, job_id: str) -> None:
        self.finishing.discard(job_id)

    def release(self, job_id: str) -> None:
        """Give the claim back in the store. Raises StoreUnavailable."""
        self.forget(job_id)
        self.finishing.discard(job_id)
        self.store.release_claim(job_id, self.owner)

    def release_all(self, also: Sequence[str] = ()) -> None:
        """Release every claim of ours (and those of ``also``) at the end; with the store
        unreachable they are left to expire (each after its lease), which the log says."""
        job_ids = [*also, *self.held, *self.asking, *self.finishing]
        for i, job_id in enumerate(job_ids):
            try:
                self.release(job_id)
            except StoreUnavailable as e:
                log.warning(
                    "%d claims not released (%s); they expire within %.0f s",
                    len(job_ids) - i,
                    e,
                    self.lease_s,
                )
                return

    async def heartbeat(self) -> None:
        """Renew every held claim until cancelled (see the module docstring)."""
        failing = False
        while True:
            await asyncio.sleep(self.lease_s / (30 if failing else 3))
            failing = False
            for job_id in list(self.held):
                failing = not await self._renew(job_id) or failing

    async def _renew(self, job_id: str) -> bool:
        """Renew one claim; False when the store failed and the claim still stands."""
        asked_at = self.store.now()
        try:
            renewed = await self.db(self.store.renew_claim, job_id, self.owner, self.lease_s)
        except Exception as e:  # the store, whatever its driver: judged by the time left
            left = self.until.get(job_id, asked_at) - asked_at
            why = f"{type(e).__name__}: {e}"
            if left > self.lease_s / 3:
                log.warning("job %s: claim not renewed (%s); %.0f s left", job_id, why, left)
                return False
            self._gone(job_id, f"claim not renewed ({why}) and {left:.0f} s left")
            return True
        if job_id not in self.held:
            return True  # finished or released while we asked
        if renewed:
            self.until[job_id] = asked_at + self.lease_s
        else:
            self._gone(job_id, "claim taken by another worker")
        return True

    def _gone(self, job_id: str, why: str) -> None:
        log.error("job %s: %s; its attempt is stopped", job_id, why)
        self.on_gone(job_id, why)
