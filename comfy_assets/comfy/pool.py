"""The GPU pool: at most one prompt of ours per ComfyUI server, across every process.

ComfyUI executes one prompt at a time per server (data/recorded/README.md, fact 1), so a
server is a slot. A slot is held through a **server lease** in the result store (the same
SQLite/PostgreSQL database every process shares): taken atomically, renewed while the
prompt runs, released once the prompt has left the server (or passed, still ours, to our
next prompt there), or expired if the holder died. Among free servers the pool picks the
shortest queue (prompts of other clients count), then the job's previous server, then a
server that last ran the same model (affinity), then configuration order. A server's
queue comes from the ``status`` messages on its socket (ComfyUI sends them to every
socket on every queue change); ``/system_stats`` and ``/queue`` are asked only when the
socket says the server is not empty, or is not open yet.

Keeping GPUs busy: one socket per server stays open across prompts; consumers wait in one
line (a release wakes the first, not all); a server is freed at ``execution_success`` and
handed, lease and all, to the next consumer in line before the finished prompt's files
are downloaded; a server our own prompt just left is retaken without a probe. Across
processes, a pool that waits marks itself in the store and a pool that frees a server
leaves it to that process for a moment, so runs that share servers take turns.

No Dagster here: the batch runner, the CLI and the RabbitMQ worker all use this.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ComfyError, NoServerReachable
from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.comfy.servers import ServerSpec

log = logging.getLogger("comfy_assets.pool")
T = TypeVar("T")

# Every client_id we send starts with this, so a probe of /queue can tell our prompts
# from those of people using the web UI (the /queue item's extra_data carries client_id).
CLIENT_ID_PREFIX = "comfy-assets-"
REPORT_AGAIN_S = 60.0  # seconds between reminders that a server is still unreachable


def new_client_id() -> str:
    """A fresh client id, recognisable as ours in any server's /queue."""
    return CLIENT_ID_PREFIX + uuid.uuid4().hex


class ServerLeaseStore(Protocol):
    """What the pool needs of the result store (``comfy_assets.store.Store`` has it)."""

    def acquire_server(
        self, server: str, owner: str, lease_s: float, prompt_id: str | None = None
    ) -> bool: ...

    def renew_server(self, server: str, owner: str, lease_s: float) -> bool: ...

    def release_server(self, server: str, owner: str, last_model: str | None = None) -> None: ...

    def server_leases(self) -> dict: ...

    def mark_waiting(self, owner: str, wait_s: float) -> None: ...

    def others_waiting(self, owner: str) -> bool: ...


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
    released: bool = False
    prompt_id: str | None = None  # ours on the server, once posted (set by the runner)
    dispatching: bool = True  # held but not yet posted: the GPU waits on us
    handover: asyncio.Event | None = None  # set once the next prompt here is posted
    lost: str | None = None  # why our server lease was lost while held (set by the pool)

    @property
    def name(self) -> str:
        return self.spec.name

    def release(self) -> None:
        """Give the server back (call once the prompt has left it). Safe to call twice."""
        if not self.released:
            self.posted()
            self.released = True
            self.pool._release(self)

    def posted(self) -> None:
        """Say that the prompt has been posted (or won't be): the dispatch is over."""
        if self.dispatching:
            self.dispatching = False
            self.pool._dispatch_done()

    def abandon(self) -> None:
        """Stop renewing without releasing: the lease expires by itself.

        For when we can't confirm our prompt left the server (it is unreachable): another
        process may take it only after the lease time, never while our prompt may run.
        """
        if not self.released:
            self.posted()
            self.released = True
            self.pool._abandon(self)


class Pool:
    """Named ComfyUI servers shared through server leases.

    A lease that can't be renewed (the store fails until only a third of it is left) or
    that another process took is **lost**: the pool stops renewing it, marks the slot
    (``Slot.lost``) and calls each of ``lost_listeners`` with the slot, so its holder stops
    posting there and removes its prompt while the lease still keeps other processes
    away. A lost slot is not offered again until it is released; its release writes
    nothing to the store.

    A lease store that fails (a database failover) takes nothing meanwhile: consumers
    look again; after ``store_timeout_s`` seconds of failures its error is raised.

    ``unreachable_timeout_s``: once every server has failed its last probe for this long,
    ``acquire`` raises NoServerReachable (None: it waits for ever).

    A prompt of ours that nobody follows any more (its holder died, or gave up on it
    while the server answered nothing sensible) keeps its server from us. Once a probe has
    found such an **orphan** on a free server for ``orphan_grace_s`` (a retry's catch-up
    may still adopt it meanwhile), the pool takes the lease and removes it (interrupt,
    delete, wait until it left /queue), and says so.

    ``servers``: configuration order matters (last tie-break). ``leases``: the store.
    ``owner``: this process's lease owner id. ``lease_s``: server lease time in seconds
    (renewed every third of it while held). ``probe_timeout_s``: per probe (3 s).
    ``max_queue``: a server whose foreign queue is at or above it is not a candidate.
    ``unhealthy_wait_s``: wait before re-probing when no server is healthy (5 s).
    ``busy_poll_s``: how often to look again when every server is held by another process.
    ``stats_ttl_s``: how long a healthy ``/system_stats`` answer stands (``/queue`` is
    asked at every probe). ``probe_ttl_s``: how long a probe's /queue answer stands
    for a server nobody took since. ``poll_s``: /history poll period of the followers.
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
        stats_ttl_s: float = 2.0,
        probe_ttl_s: float = 0.1,
        poll_s: float = 1.0,
        unreachable_timeout_s: float | None = None,
        orphan_grace_s: float | None = None,
        store_timeout_s: float = 30.0,
    ) -> None:
        if not servers:
            raise ValueError("a pool needs at least one server")
        self.lost_listeners: list[Callable[[Slot], None]] = []
        self.store_timeout_s = store_timeout_s
        self._store_failing_since: float | None = None  # loop time
        self.unreachable_timeout_s = unreachable_timeout_s
        self._none_reachable_since: float | None = None  # loop time
        self.orphan_grace_s = 2 * lease_s if orphan_grace_s is None else orphan_grace_s
        self._orphans_since: dict[str, float] = {}  # loop time orphans were first seen
        self._sweeps: dict[str, asyncio.Task[None]] = {}  # orphan removals under way
        self.servers = list(servers)
        self.leases = leases
        self.owner = owner
        self.lease_s = lease_s
        self.probe_timeout_s = probe_timeout_s
        self.max_queue = max_queue
        self.unhealthy_wait_s = unhealthy_wait_s
        self.busy_poll_s = busy_poll_s
        self.stats_ttl_s = stats_ttl_s
        self.probe_ttl_s = probe_ttl_s
        self.poll_s = poll_s
        # One socket per server, kept open across prompts: ours run one at a time per
        # server, and a socket opened per prompt costs a handshake while the GPU waits.
        self._followers: dict[str, PromptFollower] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self.clients = {
            s.name: ComfyClient(s.url, credentials=s.credentials, name=s.name) for s in self.servers
        }
        self._held: dict[str, Slot] = {}
        # Servers freed by our prompt while a consumer of ours waited in line: the lease
        # stays ours (loop time kept) and passes to that consumer without two writes to
        # the store on the way from one prompt to the next.
        self._kept: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._reported: dict[str, str] = {}  # last state reported per server (log once)
        self._reported_at: dict[str, float] = {}  # monotonic time of that report
        self.last_model: dict[str, str | None] = {}
        # Prompts of ours that have finished: ComfyUI still lists a prompt in /queue while
        # it writes its history, so a probe right after execution_success sees it; it no
        # longer occupies the GPU and must not keep the server from its next prompt.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._probing: dict[str, asyncio.Future[ServerProbe]] = {}
        self._line = asyncio.Lock()
        self._stats_at: dict[str, float] = {}  # loop time of each server's last /system_stats
        self._probed: dict[str, tuple[float, ServerProbe]] = {}  # last healthy probe
        self._freed_at: dict[str, float] = {}  # loop time our last prompt left each server
        # Dispatches under way (a server held or about to be handed over, not yet posted
        # to): downloads and bookkeeping wait for them, so an idle GPU comes first.
        # A server freed while a consumer waits in line is handed over: the freeing job's
        # downloads wait (briefly) for that next prompt to be posted, so the GPU comes
        # first. One event per handover, set by the next dispatch to finish.
        self._handovers: deque[asyncio.Event] = deque()
        # Fairness across processes: servers left to another waiting process until then.
        self._yielded: dict[str, float] = {}
        self._others = False
        self._others_asked_at = -1e9
        self._marked_at = -1e9
        # Loop time until which each lease we hold or keep is ours for sure (the last
        # acquire or renewal that the store confirmed, plus lease_s).
        self._lease_until: dict[str, float] = {}

    async def __aenter__(self) -> Pool:
        for client in self.clients.values():
            await client.__aenter__()
        self._renewer = asyncio.create_task(self._renew_forever(), name="pool-lease-renewer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._renewer:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self._sweeps:  # a removal half done leaves a lease to expire, nothing worse
            for sweep in self._sweeps.values():
                sweep.cancel()
            await asyncio.gather(*self._sweeps.values(), return_exceptions=True)
        for slot in list(self._held.values()):
            slot.release()
        for name in list(self._kept):
            self._let_go(name)
        for follower in self._followers.values():
            await follower.__aexit__(None, None, None)
        self._followers.clear()
        for client in self.clients.values():
            await client.__aexit__(None, None, None)

    def client(self, name: str) -> ComfyClient:
        """The shared client of server ``name`` (for catch-up and downloads)."""
        return self.clients[name]

    async def follower(self, name: str) -> PromptFollower:
        """The open socket of server ``name`` (``/ws`` with a client_id of ours), opened
        on first use and again after a fatal failure; it reconnects by itself after a
        drop. Raises the client's typed errors when it cannot be opened."""
        follower = self._followers.get(name)
        if follower is not None and not follower.failed:
            return follower
        async with self._opening.setdefault(name, asyncio.Lock()):
            follower = self._followers.get(name)
            if follower is not None and not follower.failed:
                return follower
            if follower is not None:
                del self._followers[name]
                await follower.close()
            follower = PromptFollower(self.clients[name], new_client_id(), poll_s=self.poll_s)
            await follower.__aenter__()
            self._followers[name] = follower
            return follower

    def spec(self, name: str) -> ServerSpec | None:
        return next((s for s in self.servers if s.name == name), None)

    # -- choosing -----------------------------------------------------------------------

    async def probe(self, spec: ServerSpec) -> ServerProbe:
        """Probe ``/system_stats`` and ``/queue`` of one server within ``probe_timeout_s``.

        Consumers waiting at the same moment share one probe per server, and an answer
        stands for ``probe_ttl_s`` (a burst of acquisitions, as at start, probes once).
        A server whose open socket says its queue is empty needs no request at all: the
        ``status`` broadcast (README fact 3) already told us (a prompt posted a moment ago
        may not be counted yet; it would queue ahead of ours, as after any probe). A
        healthy server's socket is opened by its first probe: a server whose ``/ws``
        fails is unreachable for us, as we could not follow a prompt there.
        """
        follower = self._followers.get(spec.name)
        if follower is not None and not follower.failed and follower.queue_remaining() == 0:
            return ServerProbe(spec.name, True)
        cached = self._probed.get(spec.name)
        if cached is not None and asyncio.get_running_loop().time() - cached[0] < self.probe_ttl_s:
            return cached[1]
        running = self._probing.get(spec.name)
        if running is None:
            running = asyncio.ensure_future(self._probe(spec))
            self._probing[spec.name] = running
            running.add_done_callback(lambda _: self._probing.pop(spec.name, None))
        return await asyncio.shield(running)

    async def _probe(self, spec: ServerSpec) -> ServerProbe:
        client = self.clients[spec.name]
        loop = asyncio.get_running_loop()
        # /system_stats says the server is up and which device it has; it changes slowly,
        # so a recent healthy answer stands in for it. /queue is always asked afresh.
        fresh = loop.time() - self._stats_at.get(spec.name, -1e9) < self.stats_ttl_s
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                if fresh:
                    queue = await client.queue()
                else:
                    _, queue = await asyncio.gather(client.system_stats(), client.queue())
                    self._stats_at[spec.name] = loop.time()
                # A prompt needs the server's socket; once open, its `status` messages
                # answer the next probes without a request.
                await self.follower(spec.name)
        except TimeoutError:
            self._stats_at.pop(spec.name, None)
            return ServerProbe(spec.name, False, reason=f"no answer in {self.probe_timeout_s} s")
        except ComfyError as e:
            self._stats_at.pop(spec.name, None)
            return ServerProbe(spec.name, False, reason=f"{type(e).__name__}: {e}")
        entries = [*queue.running, *queue.pending]
        ours = tuple(
            e.prompt_id for e in entries if (e.client_id or "").startswith(CLIENT_ID_PREFIX)
        )
        probe = ServerProbe(spec.name, True, foreign_queue=len(entries) - len(ours), ours=ours)
        self._probed[spec.name] = (loop.time(), probe)
        return probe

    async def acquire(
        self,
        *,
        prefer: str | None = None,
        models: Sequence[str] = (),
        only: str | None = None,
        allow_prompt: str | None = None,
    ) -> Slot:
        """Hold a free server for one prompt; wait (without spinning) until one is free.

        ``prefer``: the job's previous server (wins ties on queue length).
        ``models``: the job's model names (affinity: a server that last ran one wins ties).
        ``only``: restrict to one server (catch-up of a prompt already queued there), and
        ``allow_prompt``: that prompt_id of ours may be on it.
        """
        slot = await self.acquire_until(
            None, prefer=prefer, models=models, only=only, allow_prompt=allow_prompt
        )
        assert slot is not None, "acquire without a stop event returns a slot"
        return slot

    async def acquire_until(
        self,
        stop: asyncio.Event | None,
        *,
        prefer: str | None = None,
        models: Sequence[str] = (),
        only: str | None = None,
        allow_prompt: str | None = None,
    ) -> Slot | None:
        """``acquire``, or None once ``stop`` is set (and ``wake()`` called): a consumer
        with nothing left to run must not wait for a server for ever."""
        if only is not None:  # catch-up of one prompt: not in line with the others
            return await self._acquire_loop(prefer, models, only, allow_prompt, stop)
        # Consumers line up: only the first looks (FIFO), so a release wakes one
        # consumer, not a stampede of probes and lease reads.
        async with self._line:
            return await self._acquire_loop(prefer, models, only, allow_prompt, stop)

    def _check_reachable(self) -> None:
        """Raise NoServerReachable once no server has answered for unreachable_timeout_s."""
        since, limit = self._none_reachable_since, self.unreachable_timeout_s
        if since is None or limit is None:
            return
        waited = asyncio.get_running_loop().time() - since
        if waited >= limit:
            raise NoServerReachable(waited, self.unreachable())

    def wake(self) -> None:
        """Wake the consumer waiting for a server (to see its stop event)."""
        self._changed.set()

    async def _acquire_loop(
        self,
        prefer: str | None,
        models: Sequence[str],
        only: str | None,
        allow_prompt: str | None,
        stop: asyncio.Event | None,
    ) -> Slot | None:
        while True:
            if stop is not None and stop.is_set():
                for name in list(self._kept):
                    self._let_go(name)
                return None
            self._changed.clear()
            slot, all_unhealthy = await self._try_acquire(prefer, models, only, allow_prompt)
            if slot is not None:
                return slot
            self._check_reachable()
            if not all_unhealthy:
                self._mark_waiting()
            timeout = self.unhealthy_wait_s if all_unhealthy else self.busy_poll_s
            since, limit = self._none_reachable_since, self.unreachable_timeout_s
            if since is not None and limit is not None:  # look again when it runs out
                left = since + limit - asyncio.get_running_loop().time()
                timeout = max(min(timeout, left), 0.0)
            try:
                # A local release wakes us at once; other processes' releases are seen
                # on the next look at the leases.
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _try_acquire(
        self,
        prefer: str | None,
        models: Sequence[str],
        only: str | None,
        allow_prompt: str | None,
    ) -> tuple[Slot | None, bool]:
        for name in list(self._kept):
            if only is not None and name != only:
                continue
            follower = self._followers.get(name)
            spec = self.spec(name)
            if spec is not None and follower is not None and follower.queue_remaining() == 0:
                # Our prompt left it and nothing else is queued there: no queue is
                # shorter, and the lease is already ours.
                return self._take(spec, models, {}), False
            self._let_go(name)
        if only is None and self.max_queue is None:
            rest = [s for s in self.servers if s.name not in self._held]
            if (
                len(rest) == 1
                and self._just_freed(rest[0].name)
                and not self._yielding(rest[0].name)
            ):
                # We hold every other server and ours just left this one: nothing to
                # choose, nothing to read; the lease itself says if another process won.
                slot = self._take(rest[0], models, {})
                if slot is not None:
                    return slot, False
        now = time.time()
        leases = self._ask_leases(self.leases.server_leases, {})
        free = []
        for spec in self.servers:
            if only is not None and spec.name != only:
                continue
            if spec.name in self._held or self._yielding(spec.name):
                continue
            lease = leases.get(spec.name)
            if lease is not None and lease.owner and lease.expires_at > now:
                continue
            free.append(spec)
        if not free:
            return None, False
        if len(free) == 1 and self.max_queue is None and self._just_freed(free[0].name):
            # Our own prompt has just left this server, the only free one: there is no
            # choice to make, and a probe would only keep the GPU waiting.
            return self._take(free[0], models, {}), False
        probes = await asyncio.gather(*(self.probe(s) for s in free))
        self._report(probes)
        candidates = []
        for order, (spec, p) in enumerate(zip(free, probes, strict=True)):
            if not p.healthy:
                continue
            orphans = [pid for pid in p.ours if pid != allow_prompt and pid not in self._finished]
            self._watch_orphans(spec, orphans)
            if orphans:
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
            slot = self._take(spec, models, lengths)
            if slot is not None:
                return slot, False
        return None, False

    def _take(
        self,
        spec: ServerSpec,
        models: Sequence[str],
        lengths: dict[str, int],
        purpose: str = "",
    ) -> Slot | None:
        """Take the server lease of ``spec``; None if someone else has it. ``purpose``:
        why, in the log line, when it is not a prompt (default: the scheduler's choice)."""
        # Another consumer of this process may have taken it while we probed; the store
        # can't tell (same owner), so check here, with no await in between.
        if spec.name in self._held:
            return None
        kept = self._kept.pop(spec.name, None) is not None
        if not kept:
            asked_at = asyncio.get_running_loop().time()
            acquire = self.leases.acquire_server
            if not self._ask_leases(acquire, False, spec.name, self.owner, self.lease_s):
                return None
            self._lease_until[spec.name] = asked_at + self.lease_s
        slot = Slot(spec, self.clients[spec.name], self, tuple(models))
        self._held[spec.name] = slot
        self._probed.pop(spec.name, None)  # its queue is about to change
        if purpose:
            log.info("scheduler: %s taken %s", spec.name, purpose)
            return slot
        log.info(
            "scheduler: %s chosen, queue lengths %s",
            spec.name,
            ", ".join(f"{n} {q}" for n, q in lengths.items())
            or ("kept (our prompt just left it)" if kept else "not probed (just freed)"),
        )
        return slot

    def _watch_orphans(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Note prompts of ours found on a free server; remove them once they have been
        there for ``orphan_grace_s``."""
        loop = asyncio.get_running_loop()
        if not orphans:
            self._orphans_since.pop(spec.name, None)
            return
        since = self._orphans_since.setdefault(spec.name, loop.time())
        if loop.time() - since < self.orphan_grace_s or spec.name in self._sweeps:
            return
        sweep = asyncio.create_task(
            self._remove_orphans(spec, orphans), name=f"orphans {spec.name}"
        )
        self._sweeps[spec.name] = sweep
        sweep.add_done_callback(lambda _: self._sweeps.pop(spec.name, None))

    async def _remove_orphans(self, spec: ServerSpec, orphans: list[str]) -> None:
        """Take the server's lease, interrupt and delete ``orphans`` there, wait until they
        left its /queue (README fact 7: a delete can lose the race), give the lease back."""
        slot = self._take(spec, (), {}, purpose="to remove prompts of ours nobody follows")
        if slot is None:
            return  # someone took the server: they see the orphans too
        slot.posted()  # no prompt of ours goes there meanwhile
        client = self.clients[spec.name]
        deadline = asyncio.get_running_loop().time() + self.orphan_grace_s
        try:
            await client.delete_from_queue(orphans)
            for pid in orphans:
                await client.interrupt(pid)
            while (await client.queue()).find_any(orphans):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"still there after {self.orphan_grace_s:g} s")
                await asyncio.sleep(self.poll_s)
        except (ComfyError, TimeoutError) as e:
            log.warning(
                "server %s: could not remove prompts of ours nobody follows (%s): %s",
                spec.name,
                e,
                ", ".join(orphans),
            )
            slot.abandon()
            return
        self._orphans_since.pop(spec.name, None)
        log.warning(
            "server %s: removed prompts of ours that nobody followed: %s",
            spec.name,
            ", ".join(orphans),
        )
        slot.release()

    def _ask_leases(self, call: Callable[..., T], failed: T, *args: object) -> T:
        """``call(*args)`` on the lease store; while the store fails, ``failed`` (nothing
        is taken on a store that can't record it) and the consumer looks again later.
        Raises the store's error once it has failed for ``store_timeout_s`` on end."""
        try:
            answer = call(*args)
        except Exception as e:  # the store, whatever its driver: see the timeout below
            now = asyncio.get_running_loop().time()
            if self._store_failing_since is None:
                self._store_failing_since = now
                log.warning(
                    "server leases: the store failed (%s: %s); trying again", type(e).__name__, e
                )
            if now - self._store_failing_since >= self.store_timeout_s:
                raise
            return failed
        self._store_failing_since = None
        return answer

    def _others_waiting(self) -> bool:
        """Whether another process waits for a server (asked at most every busy_poll_s)."""
        now = asyncio.get_running_loop().time()
        if now - self._others_asked_at >= self.busy_poll_s:
            self._others_asked_at = now
            self._others = self._ask_leases(self.leases.others_waiting, False, self.owner)
        return self._others

    def _mark_waiting(self) -> None:
        """Tell other processes that we wait for a server (renewed every busy_poll_s)."""
        now = asyncio.get_running_loop().time()
        if now - self._marked_at >= self.busy_poll_s:
            self._marked_at = now
            self._ask_leases(self.leases.mark_waiting, None, self.owner, 4 * self.busy_poll_s)

    def _yielding(self, name: str) -> bool:
        return self._yielded.get(name, 0.0) > asyncio.get_running_loop().time()

    def _just_freed(self, name: str) -> bool:
        freed = self._freed_at.get(name)
        return freed is not None and asyncio.get_running_loop().time() - freed < self.stats_ttl_s

    def _last_model(self, name: str, leases: dict) -> str | None:
        lease = leases.get(name)
        stored = getattr(lease, "last_model", None) if lease is not None else None
        return stored or self.last_model.get(name)

    def _report(self, probes: Sequence[ServerProbe]) -> None:
        """Log a server's state when it changes, not at every probe; an unreachable
        server is named again every ``REPORT_AGAIN_S`` so a long wait is not silent."""
        now = time.monotonic()
        for p in probes:
            state = "healthy" if p.healthy else f"unreachable: {p.reason}"
            changed = self._reported.get(p.name, "healthy") != state
            stale = not p.healthy and now - self._reported_at.get(p.name, now) >= REPORT_AGAIN_S
            if changed or stale:
                level = logging.INFO if p.healthy else logging.WARNING
                log.log(level, "server %s %s", p.name, state)
                self._reported_at[p.name] = now
            self._reported[p.name] = state
        if len(self.unreachable()) < len(self.servers):
            self._none_reachable_since = None
        elif self._none_reachable_since is None:
            self._none_reachable_since = asyncio.get_running_loop().time()

    def unreachable(self) -> dict[str, str]:
        """Servers last seen unreachable, with the reason: for summaries and metadata."""
        return {n: s for n, s in self._reported.items() if s != "healthy"}

    # -- holding ------------------------------------------------------------------------

    def _dispatch_done(self) -> None:
        if self._handovers:
            self._handovers.popleft().set()

    async def handed_over(self, slot: Slot, max_wait_s: float = 0.25) -> None:
        """Wait (at most ``max_wait_s`` seconds) until the server ``slot`` freed has its
        next prompt posted, when a consumer was waiting for it; else return at once."""
        if slot.handover is None or slot.handover.is_set():
            return
        try:
            async with asyncio.timeout(max_wait_s):
                await slot.handover.wait()
        except TimeoutError:
            pass

    def _release(self, slot: Slot) -> None:
        if slot.lost is not None:
            # The lease is not ours to give (taken, or the store can't be written): it
            # expires by itself, and the server can be offered again.
            if self._held.get(slot.name) is slot:
                del self._held[slot.name]
            self._changed.set()
            return
        self._held.pop(slot.name, None)
        loop = asyncio.get_running_loop()
        if self._line.locked() and self._others_waiting():
            # Another process waits for a server too: leave this one to it for a moment
            # rather than hand it to our own next job (runs that share servers all move).
            self._yielded[slot.name] = loop.time() + 3 * self.busy_poll_s
        elif slot.prompt_id is not None and self._line.locked():
            slot.handover = asyncio.Event()  # a consumer is in line: it takes this server
            self._handovers.append(slot.handover)
            kept_at = self._kept[slot.name] = loop.time()
            # Nobody came for it after all (the batch ended, say): give it back.
            loop.call_later(3 * self.busy_poll_s, self._let_go, slot.name, kept_at)
        if slot.prompt_id is not None:
            self._freed_at[slot.name] = asyncio.get_running_loop().time()
            self._finished[slot.prompt_id] = None
            while len(self._finished) > 4096:
                self._finished.popitem(last=False)
        model = slot.models[0] if slot.models else None
        if model is not None:
            self.last_model[slot.name] = model
        if slot.name not in self._kept:
            self._release_lease(slot.name, model)
        self._changed.set()

    def _release_lease(self, name: str, model: str | None) -> None:
        """Give the lease back in the store. If the store fails, the lease is left to
        expire (nobody else uses the server meanwhile), and the log says so."""
        self._lease_until.pop(name, None)
        try:
            self.leases.release_server(name, self.owner, last_model=model)
        except Exception as e:  # the store, whatever its driver: the lease expires by itself
            log.warning(
                "server %s: server lease not released (%s: %s); it expires within %.0f s",
                name,
                type(e).__name__,
                e,
                self.lease_s,
            )

    def _let_go(self, name: str, kept_at: float | None = None) -> None:
        """Release the lease of a kept server (only if kept since ``kept_at``, if given)."""
        if name not in self._kept or (kept_at is not None and self._kept[name] != kept_at):
            return
        del self._kept[name]
        self._release_lease(name, self.last_model.get(name))
        self._changed.set()

    def _abandon(self, slot: Slot) -> None:
        if self._held.get(slot.name) is slot:
            del self._held[slot.name]
        self._lease_until.pop(slot.name, None)
        # Not "just freed": the next prompt may go there only once a probe shows ours gone.
        self._freed_at.pop(slot.name, None)
        log.warning(
            "server %s: our prompt may still be there; its lease will expire in %.0f s",
            slot.name,
            self.lease_s,
        )

    async def _renew_forever(self) -> None:
        """Renew every lease we hold or keep each third of ``lease_s``; while the store
        fails, try again every thirtieth, and give a lease up as lost once only a third
        of it is left (``_lose``)."""
        failing = False
        while True:
            await asyncio.sleep(self.lease_s / (30 if failing else 3))
            failing = False
            held = [n for n, slot in self._held.items() if slot.lost is None]
            for name in [*held, *self._kept]:
                failing = not self._renew(name) or failing

    def _renew(self, name: str) -> bool:
        """Renew one lease; False when the store failed and the lease is still ours."""
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        try:
            renewed = self.leases.renew_server(name, self.owner, self.lease_s)
        except Exception as e:  # the store, whatever its driver: judged by the time left
            left = self._lease_until.get(name, asked_at) - asked_at
            why = f"{type(e).__name__}: {e}"
            if left > self.lease_s / 3:
                log.warning(
                    "server %s: server lease not renewed (%s); %.0f s left, trying again",
                    name,
                    why,
                    left,
                )
                return False
            self._lose(name, f"server lease not renewed ({why}) and {left:.0f} s left")
            return True
        if renewed:
            self._lease_until[name] = asked_at + self.lease_s
        else:
            self._lose(name, "server lease taken by another process")
        return True

    def _lose(self, name: str, why: str) -> None:
        """Stop using server ``name``: the lease is no longer ours for sure."""
        self._lease_until.pop(name, None)
        kept = self._kept.pop(name, None) is not None
        slot = self._held.get(name)
        if slot is None or slot.lost is not None:
            if kept:
                log.error("server %s: %s; not posting there", name, why)
            return
        slot.lost = f"{name}: {why}"
        log.error("server %s: %s; not posting there, our prompt there is removed", name, why)
        for listener in list(self.lost_listeners):
            listener(slot)
