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

What a server can run and which models it holds (``models_held.py``, ``plan.py``): a job
goes only to a server whose /object_info lists its node classes and model files, and a
consumer's ``choose`` (the batch's plan) says which free servers should take a job now
and of which group: the pool offers only those, its own group first.

No Dagster here: the batch runner, the CLI and the RabbitMQ worker all use this.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from comfy_assets.comfy.capabilities import Missing, Needs
from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import NoServerCanRun
from comfy_assets.comfy.follow import PromptFollower
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.comfy.uploads import Uploads
from comfy_assets.pool.handover import Handover
from comfy_assets.pool.lease_keeping import LeaseKeeper
from comfy_assets.pool.models_held import ModelsHeld
from comfy_assets.pool.orphans import Orphans
from comfy_assets.pool.plan import Plan
from comfy_assets.pool.priority import Priorities
from comfy_assets.pool.probing import Prober
from comfy_assets.pool.quarantine import HealthRecord, Quarantine
from comfy_assets.pool.server_state import ServerState, ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import ServerLeaseStore, ServerLeaseView, ServerProbe, Slot
from comfy_assets.pool.sockets import Sockets
from comfy_assets.pool.want import Chooser, Want

log = logging.getLogger("comfy_assets.pool")


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
    behaviour before the plan, for comparison: ``bench/models.py``). The parts, each in
    its own module, hold one ``ServerState`` per server between them.
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
        self.uploads = Uploads()  # input files on each server, uploaded once per server
        self.planned = planned
        self.settings = settings = PoolSettings() if settings is None else settings
        self.servers = list(servers)
        self.leases = leases
        self.owner = owner
        self.busy_poll_s = busy_poll_s
        self.stats_ttl_s = stats_ttl_s
        self.states = states = ServerStates(
            [
                ServerState(s, ComfyClient(s.url, credentials=s.credentials, name=s.name))
                for s in self.servers
            ]
        )
        self._line = asyncio.Lock()  # consumers in line: only the first looks
        self._changed = asyncio.Event()  # a server may have become free
        self._renewer: asyncio.Task[None] | None = None
        self.keeper = LeaseKeeper(states, leases, owner, settings, store_timeout_s)
        self.sockets = Sockets(states, settings.poll_s)
        self.models = ModelsHeld(states, self.sockets, self.keeper, settings)
        self.prober = Prober(states, self.sockets, self.models, settings, stats_ttl_s, probe_ttl_s)
        self.quarantine = Quarantine(states, self.keeper, settings)
        self.priorities = Priorities(states, self.keeper, busy_poll_s)
        self.handover = Handover(
            states,
            self.keeper,
            self.models,
            self.priorities,
            self._line,
            self._changed,
            busy_poll_s,
        )
        grace = 2 * settings.server_lease_s if orphan_grace_s is None else orphan_grace_s
        self.orphans = Orphans(states, settings, grace, self._take)

    async def __aenter__(self) -> Pool:
        for state in self.states.all:
            await state.client.__aenter__()
        self._renewer = asyncio.create_task(self.keeper.renew_forever(), name="pool-lease-renewer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._renewer:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self.orphans.close()
        for state in self.states.held():
            if state.held is not None:
                state.held.release()
        self.handover.let_all_go()
        await self.sockets.close()
        for state in self.states.all:
            await state.client.__aexit__(None, None, None)

    # -- the parts' faces: what render/, service/, cli/ and api/ call ---------------------

    @property
    def clients(self) -> dict[str, ComfyClient]:
        """Each server's shared client by name."""
        return {s.name: s.client for s in self.states.all}

    def client(self, name: str) -> ComfyClient:
        """The shared client of server ``name`` (for catch-up and downloads)."""
        return self.states[name].client

    async def follower(self, name: str) -> PromptFollower:
        """The open socket of server ``name`` (``Sockets.follower``)."""
        return await self.sockets.follower(name)

    def open_follower(self, name: str) -> PromptFollower | None:
        """The socket of server ``name`` if one is open now (for reading progress)."""
        return self.sockets.open_follower(name)

    def spec(self, name: str) -> ServerSpec | None:
        """The configuration of server ``name``, None if the pool has no such server."""
        state = self.states.get(name)
        return None if state is None else state.spec

    @property
    def lost_listeners(self) -> list[Callable[[Slot], None]]:
        """Called with each slot whose lease is lost (``LeaseKeeper.lose``)."""
        return self.keeper.lost_listeners

    @property
    def prompt_listeners(self) -> list[Callable[[Slot, float], None]]:
        """Called with each prompt of ours that left its server and its seconds."""
        return self.models.prompt_listeners

    @property
    def plan(self) -> Plan:
        """Which waiting job a free server takes (``plan.py``)."""
        return self.models.plan

    @property
    def health(self) -> Mapping[str, HealthRecord]:
        """Each server's health as last read from the store."""
        return self.quarantine.health

    @property
    def priority(self) -> int:
        """The priority of the batch this pool serves (higher first)."""
        return self.priorities.priority

    @priority.setter
    def priority(self, value: int) -> None:
        self.priorities.priority = value

    def prioritized(self, priority: int) -> AbstractContextManager[None]:
        """``Priorities.prioritized``."""
        return self.priorities.prioritized(priority)

    async def probe(self, spec: ServerSpec) -> ServerProbe:
        """``Prober.probe``."""
        return await self.prober.probe(spec)

    def unreachable(self) -> dict[str, str]:
        """``Prober.unreachable``."""
        return self.prober.unreachable()

    def lacks(self, name: str, needs: Needs) -> Missing | None:
        """``ModelsHeld.lacks``."""
        return self.models.lacks(name, needs)

    def may_run(self, name: str, needs: Needs) -> bool:
        """``ModelsHeld.may_run``."""
        return self.models.may_run(name, needs)

    def can_run(self, name: str, needs: Needs) -> bool:
        """``ModelsHeld.can_run``."""
        return self.models.can_run(name, needs)

    async def read_capabilities(self, specs: Sequence[ServerSpec], force: bool = False) -> None:
        """``ModelsHeld.read_capabilities``."""
        await self.models.read_capabilities(specs, force)

    async def cannot_run(self, needs: Needs) -> str | None:
        """``ModelsHeld.cannot_run``."""
        return await self.models.cannot_run(needs)

    def cannot_run_now(self, needs: Needs) -> str | None:
        """``ModelsHeld.cannot_run_now``."""
        return self.models.cannot_run_now(needs)

    def assign(self, slot: Slot, needs: Needs) -> bool:
        """``ModelsHeld.assign``."""
        return self.models.assign(slot, needs)

    def held_text(self, name: str) -> str | None:
        """``ModelsHeld.held_text``."""
        return self.models.held_text(name)

    def health_changed(self) -> None:
        """``Quarantine.health_changed``."""
        self.quarantine.health_changed()

    def blocked(self, name: str) -> str | None:
        """``Quarantine.blocked``."""
        return self.quarantine.blocked(name)

    def on_probation(self, name: str) -> bool:
        """``Quarantine.on_probation``."""
        return self.quarantine.on_probation(name)

    def all_blocked(self) -> dict[str, str]:
        """``Quarantine.all_blocked``."""
        return self.quarantine.all_blocked()

    async def read_health(self) -> None:
        """``Quarantine.read_health``."""
        await self.quarantine.read_health()

    async def until_usable(
        self, say: Callable[[str], None], back: Callable[[], None] = lambda: None
    ) -> None:
        """``Quarantine.until_usable``."""
        await self.quarantine.until_usable(say, back)

    async def handed_over(self, slot: Slot, max_wait_s: float = 0.25) -> None:
        """``Handover.handed_over``."""
        await self.handover.handed_over(slot, max_wait_s)

    def dispatch_done(self) -> None:
        """``Handover.dispatch_done`` (``Slot`` calls it)."""
        self.handover.dispatch_done()

    def slot_released(self, slot: Slot) -> None:
        """``Handover.slot_released`` (``Slot.release`` calls it)."""
        self.handover.slot_released(slot)

    def slot_abandoned(self, slot: Slot) -> None:
        """``Handover.slot_abandoned`` (``Slot.abandon`` calls it)."""
        self.handover.slot_abandoned(slot)

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
        slot = await self._acquire(None, Want(prefer, tuple(models), only, allow_prompt))
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
        want = Want(needs=needs, choose=choose, check=check, gone=gone)
        return await self._acquire(stop, want)

    async def _acquire(self, stop: asyncio.Event | None, want: Want) -> Slot | None:
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

    async def _acquire_loop(self, want: Want, stop: asyncio.Event | None) -> Slot | None:
        waited = False  # a whole busy_poll_s, with no release of ours to wake us
        while True:
            if (stop is not None and stop.is_set()) or (want.gone is not None and want.gone()):
                self.handover.let_all_go()
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
            self.prober.check_reachable()
            self.quarantine.check_usable()
            if (waited or self.priority) and not all_unhealthy:
                # Other processes are told only of a real wait: a consumer that our own
                # prompt's end hands a server to within moments costs the store nothing
                # (a batch of a priority says so at once: it is to go first).
                self.priorities.mark_waiting()
            try:
                # A local release wakes us at once; other processes' releases are seen
                # on the next look at the leases.
                async with asyncio.timeout(self._wait_s(all_unhealthy)):
                    await self._changed.wait()
            except TimeoutError:
                waited = True

    def _wait_s(self, all_unhealthy: bool) -> float:
        """Seconds before the next look: a server that did not answer is probed again
        after ``unhealthy_wait_s``; none reachable, the next look is when the patience
        runs out."""
        timeout = self.settings.unhealthy_wait_s if all_unhealthy else self.busy_poll_s
        since, limit = self.prober.none_reachable_since, self.settings.unreachable_timeout_s
        if since is not None and limit is not None:
            left = since + limit - asyncio.get_running_loop().time()
            timeout = max(min(timeout, left), 0.0)
        return timeout

    async def _try_acquire(self, want: Want) -> tuple[Slot | None, bool]:
        """One look for a server ``want`` may take: the slot (None: none now), and
        whether every server probed was unhealthy (the next look waits longer)."""
        if want.only is None:
            # A catch-up follows our own prompt wherever it is; new prompts go only
            # where the servers' health lets them (``quarantine.py``).
            self.quarantine.read_health_soon()
            if self.quarantine.note_all_blocked():
                return None, True
        slot = self._take_kept(want) or self._take_last_left(want)
        if slot is not None:
            return slot, False
        mine = [s for s in self.states.all if want.only is None or s.name == want.only]
        if all(s.held is not None for s in mine):
            # Every server we may take runs a prompt of ours: none can be free, and the
            # store need not be asked (our next consumer waits for one of them).
            return None, False
        free = self._free(want, mine)
        if not free:
            return None, False
        if (
            len(free) == 1
            and self.settings.max_queue is None
            and self._just_freed(free[0])
            and self._wanted(free[0].name, want) is not None
        ):
            # Our own prompt has just left this server, the only free one: there is no
            # choice to make, and a probe would only keep the GPU waiting.
            return self._take(free[0].spec, want.models, {}), False
        return await self._take_probed(want, free)

    def _take_kept(self, want: Want) -> Slot | None:
        """A server whose lease we kept, when our prompt left it and nothing else is
        queued there: no queue is shorter, and the lease is already ours. The others
        kept are given back."""
        for state in self.states.kept():
            if want.only is not None and state.name != want.only:
                continue
            follower = state.follower
            if (
                (want.only is not None or self.blocked(state.name) is None)
                and follower is not None
                and follower.queue_remaining() == 0
                and self._wanted(state.name, want) is not None
            ):
                return self._take(state.spec, want.models, {})
            self.handover.let_go(state)
        return None

    def _take_last_left(self, want: Want) -> Slot | None:
        """When we hold every other server and ours just left this one: nothing to
        choose, nothing to read; the lease itself says if another process won."""
        if want.only is not None or self.settings.max_queue is not None:
            return None
        rest = [s for s in self.states.all if s.held is None]
        if len(rest) != 1:
            return None
        last = rest[0]
        if (
            self._just_freed(last)
            and self.blocked(last.name) is None
            and not self._yielding(last)
            and self._wanted(last.name, want) is not None
        ):
            return self._take(last.spec, want.models, {})
        return None

    def _free(self, want: Want, mine: list[ServerState]) -> list[ServerState]:
        """The servers among ``mine`` whose lease nobody holds (or its holder is gone),
        that no process of a higher priority waits for and that may take a prompt."""
        # Lease times are the store's clock, not this host's (hosts' clocks differ).
        now = self.leases.now()
        nothing: Mapping[str, ServerLeaseView] = {}
        leases = self.keeper.ask(self.leases.server_leases, nothing)
        self.models.held_from(leases)
        free = []
        for state in mine:
            if state.held is not None or self._yielding(state):
                continue
            if want.only is None and self.blocked(state.name) is not None:
                continue
            lease = leases.get(state.name)
            expires_at = None if lease is None else lease.expires_at
            if lease is not None and lease.owner and expires_at is not None and expires_at > now:
                if not lease.holder_gone:  # its owner is gone: free to take
                    continue
            if self.priorities.outranked(state):  # a batch of a higher priority waits for it
                continue
            free.append(state)
        return free

    async def _take_probed(self, want: Want, free: list[ServerState]) -> tuple[Slot | None, bool]:
        """Probe the ``free`` servers and take the best of those ``want`` may take:
        shortest foreign queue, then its previous server, then its rank, then the
        configuration order."""
        specs = [s.spec for s in free]
        probes = await asyncio.gather(*(self.prober.probe(s) for s in specs))
        self.prober.report(probes)
        if want.needs is not None or want.choose is not None:
            await self.read_capabilities(
                [s for s, p in zip(specs, probes, strict=True) if p.healthy]
            )
        candidates = self._candidates(want, specs, probes)
        if not candidates:
            return None, all(not p.healthy for p in probes)
        candidates.sort(key=lambda c: c[0])
        lengths = {p.name: p.foreign_queue for p in probes if p.healthy}
        for _, spec in candidates:
            slot = self._take(spec, want.models, lengths)
            if slot is not None:
                return slot, False
        return None, False

    def _candidates(
        self, want: Want, specs: list[ServerSpec], probes: Sequence[ServerProbe]
    ) -> list[tuple[tuple[int, int, int, int], ServerSpec]]:
        """The probed servers ``want`` may take, each with its sort key; notes how long
        free servers have been declined (the plan's estimates give way after a load's
        time: ``plan.py``, rule 1)."""
        candidates = []
        declined = False
        for order, (spec, p) in enumerate(zip(specs, probes, strict=True)):
            if not p.healthy:
                continue
            finished = self.handover.finished
            orphans = [pid for pid in p.ours if pid != want.allow_prompt and pid not in finished]
            self.orphans.watch(spec, orphans)
            if orphans:
                continue  # a prompt of ours is still there (a dead holder's): not free
            if self.settings.max_queue is not None and p.foreign_queue >= self.settings.max_queue:
                continue
            rank = self._wanted(spec.name, want)
            if rank is None:
                declined = True
                continue  # it can't run the job, or the plan keeps it for later
            key = (p.foreign_queue, 0 if spec.name == want.prefer else 1, rank, order)
            candidates.append((key, spec))
        if not declined:
            want.declined_since = None
        elif want.declined_since is None:
            want.declined_since = asyncio.get_running_loop().time()
        return candidates

    def _take(
        self,
        spec: ServerSpec,
        models: Sequence[str],
        lengths: dict[str, int],
        purpose: str = "",
    ) -> Slot | None:
        """Take the server lease of ``spec``; None if someone else has it. ``purpose``:
        why, in the log line, when it is not a prompt (default: the scheduler's choice)."""
        state = self.states[spec.name]
        # Another consumer of this process may have taken it while we probed; the store
        # can't tell (same owner), so check here, with no await in between.
        if state.held is not None:
            return None
        kept = state.kept_at is not None
        state.kept_at = None
        if not kept and not self.keeper.take(state):
            return None
        slot = Slot(spec, state.client, self, tuple(models))
        state.held = slot
        state.probed = None  # its queue is about to change
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

    def _yielding(self, state: ServerState) -> bool:
        return state.yielded_until > asyncio.get_running_loop().time()

    def _just_freed(self, state: ServerState) -> bool:
        freed = state.freed_at
        return freed is not None and asyncio.get_running_loop().time() - freed < self.stats_ttl_s

    def _wanted(self, name: str, want: Want) -> int | None:
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
