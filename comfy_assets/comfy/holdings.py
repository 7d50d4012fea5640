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

from comfy_assets.comfy.capabilities import Capabilities, Missing, Needs, no_server_reason
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.plan import Plan, held_text, models_of, parse_held
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.comfy.slot import Slot

log = logging.getLogger("comfy_assets.pool")

READ_AGAIN_S = 2.0  # seconds before a job like one found unrunnable reads all again


class Holdings:
    """Capabilities and held models of the pool's servers (a part of ``Pool``)."""

    def _init_holdings(self) -> None:
        self.capabilities: dict[str, Capabilities] = {}
        self.plan = Plan([s.name for s in self.servers], self.can_run)
        # Called with each prompt of ours that left its server and its seconds from the
        # POST's answer (estimates of time left, metrics).
        self.prompt_listeners: list[Callable[[Slot, float], None]] = []
        self._can_run: dict[tuple[str, Needs], Missing | None] = {}
        self._stale: set[str] = set()  # read again before the next use
        self._reading: dict[str, asyncio.Future[None]] = {}
        # (id of the server's follower, its reconnects) when its /object_info was read.
        self._read_mark: dict[str, tuple[int, int] | None] = {}
        self._unreachable_since: dict[str, float] = {}  # loop time
        # Needs some server could run, at which ``_known`` (bumped by every change to
        # what is known of the servers): asked per job, answered without a loop.
        self._known = 0
        self._runnable: dict[Needs, int] = {}
        self._unrunnable_at: dict[Needs, float] = {}  # loop time of the last full read

    # -- what a server can run ----------------------------------------------------------

    def lacks(self, name: str, needs: Needs) -> Missing | None:
        """What server ``name`` lacks for ``needs`` by its last /object_info; None when
        it has it all or was not read yet."""
        key = (name, needs)
        if key not in self._can_run:
            caps = self.capabilities.get(name)
            self._can_run[key] = caps.lacks(needs) if caps is not None else None
        return self._can_run[key]

    def may_run(self, name: str, needs: Needs) -> bool:
        """Whether server ``name`` may run a job of ``needs`` now: reachable at its last
        probe (or not probed yet), and lacking nothing by its /object_info (or not read
        yet)."""
        return name not in self._unreachable_since and self.lacks(name, needs) is None

    def can_run(self, name: str, needs: Needs) -> bool:
        """Whether server ``name`` (read, and reachable) can run a job of ``needs``."""
        return (
            name in self.capabilities
            and name not in self._unreachable_since
            and self.lacks(name, needs) is None
        )

    async def read_capabilities(self, specs: Sequence[ServerSpec], force: bool = False) -> None:
        """Read the /object_info of those of ``specs`` never read or marked stale (with
        ``force``: all of them); concurrent callers share each read. A server that does
        not answer keeps what was known of it (nothing, at first)."""
        todo = []
        for spec in specs:
            self._notice_restart(spec.name)
            if force or spec.name not in self.capabilities or spec.name in self._stale:
                reading = self._reading.get(spec.name)
                if reading is None:
                    reading = asyncio.ensure_future(self._read(spec))
                    self._reading[spec.name] = reading
                    reading.add_done_callback(
                        lambda _, n=spec.name: self._reading.pop(n, None)  # type: ignore[misc]
                    )
                todo.append(reading)
        if todo:
            await asyncio.gather(*(asyncio.shield(t) for t in todo))

    async def _read(self, spec: ServerSpec) -> None:
        client = self.clients[spec.name]
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s * 3):
                caps = await client.object_info()
        except (ComfyError, TimeoutError) as e:
            log.info("server %s: /object_info not read (%s)", spec.name, e or type(e).__name__)
            return
        before = self.capabilities.get(spec.name)
        self.capabilities[spec.name] = caps
        self._stale.discard(spec.name)
        self._read_mark[spec.name] = self._follower_mark(spec.name)
        if before is None or before.lists != caps.lists or before.classes != caps.classes:
            self._can_run = {k: v for k, v in self._can_run.items() if k[0] != spec.name}
            self._known += 1
            files = len(set().union(*caps.lists.values())) if caps.lists else 0
            log.info(
                "server %s: %d node classes, %d model files", spec.name, len(caps.classes), files
            )

    def _follower_mark(self, name: str) -> tuple[int, int] | None:
        follower = self._followers.get(name)
        return None if follower is None else (id(follower), follower.reconnects)

    def _notice_restart(self, name: str) -> None:
        """Mark ``name`` stale when its socket reconnected (or was opened anew after a
        failure) since its last read: the server may have started again."""
        seen = self._read_mark.get(name)
        now = self._follower_mark(name)
        if seen is None or now is None:
            if name in self._read_mark and now is not None:
                self._read_mark[name] = now  # opened after the read: nothing happened
            return
        if seen != now:
            self._started_anew(name, "its socket reconnected")

    def _came_back(self, name: str, healthy: bool) -> None:
        """A probe's verdict on ``name`` (``Probing._report``): back from unreachable, it
        may have started again."""
        if not healthy:
            if name not in self._unreachable_since:
                self._unreachable_since[name] = asyncio.get_running_loop().time()
                self._known += 1
            return
        if self._unreachable_since.pop(name, None) is not None:
            self._known += 1
            self._started_anew(name, "it came back")

    def _started_anew(self, name: str, why: str) -> None:
        if name not in self._stale:
            log.info("server %s: %s; its /object_info is read again, it holds no model", name, why)
        self._stale.add(name)
        self._read_mark[name] = None
        if self.plan.holds(name):
            self.plan.forget(name)
            self._ask_leases(self.leases.note_server_model, None, name, None)

    async def cannot_run(self, needs: Needs) -> str | None:
        """Why no server of the pool can run a job of ``needs`` (a dead letter, nothing
        posted), or None when one can or may (a server not read yet, unreachable for less
        than ``unreachable_timeout_s``). Before saying no, every server is read again."""
        if self._runnable.get(needs) == self._known:
            return None
        await self.read_capabilities(self.servers)
        if self.cannot_run_now(needs) is None:
            return None
        # Files may have been copied since the last read: read every server again, once
        # per READ_AGAIN_S for the same needs (a file of 1,000 such jobs reads it once).
        now = asyncio.get_running_loop().time()
        if now - self._unrunnable_at.get(needs, -1e9) >= READ_AGAIN_S:
            await self.read_capabilities(self.servers, force=True)
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
        for spec in self.servers:
            since = self._unreachable_since.get(spec.name)
            if since is not None and limit is not None and now - since >= limit:
                gone.append(spec.name)
                continue
            if spec.name not in self.capabilities:
                return None  # not read yet: it may have it
            missing = self.lacks(spec.name, needs)
            if missing is None:
                if since is None:  # runnable for sure: remembered until something changes
                    self._runnable[needs] = self._known
                return None
            lacking[spec.name] = missing
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
            self._ask_leases(self.leases.note_server_model, None, slot.name, text)
        return load

    def _held_from(self, leases: Mapping[str, object]) -> None:
        """What servers not ours now hold, as the store says (another process may have
        run other models there since)."""
        for name, lease in leases.items():
            if name in self._held or name in self._kept or name not in self.clients:
                continue
            held = parse_held(getattr(lease, "last_model", None))
            if held:
                self.plan.held[name] = held
            else:
                self.plan.forget(name)

    def _prompt_left(self, slot: Slot) -> None:
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
