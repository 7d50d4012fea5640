"""What the pool knows of each server beyond its queue: what it can run (its
``/object_info``, read once per pool and again after the server started anew) and which
models it holds (the plan, ``plan.py``, shared with other processes through the store).

A server is read again when it comes back from being unreachable, when its socket had
to reconnect (a restarted ComfyUI drops every socket) and before a job is called
unrunnable (files may have been copied since): a server restarted with another model
file is used for it without restarting the run. Such a server holds nothing any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from comfy_assets.comfy.capabilities import Missing, Needs, no_server_reason
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.pool.lease_keeping import LeaseKeeper
from comfy_assets.pool.plan import Plan, held_text, models_of, parse_held
from comfy_assets.pool.server_state import ServerState, ServerStates
from comfy_assets.pool.settings import PoolSettings
from comfy_assets.pool.slot import ServerLeaseView, Slot

if TYPE_CHECKING:  # annotations only: ``render/config.py`` reads a constant of probing.py
    from comfy_assets.pool.sockets import Sockets

log = logging.getLogger("comfy_assets.pool")

READ_AGAIN_S = 2.0  # seconds before a job like one found unrunnable reads all again


@dataclass(eq=False)
class ModelsHeld:
    """Capabilities and held models of the pool's servers (a part of ``Pool``): ``plan``
    (``plan.py``), and ``prompt_listeners``, called with each prompt of ours that left its
    server and its seconds from the POST's answer (estimates of time left, metrics)."""

    states: ServerStates
    sockets: Sockets
    keeper: LeaseKeeper
    settings: PoolSettings
    plan: Plan = field(init=False, repr=False)
    prompt_listeners: list[Callable[[Slot, float], None]] = field(
        default_factory=list, init=False, repr=False
    )
    # Needs some server could run, at which ``_known`` (bumped by every change to
    # what is known of the servers): asked per job, answered without a loop.
    _known: int = field(default=0, init=False, repr=False)
    _runnable: dict[Needs, int] = field(default_factory=dict, init=False, repr=False)
    # Loop time of the last full read, by needs none could run.
    _unrunnable_at: dict[Needs, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.plan = Plan([s.name for s in self.states.all], self.can_run)

    # -- what a server can run ----------------------------------------------------------

    def lacks(self, name: str, needs: Needs) -> Missing | None:
        """What server ``name`` lacks for ``needs`` by its last /object_info; None when
        it has it all or was not read yet."""
        state = self.states.get(name)
        if state is None:
            return None
        if needs not in state.lacking:
            caps = state.capabilities
            state.lacking[needs] = caps.lacks(needs) if caps is not None else None
        return state.lacking[needs]

    def may_run(self, name: str, needs: Needs) -> bool:
        """Whether server ``name`` may run a job of ``needs`` now: reachable at its last
        probe (or not probed yet), and lacking nothing by its /object_info (or not read
        yet)."""
        state = self.states.get(name)
        reachable = state is None or state.unreachable_since is None
        return reachable and self.lacks(name, needs) is None

    def can_run(self, name: str, needs: Needs) -> bool:
        """Whether server ``name`` (read, and reachable) can run a job of ``needs``."""
        state = self.states.get(name)
        return (
            state is not None
            and state.capabilities is not None
            and state.unreachable_since is None
            and self.lacks(name, needs) is None
        )

    async def read_capabilities(self, specs: Sequence[ServerSpec], force: bool = False) -> None:
        """Read the /object_info of those of ``specs`` never read or marked stale (with
        ``force``: all of them); concurrent callers share each read. A server that does
        not answer keeps what was known of it (nothing, at first)."""
        todo = []
        for spec in specs:
            self._notice_restart(spec.name)
            state = self.states[spec.name]
            if force or state.capabilities is None or state.stale:
                reading = state.reading
                if reading is None:
                    reading = state.reading = asyncio.ensure_future(self._read(spec))
                    reading.add_done_callback(_forget_reading(state))
                todo.append(reading)
        if todo:
            await asyncio.gather(*(asyncio.shield(t) for t in todo))

    async def _read(self, spec: ServerSpec) -> None:
        state = self.states[spec.name]
        client = state.client
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s * 3):
                caps = await client.object_info()
        except (ComfyError, TimeoutError) as e:
            why = str(e) or f"no answer in {self.settings.probe_timeout_s * 3:g} s"
            log.info("server %s: /object_info not read (%s)", spec.name, why)
            return
        before = state.capabilities
        state.capabilities = caps
        state.stale = False
        state.read, state.read_mark = True, self.sockets.mark(spec.name)
        if before is None or before.lists != caps.lists or before.classes != caps.classes:
            state.lacking.clear()
            self._known += 1
            files = len(set().union(*caps.lists.values())) if caps.lists else 0
            log.info(
                "server %s: %d node classes, %d model files", spec.name, len(caps.classes), files
            )

    def _notice_restart(self, name: str) -> None:
        """Mark ``name`` stale when its socket reconnected (or was opened anew after a
        failure) since its last read: the server may have started again."""
        state = self.states[name]
        seen = state.read_mark
        now = self.sockets.mark(name)
        if seen is None or now is None:
            if state.read and now is not None:
                state.read_mark = now  # opened after the read: nothing happened
            return
        if seen != now:
            self._started_anew(name, "its socket reconnected")

    def came_back(self, name: str, healthy: bool) -> None:
        """A probe's verdict on ``name`` (``Prober.report``): back from unreachable, it
        may have started again."""
        state = self.states[name]
        if not healthy:
            if state.unreachable_since is None:
                state.unreachable_since = asyncio.get_running_loop().time()
                self._known += 1
            return
        if state.unreachable_since is not None:
            state.unreachable_since = None
            self._known += 1
            self._started_anew(name, "it came back")

    def _started_anew(self, name: str, why: str) -> None:
        state = self.states[name]
        if not state.stale:
            log.info("server %s: %s; its /object_info is read again, it holds no model", name, why)
        state.stale = True
        state.read, state.read_mark = True, None
        if self.plan.holds(name):
            self.plan.forget(name)
            self.keeper.ask(self.keeper.leases.note_server_model, None, name, None)

    async def cannot_run(self, needs: Needs) -> str | None:
        """Why no server of the pool can run a job of ``needs`` (a dead letter, nothing
        posted), or None when one can or may (a server not read yet, unreachable for less
        than ``unreachable_timeout_s``). Before saying no, every server is read again."""
        if self._runnable.get(needs) == self._known:
            return None
        specs = [s.spec for s in self.states.all]
        await self.read_capabilities(specs)
        if self.cannot_run_now(needs) is None:
            return None
        # Files may have been copied since the last read: read every server again, once
        # per READ_AGAIN_S for the same needs (a file of 1,000 such jobs reads it once).
        now = asyncio.get_running_loop().time()
        if now - self._unrunnable_at.get(needs, -1e9) >= READ_AGAIN_S:
            await self.read_capabilities(specs, force=True)
            self._unrunnable_at[needs] = asyncio.get_running_loop().time()
        return self.cannot_run_now(needs)

    def cannot_run_now(self, needs: Needs) -> str | None:
        """``cannot_run`` from what is known, without reading anything."""
        if self._runnable.get(needs) == self._known:
            return None
        lacking: dict[str, Missing] = {}
        gone: list[str] = []
        limit = self.settings.unreachable_timeout_s
        now = asyncio.get_running_loop().time()
        for state in self.states.all:
            since = state.unreachable_since
            if since is not None and limit is not None and now - since >= limit:
                gone.append(state.name)
                continue
            if state.capabilities is None:
                return None  # not read yet: it may have it
            missing = self.lacks(state.name, needs)
            if missing is None:
                if since is None:  # runnable for sure: remembered until something changes
                    self._runnable[needs] = self._known
                return None
            lacking[state.name] = missing
        if not lacking:  # every server unreachable: nothing is known (NoServerReachable)
            return None
        return no_server_reason(lacking, gone)

    # -- which models a server holds ----------------------------------------------------

    def assign(self, slot: Slot, needs: Needs) -> bool:
        """The job of ``needs`` is run on ``slot``: returns whether its server loads a
        model for it (it did not hold them all); what it holds is noted in the store
        when it changes, for every process sharing the servers."""
        load = self.plan.assign(slot.name, needs)
        slot.models = tuple(sorted(models_of(needs)))
        slot.load_expected = load
        slot.assigned = True
        if load:
            text = held_text(self.plan.holds(slot.name))
            self.keeper.ask(self.keeper.leases.note_server_model, None, slot.name, text)
        return load

    def held_from(self, leases: Mapping[str, ServerLeaseView]) -> None:
        """What servers not ours now hold, as the store says (another process may have
        run other models there since)."""
        for name, lease in leases.items():
            state = self.states.get(name)
            if state is None or state.held is not None or state.kept:
                continue
            held = parse_held(lease.last_model)
            if held:
                self.plan.held[name] = held
            else:
                self.plan.forget(name)

    def prompt_left(self, slot: Slot) -> None:
        """``slot``'s prompt left its server: measure it (plan estimates), and remember
        what the server holds when no job said so (a slot taken with ``models``)."""
        if not slot.assigned and slot.models:
            self.plan.held[slot.name] = frozenset(slot.models)
        if slot.posted_at is not None and slot.lost is None:
            seconds = asyncio.get_running_loop().time() - slot.posted_at
            self.plan.estimates.record(seconds, slot.load_expected)
            for listener in self.prompt_listeners:
                listener(slot, seconds)

    def held_text(self, name: str) -> str | None:
        """What server ``name`` holds, as its lease row keeps it."""
        return held_text(self.plan.holds(name))


def _forget_reading(state: ServerState) -> Callable[[asyncio.Future[None]], None]:
    """A done callback: ``state``'s /object_info is no longer being read."""

    def forget(_: asyncio.Future[None]) -> None:
        state.reading = None

    return forget
