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

What a server can run and which models it holds (``holdings.py``, ``plan.py``): a job
goes only to a server whose /object_info lists its node classes and model files, and a
consumer's ``choose`` (the batch's plan) says which free servers should take a job now
and of which group: the pool offers only those, its own group first.

No Dagster here: the batch runner, the CLI and the RabbitMQ worker all use this.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from comfy_assets.comfy.capabilities import Needs
from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import NoServerCanRun
from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.comfy.holding import Holding
from comfy_assets.comfy.holdings import Holdings
from comfy_assets.comfy.lease_keeping import LeaseKeeping
from comfy_assets.comfy.orphans import Orphans
from comfy_assets.comfy.priority import Priorities
from comfy_assets.comfy.probing import Probing
from comfy_assets.comfy.quarantine import Quarantine
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.comfy.settings import PoolSettings
from comfy_assets.comfy.slot import (
    ServerLeaseStore,
    ServerProbe,
    Slot,
    new_client_id,
)
from comfy_assets.comfy.uploads import Uploads

log = logging.getLogger("comfy_assets.pool")

# A consumer's say on a free server (name, seconds it has waited in line): None, take
# nothing there now; else a rank, lower first (0: its own job's group).
Chooser = Callable[[str, float], int | None]


# Seconds a mark that this pool waits for a server stands (``Pool._mark_waiting``): long
# enough to be written rarely, short enough that a mark left by a pool that got its
# server makes others leave a freed server idle (``3 x busy_poll_s``) only briefly.
WAITING_MARK_S = 1.0


class Pool(Probing, LeaseKeeping, Orphans, Holdings, Holding, Quarantine, Priorities):
    """Named ComfyUI servers shared through server leases.

    A lease that can't be renewed (the store fails until only a third of it is left) or
    that another process took is **lost**: the pool stops renewing it, marks the slot
    (``Slot.lost``) and calls each of ``lost_listeners`` with the slot, so its holder stops
    posting there and removes its prompt while the lease still keeps other processes
    away. A lost slot is not offered again until it is released; its release writes
    nothing to the store.

    A lease store that fails (a database failover) takes nothing meanwhile: consumers
    look again; after ``store_timeout_s`` seconds of failures its error is raised.

    ``settings.unreachable_timeout_s``: once every server has failed its last probe for
    this long, ``acquire`` raises NoServerReachable (None: it waits for ever).

    A prompt of ours that nobody follows any more (its holder died, or gave up on it
    while the server answered nothing sensible) keeps its server from us. Once a probe has
    found such an **orphan** on a free server for ``orphan_grace_s`` (a retry's catch-up
    may still adopt it meanwhile), the pool takes the lease and removes it (interrupt,
    delete, wait until it left /queue), and says so.

    ``servers``: configuration order matters (last tie-break). ``leases``: the store.
    ``owner``: this process's lease owner id. ``settings``: server lease time (renewed
    every third of it while held), probe timeout, queue limit (a server whose foreign
    queue is at or above it is not a candidate), wait before re-probing when no server is
    healthy, the followers' /history poll period (``PoolSettings``' defaults when None).
    ``busy_poll_s``: how often to look again when every server is held by another process.
    ``stats_ttl_s``: how long a healthy ``/system_stats`` answer stands (``/queue`` is
    asked at every probe). ``probe_ttl_s``: how long a probe's /queue answer stands
    for a server nobody took since. ``planned``: batches over this pool follow the plan
    (``plan.py``); False: jobs in the order they came, models only breaking ties (the
    behaviour before the plan, for comparison: ``bench/models.py``).
    """

    def __init__(
        self,
        servers: Sequence[ServerSpec],
        leases: ServerLeaseStore,
        *,
        owner: str,
        settings: PoolSettings | None = None,
        busy_poll_s: float = 0.05,
        stats_ttl_s: float = 2.0,
        probe_ttl_s: float = 0.1,
        orphan_grace_s: float | None = None,
        store_timeout_s: float = 30.0,
        planned: bool = True,
    ) -> None:
        if not servers:
            raise ValueError("a pool needs at least one server")
        self.lost_listeners: list[Callable[[Slot], None]] = []
        self.uploads = Uploads()  # input files on each server, uploaded once per server
        self.planned = planned
        self.store_timeout_s = store_timeout_s
        self._store_failing_since: dict[str, float] = {}  # loop time, by store call
        self.settings = PoolSettings() if settings is None else settings
        self._none_reachable_since: float | None = None  # loop time
        self.orphan_grace_s = (
            2 * self.settings.server_lease_s if orphan_grace_s is None else orphan_grace_s
        )
        self._orphans_since: dict[str, float] = {}  # loop time orphans were first seen
        self._sweeps: dict[str, asyncio.Task[None]] = {}  # orphan removals under way
        self.servers = list(servers)
        self.leases = leases
        self.owner = owner
        self.busy_poll_s = busy_poll_s
        self.stats_ttl_s = stats_ttl_s
        self.probe_ttl_s = probe_ttl_s
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
        self._away_since: dict[str, float] = {}  # monotonic time each went unreachable
        self._answered: set[str] = set()  # servers that answered a probe since the start
        self._init_holdings()
        self._init_quarantine()
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
        # Per server: (when asked, whether another process waits for it).
        self._others: dict[str, tuple[float, bool]] = {}
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
            follower = PromptFollower(
                self.clients[name], new_client_id(), poll_s=self.settings.poll_s
            )
            await follower.__aenter__()
            self._followers[name] = follower
            return follower

    def spec(self, name: str) -> ServerSpec | None:
        return next((s for s in self.servers if s.name == name), None)

    # -- choosing -----------------------------------------------------------------------

    async def acquire(
        self,
        *,
        prefer: str | None = None,
        models: Sequence[str] = (),
        only: str | None = None,
        allow_prompt: str | None = None,
    ) -> Slot:
        """Hold a free server for one job's prompt; wait (without spinning) until one is free.

        ``prefer``: the job's previous server (wins ties on queue length).
        ``models``: the job's model names (affinity: a server holding them wins ties).
        ``only``: restrict to one server (catch-up of a prompt already queued there), and
        ``allow_prompt``: that prompt_id of ours may be on it.
        """
        slot = await self._acquire(None, _Want(prefer, tuple(models), only, allow_prompt))
        assert slot is not None, "acquire without a stop event or gone returns a slot"
        return slot

    async def acquire_until(
        self,
        stop: asyncio.Event | None,
        *,
        needs: Needs | None = None,
        choose: Chooser | None = None,
        check: Callable[[], str | None] | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> Slot | None:
        """Hold a free server for a consumer of a batch, or None once ``stop`` is set (and
        ``wake()`` called): a consumer with nothing left to run must not wait for a server
        for ever.

        ``needs``: only a server that can run the job (its /object_info read first);
        raises NoServerCanRun once none of the pool can (``cannot_run``).
        ``choose``: the consumer's say on each free server (``Chooser``), ranked after
        queue length. ``check``: asked at each look; a reason it returns is raised as
        NoServerCanRun (a job waiting for no server that can run it). ``gone``: asked at
        each look; True ends the wait with None (the consumer has nothing left to run, so
        it leaves the line to those that have).
        """
        want = _Want(needs=needs, choose=choose, check=check, gone=gone)
        return await self._acquire(stop, want)

    async def _acquire(self, stop: asyncio.Event | None, want: _Want) -> Slot | None:
        """What ``acquire`` and ``acquire_until`` wait for: ``want`` (None once ``stop``
        is set or ``want.gone()``)."""
        if want.only is not None:  # catch-up of one prompt: not in line with the others
            return await self._acquire_loop(want, stop)
        # Consumers line up: only the first looks (FIFO), so a release wakes one
        # consumer, not a stampede of probes and lease reads.
        async with self._line:
            return await self._acquire_loop(want, stop)

    def wake(self) -> None:
        """Wake the consumer waiting for a server (to see its stop event)."""
        self._changed.set()

    async def _acquire_loop(self, want: _Want, stop: asyncio.Event | None) -> Slot | None:
        waited = False  # a whole busy_poll_s, with no release of ours to wake us
        while True:
            if (stop is not None and stop.is_set()) or (want.gone is not None and want.gone()):
                for name in list(self._kept):
                    self._let_go(name)
                return None
            self._changed.clear()
            reason = self.cannot_run_now(want.needs) if want.needs is not None else None
            if reason is None and want.check is not None:
                reason = want.check()
            if reason is not None:
                raise NoServerCanRun(reason)
            slot, all_unhealthy = await self._try_acquire(want)
            if slot is not None:
                return slot
            self._check_reachable()
            self._check_usable()
            if (waited or self.priority) and not all_unhealthy:
                # Other processes are told only of a real wait: a consumer that our own
                # prompt's end hands a server to within moments costs the store nothing
                # (a batch of a priority says so at once: it is to go first).
                self._mark_waiting()
            timeout = self.settings.unhealthy_wait_s if all_unhealthy else self.busy_poll_s
            since, limit = self._none_reachable_since, self.settings.unreachable_timeout_s
            if since is not None and limit is not None:  # look again when it runs out
                left = since + limit - asyncio.get_running_loop().time()
                timeout = max(min(timeout, left), 0.0)
            try:
                # A local release wakes us at once; other processes' releases are seen
                # on the next look at the leases.
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                waited = True

    async def _try_acquire(self, want: _Want) -> tuple[Slot | None, bool]:
        only, models = want.only, want.models
        if only is None:
            # A catch-up follows our own prompt wherever it is; new prompts go only
            # where the servers' health lets them (``quarantine.py``).
            self._read_health()
            if self._all_blocked():
                return None, True
        for name in list(self._kept):
            if only is not None and name != only:
                continue
            follower = self._followers.get(name)
            spec = self.spec(name)
            if (
                spec is not None
                and (only is not None or self.blocked(name) is None)
                and follower is not None
                and follower.queue_remaining() == 0
                and self._wanted(spec.name, want) is not None
            ):
                # Our prompt left it and nothing else is queued there: no queue is
                # shorter, and the lease is already ours.
                return self._take(spec, models, {}), False
            self._let_go(name)
        if only is None and self.settings.max_queue is None:
            rest = [s for s in self.servers if s.name not in self._held]
            if (
                len(rest) == 1
                and self._just_freed(rest[0].name)
                and self.blocked(rest[0].name) is None
                and not self._yielding(rest[0].name)
                and self._wanted(rest[0].name, want) is not None
            ):
                # We hold every other server and ours just left this one: nothing to
                # choose, nothing to read; the lease itself says if another process won.
                slot = self._take(rest[0], models, {})
                if slot is not None:
                    return slot, False
        if all(s.name in self._held for s in self.servers if only is None or s.name == only):
            # Every server we may take runs a prompt of ours: none can be free, and the
            # store need not be asked (our next consumer waits for one of them).
            return None, False
        # Lease times are the store's clock, not this host's (hosts' clocks differ).
        now = self.leases.now()
        leases = self._ask_leases(self.leases.server_leases, {})
        self._held_from(leases)
        free = []
        for spec in self.servers:
            if only is not None and spec.name != only:
                continue
            if spec.name in self._held or self._yielding(spec.name):
                continue
            if only is None and self.blocked(spec.name) is not None:
                continue
            lease = leases.get(spec.name)
            if lease is not None and lease.owner and lease.expires_at > now:
                if not lease.holder_gone:  # its owner is gone: free to take
                    continue
            if self._outranked(spec.name):  # a batch of a higher priority waits for it
                continue
            free.append(spec)
        if not free:
            return None, False
        if (
            len(free) == 1
            and self.settings.max_queue is None
            and self._just_freed(free[0].name)
            and self._wanted(free[0].name, want) is not None
        ):
            # Our own prompt has just left this server, the only free one: there is no
            # choice to make, and a probe would only keep the GPU waiting.
            return self._take(free[0], models, {}), False
        probes = await asyncio.gather(*(self.probe(s) for s in free))
        self._report(probes)
        if want.needs is not None or want.choose is not None:
            await self.read_capabilities(
                [s for s, p in zip(free, probes, strict=True) if p.healthy]
            )
        candidates = []
        declined = False
        for order, (spec, p) in enumerate(zip(free, probes, strict=True)):
            if not p.healthy:
                continue
            orphans = [
                pid for pid in p.ours if pid != want.allow_prompt and pid not in self._finished
            ]
            self._watch_orphans(spec, orphans)
            if orphans:
                continue  # a prompt of ours is still there (a dead holder's): not free
            if self.settings.max_queue is not None and p.foreign_queue >= self.settings.max_queue:
                continue
            rank = self._wanted(spec.name, want)
            if rank is None:
                declined = True
                continue  # it can't run the job, or the plan keeps it for later
            key = (p.foreign_queue, 0 if spec.name == want.prefer else 1, rank, order)
            candidates.append((key, spec, p))
        # How long free servers have been declined: the plan's estimates give way after
        # a load's time (``plan.py``, rule 1).
        if not declined:
            want.declined_since = None
        elif want.declined_since is None:
            want.declined_since = asyncio.get_running_loop().time()
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
            if not self._ask_leases(
                acquire, False, spec.name, self.owner, self.settings.server_lease_s
            ):
                return None
            self._lease_until[spec.name] = asked_at + self.settings.server_lease_s
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

    def _others_waiting(self, name: str) -> bool:
        """Whether another process waits for server ``name`` (asked at most every
        busy_poll_s per server): one that could not take it is no reason to leave it."""
        now = asyncio.get_running_loop().time()
        asked_at, waiting = self._others.get(name, (-1e9, False))
        if now - asked_at >= self.busy_poll_s:
            waiting = self._ask_leases(
                self.leases.others_waiting, False, self.owner, name, None, self.priority
            )
            self._others[name] = (now, waiting)
        return waiting

    def _mark_waiting(self) -> None:
        """Tell other processes that we wait for one of our servers: a mark good for
        ``WAITING_MARK_S``, renewed at half its life. A consumer in line for a busy
        server waits most of the time, so a mark per poll would be a write every
        busy_poll_s for as long as the pool works."""
        now = asyncio.get_running_loop().time()
        if now - self._marked_at >= WAITING_MARK_S / 2:
            self._marked_at = now
            names = [s.name for s in self.servers]
            mark, priority = self.leases.mark_waiting, self.priority
            self._ask_leases(mark, None, self.owner, WAITING_MARK_S, names, None, priority)

    def _yielding(self, name: str) -> bool:
        return self._yielded.get(name, 0.0) > asyncio.get_running_loop().time()

    def _just_freed(self, name: str) -> bool:
        freed = self._freed_at.get(name)
        return freed is not None and asyncio.get_running_loop().time() - freed < self.stats_ttl_s

    def _wanted(self, name: str, want: _Want) -> int | None:
        """How much ``want`` wants free server ``name`` (lower first), or None: it can't
        run the job (``want.needs``), or the consumer's ``choose`` keeps it for later.
        Without ``choose``: 0 when it holds every model of the job, else 1."""
        if want.needs is not None and not self.can_run(name, want.needs):
            if want.choose is None:
                return None
        if want.choose is not None:
            since = want.declined_since
            waited = 0.0 if since is None else asyncio.get_running_loop().time() - since
            return want.choose(name, waited)
        return 0 if frozenset(want.models) <= self.plan.holds(name) else 1


@dataclass
class _Want:
    """What a consumer in line wants of a server (``Pool.acquire``'s or ``Pool.acquire_until``'s arguments), and
    since when free servers have been declined for it."""

    prefer: str | None = None
    models: tuple[str, ...] = ()
    only: str | None = None
    allow_prompt: str | None = None
    needs: Needs | None = None
    choose: Chooser | None = None
    check: Callable[[], str | None] | None = None
    gone: Callable[[], bool] | None = None
    declined_since: float | None = None  # loop time a free server was first declined
