"""Whose failure is this: the job's, or the server's it ran on (``Blame``, a part of
``Batch``).

Detected by the attempt (``render/attempt.py``: a ``Failure`` on its result), decided
here, answered for in the store (``store/health.py``: open failures, strikes,
quarantines, workflows known to fail):

- an **infrastructure** error (``comfy/infra.py``) is the server's at first sight: a
  strike against it (a quarantine), and the job tries another server at once;
- a **wedged** server (our prompt still running after its interrupt and delete) is the
  server's at first sight too: quarantined, the job tried elsewhere at once, and its
  events say it may render there as well should the server come back;
- an ordinary **execution_error**, a prompt **rejected** (POST 400, 200 with node_errors)
  or an answer not understood may be either's, so a second server judges it: the job is
  tried next on a server it has not failed on, at once, and is a dead letter only once it
  failed the same way on two servers (the workflow is then known to fail so: its other
  jobs failing that way are dead letters at their first failure), or on every server that
  can run it; its success elsewhere makes the failure the first server's;
- a failure that is never the job's alone (a deadline, a stalled or lost prompt, a 5xx,
  refused, reset or timed-out request, out of memory) goes elsewhere at once while another
  server can run the job, with backoff once each has been tried; a success elsewhere is a
  strike, and ``QUARANTINE_STRIKES`` such failures of different jobs in a row on one server
  with no success between quarantine it whatever the others do (when every server fails
  everything, nobody renders to judge). A job that ran out of attempts so while every
  server that can run it is quarantined stays pending: nothing says it is the job's.

A failure of a workflow known to fail is never held against its server, and neither is
one nobody could judge (on the only server that can run the job). A workflow that
rendered in this batch is never taken for one that fails everywhere, however many servers
failed it alike (they are sick, not it), and its success unlearns it in the store.
Attempts that go elsewhere at once are not counted against the job's attempts.

A workflow is known by the sha256 of its graph (``graph_sha256``: each node's class and
links, not the values ``set`` and inputs give it), so the jobs of one job file that
differ only in their seeds or colours are one workflow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

from comfy_assets.comfy.capabilities import Needs
from comfy_assets.pool.pool import Pool
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.outcome import RETRYABLE, SERVERS_AT_ONCE, AttemptResult, Failure
from comfy_assets.render.queue import Item, JobQueue
from comfy_assets.render.store_threads import StoreThreads
from comfy_assets.store import Store
from comfy_assets.store.health import (
    COOLDOWN_MAX_S,
    QUARANTINE_STRIKES,
    HealthChange,
    ServerHealthRecord,
)

# A running prompt is taken as stalled after ``stall_factor`` times the longest run of its
# kind in the batch, never sooner than this (seconds), once this many of them ran.
STALL_MIN_S = 10.0
# Workflows that rendered kept unhashed at most (``Blame._unhashed``): hashed in a batch
# only when a failure is judged, or when this many wait.
UNHASHED_KEPT = 1000
STALL_SAMPLES = 3
# Before that many of its kind rendered (every server wedged from its first prompt, say):
# stalled after this many times ``STALL_MIN_S`` unheard of (2 minutes), so a farm of
# wedged GPUs ends in minutes, not after each prompt's deadline.
STALL_FIRST_RUNS = 12.0


def graph_sha256(workflow: dict[str, Any]) -> str:
    """sha256 (hex) of an API-format workflow's graph: for each node id, its
    ``class_type`` and the inputs that are links (``[node_id, output_index]``)."""
    graph = {
        node_id: [
            node.get("class_type"),
            sorted(
                (name, value)
                for name, value in (node.get("inputs") or {}).items()
                if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)
            ),
        ]
        for node_id, node in workflow.items()
        if isinstance(node, dict)
    }
    return _sha(json.dumps(graph, sort_keys=True, separators=(",", ":"), default=str))


@lru_cache(maxsize=4096)
def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(eq=False, kw_only=True)
class Blame:
    """Judging an attempt's failure and telling the store, for one batch: the servers of
    ``pool``, the jobs' groups of ``queue``, the stall factor and patience of ``config``;
    store writes through ``threads``, changes of a server's health said with ``report``."""

    pool: Pool
    store: Store
    queue: JobQueue
    config: BatchConfig
    threads: StoreThreads
    report: Callable[[str], None]
    # Per group of jobs: monotonic time every server able to run it was first seen
    # quarantined.
    _blocked_groups: dict[Needs, float] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )
    # Workflows (graph sha256) that rendered in this batch: none of them can be a
    # workflow that fails everywhere, whatever two servers said.
    _rendered_graphs: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    # Workflows this batch took (or learned) as known to fail: a success of one
    # unlearns it in the store.
    _learned_graphs: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    # Resolved workflow sha256 -> graph sha256 (of the workflows judged after a failure).
    _graphs: dict[str, str] = dataclasses.field(default_factory=dict, init=False, repr=False)
    # Workflows that rendered, by resolved sha256, not yet among ``_rendered_graphs``:
    # hashed only when a failure is judged, which most batches never need (the
    # batch's jobs hold these workflows anyway).
    _unhashed: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )
    # Per server: the jobs whose failure there was never the job's alone (a 5xx, a
    # deadline, out of memory...) since its last success, in order.
    _failing: dict[str, list[str]] = dataclasses.field(default_factory=dict, init=False, repr=False)
    # Per group of jobs (their needs): how many rendered, and the longest took (s).
    _longest: dict[Needs, tuple[int, float]] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    def stall_s(self, item: Item) -> Callable[[], float | None]:
        """``Attempt.stall_s`` of ``item``: how long its prompt may run unheard of before
        it is taken as stalled, asked as it runs: ``stall_factor`` times the longest run of
        its kind in this batch (at least ``STALL_MIN_S``) once ``STALL_SAMPLES`` of them
        rendered, ``STALL_FIRST_RUNS`` times ``STALL_MIN_S`` before; None on a server that
        loads a model for it (a load says nothing for as long as it takes), after it
        stalled once (a long job is not cut twice), or with no ``stall_factor``."""
        key = self.queue.needs(item)

        def stall_s() -> float | None:
            factor = self.config.stall_factor
            if not factor or item.model_loaded or "stalled" in item.kinds:
                return None
            seen = self._longest.get(key)
            if seen is None or seen[0] < STALL_SAMPLES:
                return STALL_FIRST_RUNS * STALL_MIN_S
            return max(STALL_MIN_S, factor * seen[1])

        return stall_s

    def measured(self, item: Item, r: AttemptResult) -> None:
        """A prompt of ``item`` rendered in ``r.gpu_seconds`` (else the attempt's time)."""
        if r.caught_up:
            return
        key = self.queue.needs(item)
        count, longest = self._longest.get(key, (0, 0.0))
        took = r.gpu_seconds if r.gpu_seconds is not None else r.seconds
        self._longest[key] = (count + 1, max(longest, took))

    def _graph(self, item: Item) -> str:
        job = item.job
        return self._graph_of(job.workflow_sha256, job.workflow)

    def _graph_of(self, workflow_sha256: str, workflow: dict[str, Any]) -> str:
        found = self._graphs.get(workflow_sha256)
        if found is None:
            found = self._graphs[workflow_sha256] = graph_sha256(workflow)
        return found

    def _has_rendered(self, graph: str) -> bool:
        """Whether a workflow of ``graph`` rendered in this batch."""
        self._fold_unhashed()
        return graph in self._rendered_graphs

    def _fold_unhashed(self) -> None:
        """Hash the workflows that rendered into their graphs: a batch of a million jobs
        holds a few graphs, not a million workflows (nor a million sha256 in ``_graphs``)."""
        for sha, workflow in self._unhashed.items():
            found = self._graphs.get(sha)
            self._rendered_graphs.add(graph_sha256(workflow) if found is None else found)
        self._unhashed.clear()

    async def owned(self, item: Item, r: AttemptResult) -> tuple[AttemptResult, bool]:
        """The attempt's result once ownership is decided, and whether the job is tried
        again at once (elsewhere, no backoff). A result without a ``Failure`` is
        returned as it is."""
        failure, server = r.failure, r.server
        if failure is None or server is None or r.kind == "success":
            return r, False
        job = item.job
        item.kinds.add(failure.kind)
        if failure.kind in SERVERS_AT_ONCE:
            # A wedged GPU stays stuck until someone restarts its server (``health
            # --readmit`` then): quarantined for the longest cool-down, so a farm of wedged
            # servers stops its batch at once instead of waiting for trials that cannot
            # come (the stuck prompt keeps each server busy).
            wedged = failure.kind == "wedged"
            cooldown = COOLDOWN_MAX_S if wedged else None
            await self._server_failed(
                item, server, failure, infrastructure=True, cooldown_s=cooldown
            )
            if wedged:
                await self.threads.call(
                    self.store.note,
                    job.id,
                    f"its prompt stays running on {server} (wedged): should {server} come "
                    "back and finish it, the job may have rendered there too",
                    server=server,
                )
            return dataclasses.replace(r, kind="transient"), True
        if failure.kind in RETRYABLE:
            return await self._never_the_jobs_alone(item, r, server, failure)
        graph = self._graph(item)
        rendered = self._has_rendered(graph)
        known = None
        if not rendered:
            known = await self.threads.call(
                self.store.known_workflow_failure, graph, failure.signature
            )
        if known is not None:
            self._learned_graphs.add(graph)
            await self._health(self.store.failure_owned_by_job, server, job.id)
            where = " and ".join(known)
            reason = (
                f"{failure.summary}; this workflow failed so on {where} before "
                "(the workflow's failure, not the server's)"
            )
            return dataclasses.replace(r, kind="permanent", reason=reason), False
        alike = [
            s for s, f in item.failed_on.items() if s != server and f.signature == failure.signature
        ]
        if alike and not rendered:  # a workflow that rendered here fails on sick servers
            servers = [*alike, server]
            self._learned_graphs.add(graph)
            await self._health(
                self.store.job_failed_alike,
                job.id,
                graph,
                failure.signature,
                servers,
                failure.summary,
            )
            reason = f"failed on {' and '.join(servers)}: {failure.summary}"
            return dataclasses.replace(r, kind="permanent", reason=reason), False
        needs = self.queue.needs(item)
        others = self._others(item, server)
        if not others:
            item.failed_on[server] = failure
            await self._health(self.store.failure_owned_by_job, server, job.id)
            tried = list(item.failed_on)
            where = (
                f"failed on {server}, the only server that can run it"
                if len(tried) == 1
                else f"failed on {' and '.join(tried)}, every server that can run it"
            )
            away = [
                s.name
                for s in self.pool.servers
                if s.name not in item.failed_on and self.pool.lacks(s.name, needs) is None
            ]
            if away:  # they could, were they reachable: a dead letter is not left waiting
                where += f" now ({', '.join(away)} unreachable)"
            return dataclasses.replace(r, kind="permanent", reason=f"{where}: {r.reason}"), False
        await self._server_failed(item, server, failure)
        reason = f"{r.reason}; trying another server ({', '.join(others)} can run it)"
        return dataclasses.replace(r, kind="transient", reason=reason), True

    def _others(self, item: Item, server: str) -> list[str]:
        """The servers besides ``server`` that may run ``item`` and it has not failed on."""
        needs = self.queue.needs(item)
        return [
            s.name
            for s in self.pool.servers
            if s.name not in item.failed_on
            and s.name != server
            and self.pool.may_run(s.name, needs)
        ]

    async def _never_the_jobs_alone(
        self, item: Item, r: AttemptResult, server: str, failure: Failure
    ) -> tuple[AttemptResult, bool]:
        """A failure that is never the job's alone (``RETRYABLE``): an open failure of the
        server (a quarantine at once when it makes ``QUARANTINE_STRIKES`` jobs in a row
        there with no success), and the job tried at once on another server that may run
        it, or after its backoff once it failed on each."""
        failing = self._failing.setdefault(server, [])
        if item.job.id not in failing:
            failing.append(item.job.id)
        record = self.pool.health.get(server)
        if record is not None and record.state == "trial":
            # Its one job after a cool-down: a failure there is its own, whatever it is
            # (nobody may render to judge it when every server is sick).
            failing.clear()
            summary = f"its job after a cool-down failed ({failure.summary})"
            failure = dataclasses.replace(failure, summary=summary)
            await self._server_failed(item, server, failure, infrastructure=True)
        elif len(failing) >= QUARANTINE_STRIKES:
            summary = (
                f"{len(failing)} jobs in a row failed here, none rendered between "
                f"(last: {failure.summary})"
            )
            failing.clear()
            failure = dataclasses.replace(failure, summary=summary)
            await self._server_failed(item, server, failure, infrastructure=True)
        else:
            await self._server_failed(item, server, failure)
        others = self._others(item, server)
        if not others:
            return r, False
        reason = f"{r.reason}; trying another server ({', '.join(others)} can run it)"
        return dataclasses.replace(r, reason=reason), True

    async def sick_farm(self, item: Item) -> str | None:
        """Why ``item``, out of attempts with failures never the job's alone, stays
        pending: every server that can run it is quarantined now (nothing says the
        failures are the job's); else None."""
        failure = next(reversed(item.failed_on.values()), None)
        if failure is None or failure.kind not in RETRYABLE | SERVERS_AT_ONCE:
            return None
        await self.pool.read_health()
        pool, needs = self.pool, self.queue.needs(item)
        blocked = {
            s.name: pool.blocked(s.name) for s in pool.servers if pool.lacks(s.name, needs) is None
        }
        if not blocked or any(why is None for why in blocked.values()):
            return None
        listed = "; ".join(f"{name} {why}" for name, why in blocked.items())
        return f"every server that can run it is quarantined ({listed})"

    async def _server_failed(
        self,
        item: Item,
        server: str,
        failure: Failure,
        *,
        infrastructure: bool = False,
        cooldown_s: float | None = None,
    ) -> None:
        """The job failed on ``server`` in a way that may be the server's: it goes
        elsewhere next, and the store counts it (``Store.server_failed``; quarantined for
        ``cooldown_s`` when given)."""
        item.failed_on[server] = failure
        job = item.job
        await self._health(
            self.store.server_failed,
            server,
            job.id,
            self._graph(item),
            failure.signature,
            failure.summary,
            infrastructure=infrastructure,
            cooldown_s=cooldown_s,
            about=job.id,
        )

    async def rendered(self, item: Item, server: str | None) -> None:
        """The job rendered on ``server``: the failures it had elsewhere are those
        servers' (strikes), and ``server`` has a success (re-admitted from trial). The
        store is written only when that changes something."""
        if server is None:
            return
        self._failing.pop(server, None)
        self._unhashed[item.job.workflow_sha256] = item.job.workflow
        if len(self._unhashed) > UNHASHED_KEPT:
            self._fold_unhashed()
        graph = self._graph(item) if self._learned_graphs else ""
        if graph in self._learned_graphs:
            # It was taken for a workflow that fails everywhere (two sick servers failed
            # it alike): it is not, and its next failures are judged anew.
            self._learned_graphs.discard(graph)
            await self.threads.call(self.store.unlearn_workflow, graph)
        health = self.pool.health
        # The pool holds the store's records (``ServerHealthRecord``), strikes and all.
        record = cast("ServerHealthRecord | None", health.get(server))
        busy = record is not None and (record.strikes or record.level or record.state != "ok")
        # An open failure of this job may come from an earlier run (its Item is new).
        judging = any(r.open_failures for r in health.values())
        if not item.failed_on and not busy and not judging:
            return
        await self._health(self.store.job_rendered, server, item.job.id, about=item.job.id)

    async def unjudged(self, item: Item) -> None:
        """The job ended without a verdict on its open failures (a dead letter for
        another reason, given up): they no longer hold their servers back."""
        if item.failed_on:
            await self._health(self.store.job_unjudged, item.job.id)

    def quarantined_group(self, group: Needs) -> str | None:
        """Why the jobs of ``group`` wait for no good reason any more: every server that
        can run them is quarantined, for ``unreachable_timeout_s`` already or with no
        cool-down ending within it; else None (they wait, or need not)."""
        pool = self.pool
        capable = [s.name for s in pool.servers if pool.lacks(s.name, group) is None]
        blocked = {name: pool.blocked(name) for name in capable}
        if not capable or any(why is None for why in blocked.values()):
            self._blocked_groups.pop(group, None)
            return None
        limit = self.config.unreachable_timeout_s
        if limit is None:
            return None  # the worker waits for ever: a cool-down ends
        now = time.monotonic()
        waited = now - self._blocked_groups.setdefault(group, now)
        ends = [pool.health[n].until for n in capable if n in pool.health]
        soonest = min((e for e in ends if e is not None), default=None)
        late = soonest is not None and soonest - self.store.now() > limit - waited
        if waited < limit and not late:
            return None
        listed = "; ".join(f"{name} {why}" for name, why in blocked.items())
        return f"every server that can run it is quarantined ({listed})"

    async def _health(
        self, call: Callable[..., Any], *args: Any, about: str = "", **kwargs: Any
    ) -> None:
        """A write to the servers' health; its changes of state are said (a line, and an
        event of job ``about``, whose attempt caused them), and the pool reads the health
        again before its next choice."""
        changes = await self.threads.call(call, *args, **kwargs)
        self.pool.health_changed()
        if isinstance(changes, HealthChange):
            changes = [changes]
        for change in changes or []:
            text = f"server {change.server} {change.detail}"
            self.report(text)
            if about:
                await self.threads.call(self.store.note, about, text, server=change.server)
