"""Whose failure is this: the job's, or the server's it ran on (a part of ``Batch``).

Detected by the attempt (``render/attempt.py``: a ``Failure`` on its result), decided
here, answered for in the store (``store/health.py``: open failures, strikes,
quarantines, workflows known to fail):

- an **infrastructure** error (``comfy/infra.py``) is the server's at first sight: a
  strike against it (a quarantine), and the job tries another server at once;
- an ordinary **execution_error** may be either's, so a second server judges it: the job
  is tried next on a server it has not failed on, at once, and is a dead letter only once
  it failed the same way on two servers (the workflow is then known to fail so: its other
  jobs failing that way are dead letters at their first failure), or on every server that
  can run it; its success elsewhere makes the failure the first server's;
- a **deadline** or a **lost** prompt keeps its backoff, and the next attempt goes to
  another server while one can run the job; a success there is a strike too.

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
from functools import lru_cache
from typing import Any

from comfy_assets.render.outcome import AttemptResult, Failure
from comfy_assets.render.queue import Item
from comfy_assets.store.health import HealthChange


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


class Ownership:
    """Judging an attempt's failure and telling the store (a part of ``Batch``)."""

    pool: Any
    store: Any
    queue: Any
    config: Any
    claims: Any
    _db: Any
    report: Any
    _resolve: Any
    # Per group of jobs: monotonic time every server able to run it was first seen
    # quarantined.
    _blocked_groups: dict[Any, float]

    def _init_ownership(self) -> None:
        self._blocked_groups = {}
        # Workflows (graph sha256) that rendered in this batch: none of them can be a
        # workflow that fails everywhere, whatever two servers said.
        self._rendered_graphs: set[str] = set()
        # Workflows this batch took (or learned) as known to fail: a success of one
        # unlearns it in the store.
        self._learned_graphs: set[str] = set()
        self._graphs: dict[str, str] = {}  # resolved workflow sha256 -> graph sha256
        # Workflows that rendered, by resolved sha256, not yet among ``_rendered_graphs``:
        # hashed only when a failure is judged, which most batches never need (the
        # batch's jobs hold these workflows anyway).
        self._unhashed: dict[str, dict[str, Any]] = {}

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
        for sha, workflow in self._unhashed.items():
            self._rendered_graphs.add(self._graph_of(sha, workflow))
        self._unhashed.clear()
        return graph in self._rendered_graphs

    async def _owned(self, item: Item, r: AttemptResult) -> tuple[AttemptResult, bool]:
        """The attempt's result once ownership is decided, and whether the job is tried
        again at once (elsewhere, no backoff). A result without a ``Failure`` is
        returned as it is."""
        failure, server = r.failure, r.server
        if failure is None or server is None or r.kind == "success":
            return r, False
        job = item.job
        if failure.kind == "infrastructure":
            await self._server_failed(item, server, failure, infrastructure=True)
            return r, True
        if failure.kind != "execution_error":  # a deadline, a lost prompt: backoff stands
            await self._server_failed(item, server, failure)
            return r, False
        graph = self._graph(item)
        rendered = self._has_rendered(graph)
        known = None
        if not rendered:
            known = await self._db(self.store.known_workflow_failure, graph, failure.signature)
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
        others = [
            s.name
            for s in self.pool.servers
            if s.name not in item.failed_on
            and s.name != server
            and self.pool.may_run(s.name, needs)
        ]
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

    async def _server_failed(
        self, item: Item, server: str, failure: Failure, *, infrastructure: bool = False
    ) -> None:
        """The job failed on ``server`` in a way that may be the server's: it goes
        elsewhere next, and the store counts it (``Store.server_failed``)."""
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
            about=job.id,
        )

    async def _rendered(self, item: Item, server: str | None) -> None:
        """The job rendered on ``server``: the failures it had elsewhere are those
        servers' (strikes), and ``server`` has a success (re-admitted from trial). The
        store is written only when that changes something."""
        if server is None:
            return
        self._unhashed[item.job.workflow_sha256] = item.job.workflow
        graph = self._graph(item) if self._learned_graphs else ""
        if graph in self._learned_graphs:
            # It was taken for a workflow that fails everywhere (two sick servers failed
            # it alike): it is not, and its next failures are judged anew.
            self._learned_graphs.discard(graph)
            await self._db(self.store.unlearn_workflow, graph)
        health = self.pool.health
        record = health.get(server)
        busy = record is not None and (record.strikes or record.level or record.state != "ok")
        # An open failure of this job may come from an earlier run (its Item is new).
        judging = any(r.open_failures for r in health.values())
        if not item.failed_on and not busy and not judging:
            return
        await self._health(self.store.job_rendered, server, item.job.id, about=item.job.id)

    async def _unjudged(self, item: Item) -> None:
        """The job ended without a verdict on its open failures (a dead letter for
        another reason, given up): they no longer hold their servers back."""
        if item.failed_on:
            await self._health(self.store.job_unjudged, item.job.id)

    def _quarantined_group(self, group: Any) -> str | None:
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

    async def _leave_quarantined(self) -> None:
        """The jobs waiting here for servers that are all quarantined (``_quarantined_
        group``) are not run in this batch: their claims are released, they stay pending
        for a later run, and a line says why."""
        for group in self.queue.groups():
            reason = self._quarantined_group(group)
            if reason is None:
                continue
            for item in self.queue.pop_all(group):
                if item.rec is not None:
                    self.claims.release(item.job.id)
                self.report(f"job {item.job.id}: not run, {reason}; it stays pending")
                self._resolve("not_run", item.job.id)

    async def _health(self, call: Any, *args: Any, about: str = "", **kwargs: Any) -> None:
        """A write to the servers' health; its changes of state are said (a line, and an
        event of job ``about``, whose attempt caused them), and the pool reads the health
        again before its next choice."""
        changes = await self._db(call, *args, **kwargs)
        self.pool.health_changed()
        if isinstance(changes, HealthChange):
            changes = [changes]
        for change in changes or []:
            text = f"server {change.server} {change.detail}"
            self.report(text)
            if about:
                await self._db(self.store.note, about, text, server=change.server)
