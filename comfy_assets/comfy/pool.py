"""The GPU pool: at most one prompt of ours per ComfyUI server, across every process.

ComfyUI executes one prompt at a time per server (data/recorded/README.md, fact 1), so a
server is a slot. A slot is held through a **server lease** in the result store (the same
SQLite/PostgreSQL database every process shares): taken atomically, renewed while the
prompt runs, released as soon as the prompt has left the server, or expired if the holder
died. Among free servers the pool probes ``/system_stats`` and ``/queue`` concurrently and
picks the shortest queue (prompts of other clients count), then the job's previous server,
then a server that last ran the same model (affinity), then configuration order.

No Dagster here: the batch runner, the CLI and the RabbitMQ worker all use this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.servers import ServerSpec

log = logging.getLogger("comfy_assets.pool")

# Every client_id we send starts with this, so a probe of /queue can tell our prompts
# from those of people using the web UI (the /queue item's extra_data carries client_id).
CLIENT_ID_PREFIX = "comfy-assets-"


class ServerLeaseStore(Protocol):
    """What the pool needs of the result store (``comfy_assets.store.Store`` has it)."""

    def acquire_server(
        self, server: str, owner: str, lease_s: float, prompt_id: str | None = None
    ) -> bool: ...

    def renew_server(self, server: str, owner: str, lease_s: float) -> bool: ...

    def release_server(self, server: str, owner: str, last_model: str | None = None) -> None: ...

    def server_leases(self) -> dict: ...


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
    models: tuple[str, ...] = ()
    queue_lengths: dict[str, int] = field(default_factory=dict)
    released: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    def release(self) -> None:
        """Give the server back (call once the prompt has left it). Safe to call twice."""
        if not self.released:
            self.released = True
            self.pool._release(self)

    def abandon(self) -> None:
        """Stop renewing without releasing: the lease expires by itself.

        For when we can't confirm our prompt left the server (it is unreachable): another
        process may take it only after the lease time, never while our prompt may run.
        """
        if not self.released:
            self.released = True
            self.pool._abandon(self)


class NoServerAvailable(Exception):
    """Raised by ``Pool.acquire`` only when ``wait=False`` and no server is free."""


class Pool:
    """Named ComfyUI servers shared through server leases.

    ``servers``: configuration order matters (last tie-break). ``leases``: the store.
    ``owner``: this process's lease owner id. ``lease_s``: server lease time in seconds
    (renewed every third of it while held). ``probe_timeout_s``: per probe (3 s).
    ``max_queue``: a server whose foreign queue is at or above it is not a candidate.
    ``unhealthy_wait_s``: wait before re-probing when no server is healthy (5 s).
    ``busy_poll_s``: how often to look again when every server is held by another process.
    """

    def __init__(
        self,
        servers: Sequence[ServerSpec],
        leases: ServerLeaseStore,
        *,
        owner: str,
        lease_s: float = 30.0,
        probe_timeout_s: float = 3.0,
        max_queue: int | None = None,
        unhealthy_wait_s: float = 5.0,
        busy_poll_s: float = 0.05,
    ) -> None:
        if not servers:
            raise ValueError("a pool needs at least one server")
        self.servers = list(servers)
        self.leases = leases
        self.owner = owner
        self.lease_s = lease_s
        self.probe_timeout_s = probe_timeout_s
        self.max_queue = max_queue
        self.unhealthy_wait_s = unhealthy_wait_s
        self.busy_poll_s = busy_poll_s
        self.clients = {s.name: ComfyClient(s.url, name=s.name) for s in self.servers}
        self._held: dict[str, Slot] = {}
        self._changed = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._reported: dict[str, str] = {}  # last state reported per server (log once)
        self.last_model: dict[str, str | None] = {}

    async def __aenter__(self) -> Pool:
        for client in self.clients.values():
            await client.__aenter__()
        self._renewer = asyncio.create_task(self._renew_forever(), name="pool-lease-renewer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._renewer:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        for slot in list(self._held.values()):
            slot.release()
        for client in self.clients.values():
            await client.__aexit__(None, None, None)

    def client(self, name: str) -> ComfyClient:
        """The shared client of server ``name`` (for catch-up and downloads)."""
        return self.clients[name]

    def spec(self, name: str) -> ServerSpec | None:
        return next((s for s in self.servers if s.name == name), None)

    # -- choosing -----------------------------------------------------------------------

    async def probe(self, spec: ServerSpec) -> ServerProbe:
        """Probe ``/system_stats`` and ``/queue`` of one server within ``probe_timeout_s``."""
        client = self.clients[spec.name]
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                _, queue = await asyncio.gather(client.system_stats(), client.queue())
        except TimeoutError:
            return ServerProbe(spec.name, False, reason=f"no answer in {self.probe_timeout_s} s")
        except ComfyError as e:
            return ServerProbe(spec.name, False, reason=f"{type(e).__name__}: {e}")
        entries = [*queue.running, *queue.pending]
        ours = tuple(
            e.prompt_id for e in entries if (e.client_id or "").startswith(CLIENT_ID_PREFIX)
        )
        return ServerProbe(spec.name, True, foreign_queue=len(entries) - len(ours), ours=ours)

    async def acquire(
        self,
        *,
        prefer: str | None = None,
        models: Sequence[str] = (),
        only: str | None = None,
        allow_prompt: str | None = None,
        wait: bool = True,
    ) -> Slot:
        """Hold a free server for one prompt; wait (without spinning) until one is free.

        ``prefer``: the job's previous server (wins ties on queue length).
        ``models``: the job's model names (affinity: a server that last ran one wins ties).
        ``only``: restrict to one server (catch-up of a prompt already queued there), and
        ``allow_prompt``: that prompt_id of ours may be on it.
        Raises ``NoServerAvailable`` when ``wait`` is false and nothing is free.
        """
        while True:
            self._changed.clear()
            slot, all_unhealthy = await self._try_acquire(prefer, models, only, allow_prompt)
            if slot is not None:
                return slot
            if not wait:
                raise NoServerAvailable("no free healthy server")
            timeout = self.unhealthy_wait_s if all_unhealthy else self.busy_poll_s
            try:
                # A local release wakes us at once; other processes' releases are seen
                # on the next look at the leases.
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass

    async def _try_acquire(
        self,
        prefer: str | None,
        models: Sequence[str],
        only: str | None,
        allow_prompt: str | None,
    ) -> tuple[Slot | None, bool]:
        now = time.time()
        leases = self.leases.server_leases()
        free = []
        for spec in self.servers:
            if only is not None and spec.name != only:
                continue
            if spec.name in self._held:
                continue
            lease = leases.get(spec.name)
            if lease is not None and lease.owner and lease.expires_at > now:
                continue
            free.append(spec)
        if not free:
            return None, False
        probes = await asyncio.gather(*(self.probe(s) for s in free))
        self._report(probes)
        candidates = []
        for order, (spec, p) in enumerate(zip(free, probes, strict=True)):
            if not p.healthy:
                continue
            if any(pid != allow_prompt for pid in p.ours):
                continue  # a prompt of ours is still there (a dead holder's): not free
            if self.max_queue is not None and p.foreign_queue >= self.max_queue:
                continue
            last = self._last_model(spec.name, leases)
            affinity = 0 if (last is not None and last in models) else 1
            key = (p.foreign_queue, 0 if spec.name == prefer else 1, affinity, order)
            candidates.append((key, spec, p))
        if not candidates:
            return None, all(not p.healthy for p in probes)
        candidates.sort(key=lambda c: c[0])
        lengths = {p.name: p.foreign_queue for p in probes if p.healthy}
        for _, spec, _p in candidates:
            # Another consumer of this process may have taken it while we probed; the
            # store can't tell (same owner), so check here, with no await in between.
            if spec.name in self._held:
                continue
            if self.leases.acquire_server(spec.name, self.owner, self.lease_s):
                slot = Slot(spec, self.clients[spec.name], self, tuple(models), lengths)
                self._held[spec.name] = slot
                log.debug(
                    "scheduler: %s chosen, queue lengths %s",
                    spec.name,
                    ", ".join(f"{n} {q}" for n, q in lengths.items()),
                )
                return slot, False
        return None, False

    def _last_model(self, name: str, leases: dict) -> str | None:
        lease = leases.get(name)
        stored = getattr(lease, "last_model", None) if lease is not None else None
        return stored or self.last_model.get(name)

    def _report(self, probes: Sequence[ServerProbe]) -> None:
        """Log a server's state once when it changes, not at every probe."""
        for p in probes:
            state = "healthy" if p.healthy else f"unreachable: {p.reason}"
            if self._reported.get(p.name, "healthy") != state:
                level = logging.INFO if p.healthy else logging.WARNING
                log.log(level, "server %s %s", p.name, state)
            self._reported[p.name] = state

    def unreachable(self) -> dict[str, str]:
        """Servers last seen unreachable, with the reason: for summaries and metadata."""
        return {n: s for n, s in self._reported.items() if s != "healthy"}

    # -- holding ------------------------------------------------------------------------

    def _release(self, slot: Slot) -> None:
        self._held.pop(slot.name, None)
        model = slot.models[0] if slot.models else None
        if model is not None:
            self.last_model[slot.name] = model
        self.leases.release_server(slot.name, self.owner, last_model=model)
        self._changed.set()

    def _abandon(self, slot: Slot) -> None:
        self._held.pop(slot.name, None)
        log.warning(
            "server %s: our prompt may still be there; its lease will expire in %.0f s",
            slot.name,
            self.lease_s,
        )

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            for name in list(self._held):
                if not self.leases.renew_server(name, self.owner, self.lease_s):
                    log.error("server %s: lease lost before the prompt left it", name)
