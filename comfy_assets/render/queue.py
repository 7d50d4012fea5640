"""The jobs of a batch waiting for a server (ready ones, and ones waiting out a delay),
grouped by what they need of a server, and which of them a free server takes.

Jobs with the same ``Needs`` (node classes and model files: ``comfy/capabilities.py``)
form a group, in the order they came. A consumer claims a job before it waits in line
for a server and leaves it here, claimed, at the head of its group (so a server handed
over goes straight to a POST, with no claim to write on the way); the pool asks the
consumer's ``chooser`` about each free server, and the plan (``pool/plan.py``) answers
with the group that server takes a job of, or nothing (it waits for a model to be worth
loading). With ``planned`` off, a free server takes the oldest job it can run, whatever
its model (a server holding that model still wins a tie): the behaviour before the plan,
for comparison.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from comfy_assets.comfy.capabilities import Needs
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import Job
from comfy_assets.pool.plan import Demand, Plan
from comfy_assets.pool.slot import Slot
from comfy_assets.render.outcome import Failure
from comfy_assets.store import JobRecord

# Workflows whose needs are kept at most (``JobQueue.needs``).
NEEDS_KEPT = 4096


@dataclass
class Item:
    job: Job
    prev_server: str | None = None
    attempts_before: int = 0  # the job's tries before its last requeue (store)
    fresh: bool = False  # its outputs are gone from the server: render anew
    # The run number of the prompt on prev_server that the last attempt saw (its POST's
    # answer, or a run found there) when the store has none: a catch-up that finds
    # neither that run nor its history then says the job may render twice.
    prev_number: int | None = None
    # The last attempt never ended (its process died mid-attempt): its POST may have been
    # accepted although no run number was recorded.
    prev_unsettled: bool = False
    # Its claim, taken by a consumer before it waited in line for a server.
    rec: JobRecord | None = None
    # The server it was last sent to, and whether that server had to load a model for it.
    loaded_on: str | None = None
    model_loaded: bool = False
    seq: int = field(default=0, compare=False)  # arrival rank in the queue (lower first)
    # Servers where an attempt of this batch failed in a way that may be the server's,
    # with the failure, in the order they failed (``render/blame.py``): the job goes
    # elsewhere while another server can run it.
    failed_on: dict[str, Failure] = field(default_factory=dict, compare=False)
    # Attempts that went elsewhere at once because their failure may be the server's:
    # not counted against the job's attempts (each server is tried once at most).
    elsewhere: int = 0
    # Attempts whose outputs the store's files could not store or confirm (the store's
    # failure, ``AttemptResult.file_store_fault``): not counted against the job's
    # attempts either; they wait with backoff while the files fail for less than
    # ``files_wait_s`` (``render/files_outage.py``).
    store_faults: int = 0
    # The kinds of failure its attempts in this batch had (``render/outcome.py``).
    kinds: set[str] = field(default_factory=set, compare=False)

    def retried(self, server: str | None, *, fresh: bool, number: int | None) -> Item:
        """The item of this job's next try after an attempt on ``server`` (its run
        ``number`` there; ``fresh``: its outputs are gone there, render anew). What this
        batch learnt of the job (``LEARNT``: where it failed, its tries elsewhere, the
        store's faults, its failures' kinds) goes with it; its claim and place do not."""
        learnt = {name: getattr(self, name) for name in LEARNT}
        return Item(self.job, server, fresh=fresh, prev_number=number, **learnt)


# What an item's next try keeps of it (``Item.retried``).
LEARNT = ("failed_on", "elsewhere", "store_faults", "kinds")


class ServerView(Protocol):
    """What the queue asks of the pool about its servers (``pool.pool.Pool`` has it)."""

    @property
    def servers(self) -> Sequence[ServerSpec]: ...

    def may_run(self, name: str, needs: Needs) -> bool: ...

    def blocked(self, name: str) -> str | None: ...

    def on_probation(self, name: str) -> bool: ...


class JobQueue:
    """Jobs ready to run, by group, and jobs waiting for a delay (backoff, someone
    else's claim). ``plan``: the pool's; ``planned`` False: oldest first."""

    def __init__(self, plan: Plan, planned: bool = True, view: ServerView | None = None) -> None:
        self.plan = plan
        self.planned = planned
        self.view = view  # None: every server takes any job (no health to heed)
        self.changed = asyncio.Event()
        self._groups: dict[Needs, deque[Item]] = {}
        self._size = 0
        self._claimed = 0  # items here with their claim taken
        # Each job waiting out a delay, with the loop time it is back. The time is kept
        # here: uvloop answers a delay under a millisecond with a plain Handle, no when().
        self._timers: dict[asyncio.Handle, tuple[Item, float]] = {}
        self._next = itertools.count(1)
        self._first = itertools.count(-1, -1)  # back at the head: older than any
        self._needs: dict[str, Needs] = {}  # by workflow sha256
        self._chosen: dict[str, Needs] = {}  # the group last chosen for each server

    # -- what is waiting ----------------------------------------------------------------

    def needs(self, item: Item) -> Needs:
        """What ``item``'s job needs of a server (computed once per workflow)."""
        key = item.job.workflow_sha256
        found = self._needs.get(key)
        if found is None:
            if len(self._needs) >= NEEDS_KEPT:
                # Most jobs have a workflow of their own (a seed, a prompt): a million of
                # them must not stay here. Needs are cheap to find again.
                self._needs.clear()
            found = self._needs[key] = Needs.of(item.job.workflow)
        return found

    def __len__(self) -> int:
        return self._size

    @property
    def ready(self) -> _Ready:
        """The ready jobs as a line (``len``, ``bool``, iteration oldest first)."""
        return _Ready(self)

    @property
    def claimed(self) -> int:
        """How many jobs here are claimed already."""
        return self._claimed

    @property
    def waiting(self) -> int:
        return len(self._timers)

    def later(self) -> list[tuple[Item, float]]:
        """The jobs waiting out a delay (backoff, someone else's claim), each with the
        loop time it is back in line."""
        return list(self._timers.values())

    def demand(self, server: str | None = None) -> dict[Needs, Demand]:
        """Per group: how many jobs wait (that ``server`` may take, when given), and the
        arrival rank of the oldest."""
        if server is None or self.view is None:
            return {g: Demand(len(q), q[0].seq) for g, q in self._groups.items() if q}
        found = {}
        for g, q in self._groups.items():
            first, count = self._fits(g, q, server)
            if first is not None:
                found[g] = Demand(count, q[first].seq)
        return found

    def _fits(self, group: Needs, items: deque[Item], server: str) -> tuple[int | None, int]:
        """(index of the first item of ``group`` that ``server`` may take, how many may).
        Not a job that failed there while another server that is not quarantined can run
        it; on a server with failures not judged yet (``on_probation``), only jobs that
        failed elsewhere, unless no server without such failures can run the group."""
        view = self.view
        assert view is not None
        capable: list[str] | None = None

        def others() -> list[str]:
            nonlocal capable
            if capable is None:
                capable = [s.name for s in view.servers if view.may_run(s.name, group)]
            return capable

        restricted = view.on_probation(server) and any(
            s != server and view.blocked(s) is None and not view.on_probation(s) for s in others()
        )
        first, count = None, 0
        for index, item in enumerate(items):
            failed = item.failed_on
            if failed:
                # Kept for a server it has not failed on, unless every such one is
                # quarantined now (it would wait out a cool-down with this one free).
                untried = (s for s in others() if s not in failed)
                if server in failed and any(view.blocked(s) is None for s in untried):
                    continue
            elif restricted:
                continue
            elif first is None:
                return index, len(items)  # fresh jobs: all of them may go there
            first = index if first is None else first
            count += 1
        return first, count

    def groups(self) -> list[Needs]:
        """The groups with jobs waiting."""
        return [g for g, q in self._groups.items() if q]

    # -- in and out -----------------------------------------------------------------------

    def push(self, item: Item) -> None:
        item.seq = next(self._next)
        self._add(item, front=False)

    def push_later(self, item: Item, delay_s: float) -> None:
        """Put ``item`` back after ``delay_s`` seconds, at the head of the line: it has
        waited longest."""
        loop = asyncio.get_running_loop()
        handle: asyncio.Handle

        def fire() -> None:
            self._timers.pop(handle, None)
            item.seq = next(self._first)
            self._add(item, front=True)

        when = loop.time() + max(delay_s, 0.0)
        handle = loop.call_later(delay_s, fire)
        self._timers[handle] = (item, when)

    def put_back(self, item: Item, rec: JobRecord) -> None:
        """A job a consumer claimed before it waited in line: back in its place in its
        group, for whichever consumer gets a server for that group."""
        item.rec = rec
        self._add(item, front=None)

    def _add(self, item: Item, *, front: bool | None) -> None:
        """Add ``item`` at the head of its group (``front``), at its end, or (None) in the
        order of arrival among those before it (they are few: it left the head)."""
        group = self._groups.setdefault(self.needs(item), deque())
        if front:
            group.appendleft(item)
        elif front is None:
            index = 0
            while index < len(group) and group[index].seq < item.seq:
                index += 1
            group.insert(index, item)
        else:
            group.append(item)
        self._size += 1
        self._claimed += item.rec is not None
        self.changed.set()

    def _take(self, group: Needs, index: int = 0) -> Item:
        items = self._groups[group]
        item = items.popleft() if index == 0 else items[index]
        if index:
            del items[index]
        self._size -= 1
        self._claimed -= item.rec is not None
        return item

    def pop_unclaimed(self) -> Item | None:
        """The oldest job not claimed yet (for a consumer to claim before it waits)."""
        best: tuple[int, Needs, int] | None = None
        for group, items in self._groups.items():
            for index, item in enumerate(items):
                if item.rec is None:
                    if best is None or item.seq < best[0]:
                        best = (item.seq, group, index)
                    break
        return None if best is None else self._take(best[1], best[2])

    def pop_group(self, group: Needs, server: str | None = None) -> Item | None:
        """The head of ``group`` (claimed ones first) that ``server`` may take (any, when
        None), or None if it has none."""
        items = self._groups.get(group)
        if not items:
            return None
        if server is None or self.view is None:
            return self._take(group)
        index, _ = self._fits(group, items, server)
        return None if index is None else self._take(group, index)

    def pop_chosen(self, server: str) -> Item | None:
        """The job for ``server`` just handed to a consumer: the head of the group its
        chooser gave it; None if another consumer took the last of them meanwhile."""
        group = self._chosen.pop(server, None)
        return None if group is None else self.pop_group(group, server)

    def pop_for(self, slot: Slot) -> Item | None:
        """The job for a server a consumer still holds; None when the plan keeps it for
        later (the consumer then lets it go)."""
        group = self._choose(slot.name, 0.0)
        return None if group is None else self.pop_group(group, slot.name)

    def pop_all(self, group: Needs) -> list[Item]:
        """Every job of ``group`` (none of them can run)."""
        items = []
        while (item := self.pop_group(group)) is not None:
            items.append(item)
        return items

    def remove(self, item: Item) -> None:
        """Take ``item`` itself out of the line, if it is there."""
        group = self._groups.get(self.needs(item), deque())
        for index, other in enumerate(group):
            if other is item:
                self._take(self.needs(item), index)
                return

    def cancel_all(self) -> list[Item]:
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        items = [i for group in self._groups.values() for i in group]
        self._groups.clear()
        self._size = self._claimed = 0
        return items

    # -- choosing with the pool -----------------------------------------------------------

    def _choose(self, server: str, waited_s: float) -> Needs | None:
        demand = self.demand(server)
        if self.planned:
            return self.plan.choose(server, demand, waited_s)
        return self.plan.oldest(server, demand)

    def chooser(self) -> Callable[[str, float], int | None]:
        """A consumer's say on each free server (``pool.want.Chooser``): None when no
        job here should go there now, else 0 when the server holds the models of the
        group chosen for it, 1 when it must load one."""

        def choose(server: str, waited_s: float) -> int | None:
            group = self._choose(server, waited_s)
            if group is None:
                return None
            self._chosen[server] = group
            return 0 if self.plan.fits(server, group) else 1

        return choose


@dataclass
class _Ready:
    """``JobQueue.ready``: the ready jobs as a line, oldest first."""

    queue: JobQueue

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return len(self.queue) > 0

    def __iter__(self) -> Iterator[Item]:
        items = [i for group in self.queue._groups.values() for i in group]
        return iter(sorted(items, key=lambda i: i.seq))


def prev_number(item: Item, rec: JobRecord, prev: str | None) -> int | None:
    """The run number the job's prompt last had on ``prev`` (its last server): the
    store's, else the one the previous attempt of this batch saw there (a run found by a
    catch-up or after an unanswered POST, which the store does not record). None for a
    job requeued since its last attempt: only a dead letter is requeued, and its run has
    ended (a catch-up still looks for a success there, but no run of it can be lost)."""
    if prev is None or (rec.attempts == 0 and rec.attempts_before > 0):
        return None
    if rec.number is not None:
        return rec.number
    return item.prev_number if item.prev_server == prev else None
