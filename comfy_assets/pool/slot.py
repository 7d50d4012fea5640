"""A server held for one prompt (``Slot``), what a probe of a server says
(``ServerProbe``), what the pool needs of the store (``ServerLeaseStore``), and the
client ids that mark our prompts in any server's /queue."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.servers import ServerSpec

if TYPE_CHECKING:  # the pool makes slots; a slot tells its pool
    from comfy_assets.pool.pool import Pool
    from comfy_assets.pool.quarantine import HealthRecord

# Every client_id we send starts with this, so a probe of /queue can tell our prompts
# from those of people using the web UI (the /queue item's extra_data carries client_id).
CLIENT_ID_PREFIX = "comfy-assets-"


def new_client_id() -> str:
    """A fresh client id, recognisable as ours in any server's /queue."""
    return CLIENT_ID_PREFIX + uuid.uuid4().hex


class ServerLeaseView(Protocol):
    """What the pool reads of a server's lease row (``store.records.ServerLease``):
    ``owner`` None once released; ``expires_at`` in the store's epoch seconds;
    ``holder_gone``, its owner is gone (free to take); ``last_model``, what it holds."""

    @property
    def owner(self) -> str | None: ...

    @property
    def expires_at(self) -> float | None: ...

    @property
    def holder_gone(self) -> bool: ...

    @property
    def last_model(self) -> str | None: ...


class ServerLeaseStore(Protocol):
    """What the pool needs of the result store (``comfy_assets.store.Store`` has it)."""

    def acquire_server(
        self, server: str, owner: str, lease_s: float, prompt_id: str | None = None
    ) -> bool: ...

    def renew_server(self, server: str, owner: str, lease_s: float) -> bool: ...

    def release_server(self, server: str, owner: str, last_model: str | None = None) -> object: ...

    def note_server_model(self, server: str, last_model: str | None) -> None: ...

    def server_leases(self) -> Mapping[str, ServerLeaseView]: ...

    def mark_waiting(
        self,
        owner: str,
        wait_s: float,
        servers: Sequence[str],
        now: float | None = None,
        priority: int = 0,
    ) -> None: ...

    def others_waiting(
        self, owner: str, server: str, now: float | None = None, priority: int | None = None
    ) -> bool: ...

    def waiting_marks(self, owner: str) -> list[tuple[str | None, int]]: ...

    def server_health(self) -> Mapping[str, HealthRecord]:
        """Each server's health by name (``pool/quarantine.py``'s ``HealthRecord``)."""
        ...

    def now(self) -> float:
        """Epoch seconds by the clock the leases' expiry times are written in."""
        ...


@dataclass
class ServerProbe:
    """One probe of one server: healthy, or why not; queue lengths from ``/queue``."""

    name: str
    healthy: bool
    foreign_queue: int = 0  # prompts of other clients, running + pending
    ours: tuple[str, ...] = ()  # prompt_ids of ours found on the server
    reason: str = ""


@dataclass
class Slot:
    """A server held by this process for one prompt. ``release()`` is idempotent."""

    spec: ServerSpec
    client: ComfyClient
    pool: Pool
    models: tuple[str, ...] = ()  # the model files of its prompt (``Pool.assign``)
    load_expected: bool = False  # the server did not hold them: it loads one for this prompt
    assigned: bool = False  # ``Pool.assign`` said which job's models it runs
    released: bool = False
    prompt_id: str | None = None  # ours on the server, once posted (set by the runner)
    dispatching: bool = True  # held but not yet posted: the GPU waits on us
    handover: asyncio.Event | None = None  # set once the next prompt here is posted
    lost: str | None = None  # why our server lease was lost while held (set by the pool)
    posted_at: float | None = None  # loop time our prompt's POST was answered (for estimates)

    @property
    def name(self) -> str:
        return self.spec.name

    def release(self) -> None:
        """Give the server back (call once the prompt has left it). Safe to call twice."""
        if not self.released:
            self._dispatch_over()
            self.released = True
            self.pool.slot_released(self)

    def dispatched(self) -> None:
        """Say that the prompt has been posted (or won't be): the dispatch is over."""
        if self.prompt_id is not None and self.posted_at is None:
            self.posted_at = asyncio.get_running_loop().time()
        self._dispatch_over()

    def _dispatch_over(self) -> None:
        if self.dispatching:
            self.dispatching = False
            self.pool.dispatch_done()

    def abandon(self) -> None:
        """Stop renewing without releasing: the lease expires by itself.

        For when we can't confirm our prompt left the server (it is unreachable): another
        process may take it only after the lease time, never while our prompt may run.
        """
        if not self.released:
            self._dispatch_over()
            self.released = True
            self.pool.slot_abandoned(self)
