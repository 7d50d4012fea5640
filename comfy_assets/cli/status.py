"""``comfy-assets status --store DIR [--db-url URL] [--partition P] [--json]``: per
partition its jobs by state, the jobs left by reason and its estimate; per server what it
renders now or why it is not used; with ``--partition``, every job not done with the one
reason it waits.

Read from the store only, in one snapshot (``Store.status_snapshot``): the jobs' rows,
the owners' heartbeats, and what each running batch writes there every few seconds
(``store/live.py``, ``render/publish.py``); the servers' leases and health besides. What
each server does is settled first (``cli/status_servers.py``), and a job renders only on
the server that says so, so the lines of one output agree. A job's reason is one of
``REASONS``, each naming what it waits for:

- ``rendering``: its prompt on a server now (which, since when, how far);
- ``finishing``: its prompt has left its server; its outputs are being downloaded and its
  result recorded;
- ``waiting for a server``: which servers can run it and what they do now;
- ``waiting for a server holding its model``: the servers that hold the model files its
  workflow names are busy, and a load elsewhere would not be sooner (``pool/plan.py``);
- ``waiting for its upstream job``: the job it continues from (its id and state);
- ``in backoff``: until when, after which failure;
- ``claimed by another process``: its owner, host and heartbeat age;
- ``no server can run it``: the reason it was dead-lettered for;
- ``every server that can run it is quarantined``: which;
- ``dead-lettered``: failed for good (requeue it to run again), with the reason;
- ``not in a running batch``: no run holds its partition now (a run, or a worker's
  queue, brings it; workers write no status rows), or the run of its partition let it go
  and does not take it up again (requeued after that run dead-lettered it, say).

A partition's ``waiting`` counts its jobs left (neither done nor dead-lettered) by these
reasons, so its numbers add up to the jobs left. With ``--partition``, a job's line says
its reason and what it waits for (``job ID: reason: detail``); jobs that wait for the same
thing are listed under one line saying it (``reason (N jobs): detail``), their ids indented.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from comfy_assets.cli.options import add_command
from comfy_assets.cli.run import EXISTING_STORE_HELP, add_store_options, open_store
from comfy_assets.cli.status_servers import FINISHING, RENDERING, alive, servers
from comfy_assets.render.eta import format_left
from comfy_assets.store import JobRecord, OwnerRecord, Store
from comfy_assets.store.live import LiveRow
from comfy_assets.store.owners import owner_of

REASONS = (
    RENDERING,
    FINISHING,
    "waiting for a server",
    "waiting for a server holding its model",
    "waiting for its upstream job",
    "in backoff",
    "claimed by another process",
    "no server can run it",
    "every server that can run it is quarantined",
    "dead-lettered",
    "not in a running batch",
)
_DONE = ("succeeded", "degraded")


def add_status_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``status`` on the ``comfy-assets`` subparsers."""
    p = add_command(
        sub,
        "status",
        "per partition its jobs by state and time left; per server what it renders; "
        "with --partition, why each job not done waits",
    )
    add_store_options(p, help=EXISTING_STORE_HELP, retry=False)
    p.add_argument("--partition", help="every job of this partition not done, with its reason")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=status_command)


def status_command(args: argparse.Namespace) -> int:
    """Print the status. Exit 0; 1 for an unknown ``--partition`` (or a store that
    fails); 2 for no store under ``--store``."""
    store = open_store(args, existing=True)
    if isinstance(store, int):
        return store
    try:
        report = gather(store, args.partition)
    finally:
        store.close()
    if report is None:
        print(f"error: no partition {args.partition!r} in the store", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for line in lines(report):
            print(line)
    return 0


def partition_command(args: argparse.Namespace, partition: str) -> str | None:
    """``comfy-assets status --store S [--db-url URL] --partition P`` for the store of
    ``args`` (a command's ``add_store_options``): ``--db-url`` when given otherwise than
    by ``$COMFY_ASSETS_DB_URL``; None when that URL holds a password (not for a line)."""
    import shlex

    from sqlalchemy import make_url

    from comfy_assets.store.store import DB_URL_ENV

    db = ""
    if args.db_url and args.db_url != os.environ.get(DB_URL_ENV):
        if make_url(args.db_url).password is not None:
            return None
        db = f" --db-url {shlex.quote(args.db_url)}"
    where = shlex.quote(str(args.store))
    return f"comfy-assets status --store {where}{db} --partition {shlex.quote(partition)}"


def dead_letters_where(args: argparse.Namespace, results: str | None, partition: str) -> str:
    """Where the dead letters of ``partition`` are read, every one, for ``run``'s line:
    ``results`` (results.csv, None when not written) and ``status --partition``
    (``partition_command``)."""
    status = partition_command(args, partition)
    where = [f"every one is in results.csv at {results}"] if results else []
    where += [f"`{status}` lists every one by reason"] if status else []
    return "; ".join(where) or "results.csv was not written (below)"


def gather(store: Store, partition: str | None = None) -> dict[str, Any] | None:
    """The status as one JSON-ready object (``--json`` prints it): ``partitions`` (each
    ``partition``, ``states``, ``estimate_s``, ``waiting`` and ``owner``, the same keys
    whether a batch runs it or not), ``servers`` (``cli/status_servers.py``) and, with
    ``partition``, ``jobs``, and ``jobs_not_listed`` (``count``, ``reason``,
    ``detail``) when the partition has more pending jobs nobody claims than the store
    reads (``store.live.PLAIN_LISTED``): they all wait alike; None for an unknown
    ``partition``."""
    snap = store.status_snapshot(partition)
    if partition is not None and partition not in snap.counts:
        return None
    owners = {o.owner: o for o in snap.owners}
    parts = {r.subject: r for r in snap.live if r.kind == "partition"}
    entries, where = servers(snap, store.server_health(), store.server_leases())
    by_name = {e["server"]: e for e in entries}
    report: dict[str, Any] = {"partitions": [], "servers": entries}
    by_partition: dict[str, dict[str, JobRecord]] = {}
    for rec in snap.jobs:
        by_partition.setdefault(rec.partition, {})[rec.job_id] = rec
    for name in sorted(snap.counts):
        row = parts.get(name)
        look = _Look(row, by_name, where, by_partition.get(name, {}), owners)
        jobs = _jobs(store, look, details=name == partition)
        left = Counter(j["reason"] for j in jobs if j["state"] != "failed_fatal")
        # Pending jobs nobody claims and no row names, not read (a big partition's
        # line): they all wait alike.
        read = sum(1 for r in look.records.values() if r.state == "pending" and not r.claimed_by)
        unlisted = snap.plain.get(name, 0) - read
        if unlisted > 0:
            reason, detail = _unlisted_reason(name, look)
            left[reason] += unlisted
            if name == partition:
                report["jobs_not_listed"] = {"count": unlisted, "reason": reason, "detail": detail}
        estimate = row.detail.get("estimate_s") if row is not None else None
        if isinstance(estimate, int | float) and row is not None:
            estimate = max(estimate - row.age_s, 0.0)  # the batch wrote it age_s ago
        report["partitions"].append(
            {
                "partition": name,
                "states": snap.counts[name],
                "estimate_s": estimate,
                "waiting": {why: left[why] for why in REASONS if left[why]},
                "owner": row.owner if row is not None else None,
            }
        )
        if name == partition:
            report["jobs"] = jobs
    return report


@dataclass(eq=False)
class _Look:
    """What one partition's reasons are read from: its running batch's row (None: no
    batch runs it), the servers by name, where the jobs on a server are
    (``cli/status_servers.py``), its jobs not done by id, and the owners by name."""

    row: LiveRow | None
    servers: dict[str, dict[str, Any]]
    where: dict[str, tuple[str, str]]
    records: dict[str, JobRecord]
    owners: dict[str, OwnerRecord]
    held: dict[str, dict[str, Any]] = field(init=False, repr=False)
    # The state of an upstream job done since.
    upstream: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    group_of: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        detail = self.row.detail if self.row is not None else {}
        self.held = detail.get("held") or {}
        for g in detail.get("groups") or []:
            for job_id in g.get("jobs") or []:
                self.group_of[job_id] = g


def _jobs(store: Store, look: _Look, *, details: bool) -> list[dict[str, Any]]:
    """Every job of ``look`` not done with its reason; ``details``: name the failure a
    job in backoff waits after (one store read per such job)."""
    if details:
        for job_id, h in look.held.items():
            if h.get("reason") == "in backoff" and job_id in look.records:
                tries = store.attempts(job_id)
                where = f" on {tries[-1].server}" if tries and tries[-1].server else ""
                h["after"] = (
                    f"attempt {tries[-1].attempt}{where}: {tries[-1].reason}" if tries else None
                )
            elif h.get("reason") == "upstream":
                for up in h.get("upstream") or []:
                    if up not in look.records and up not in look.upstream:
                        found = store.get(up)  # done since: the snapshot has jobs not done
                        look.upstream[up] = found.state if found else "not in the store"
    out = []
    for rec in look.records.values():
        if rec.state in _DONE:
            continue
        reason, what = _reason(rec, look)
        out.append({"job_id": rec.job_id, "state": rec.state, "reason": reason, "detail": what})
    return out


def _reason(rec: JobRecord, look: _Look) -> tuple[str, str]:
    """(one of REASONS, what it waits for) for a job not done."""
    if rec.state == "failed_fatal":
        return _dead_lettered(rec)
    if rec.job_id in look.where:
        return _on_server(rec, look)
    for why in (_claimed_elsewhere, _outside_batch, _held, _waiting_in_group):
        found = why(rec, look)
        if found is not None:
            return found
    return "waiting for a server", "in line"


def _unlisted_reason(partition: str, look: _Look) -> tuple[str, str]:
    """(reason, what it waits for) of a pending job of ``partition`` nobody claims and
    no row of its batch names: ``_reason`` of such a job."""
    if look.row is None:
        return "not in a running batch", (
            f"no running batch holds partition {partition} (a run, or a worker's queue, brings it)"
        )
    return "waiting for a server", "in line"


def _dead_lettered(rec: JobRecord) -> tuple[str, str]:
    """A job in the dead letter: no server could run it, or its attempts ran out."""
    text = rec.reason or "no reason recorded"
    if text.startswith("no server"):
        return "no server can run it", text
    return "dead-lettered", f"{text}; requeue it to run again"


def _on_server(rec: JobRecord, look: _Look) -> tuple[str, str]:
    """A job whose prompt is on a server: rendering, finishing, or its server gone."""
    what, name = look.where[rec.job_id]
    s = look.servers.get(name, {})
    if s.get("state") == "unreachable":  # its prompt's server died under it, say
        return "waiting for a server", (
            f"its prompt went to {name}, unreachable now ({s.get('reason')}): it is "
            "asked there again before the job is posted elsewhere"
        )
    if what == FINISHING:
        return FINISHING, (
            f"its prompt left {name}; its outputs are being downloaded and its result recorded"
        )
    row = look.row
    who = "" if row is not None and s.get("owner") == row.owner else f", for {s.get('owner')}"
    how_far = s.get("progress") or "no progress known here"
    return RENDERING, f"on {name} since {_clock(s.get('since'))}, {how_far}{who}"


def _claimed_elsewhere(rec: JobRecord, look: _Look) -> tuple[str, str] | None:
    """A job another live process claims."""
    row = look.row
    if not rec.claimed_by or (row is not None and owner_of(rec.claimed_by) == row.owner):
        return None
    if not alive(look.owners, rec.claimed_by):
        return None
    o = look.owners[owner_of(rec.claimed_by)]
    return "claimed by another process", (
        f"owner {o.owner} on {o.host} (pid {o.pid}), heartbeat {o.beat_age_s:.0f} s ago"
    )


def _outside_batch(rec: JobRecord, look: _Look) -> tuple[str, str] | None:
    """A job no running batch holds, or one the running batch let go."""
    row = look.row
    if row is None:
        return "not in a running batch", (
            f"no running batch holds partition {rec.partition} (a run, or a worker's "
            "queue, brings it)"
        )
    how = (row.detail.get("let_go") or {}).get(rec.job_id)
    if how in ("dead_lettered", "degraded"):
        done = "dead-lettered" if how == "dead_lettered" else "degraded"
        return "not in a running batch", (
            f"the running batch of partition {rec.partition} {done} it, and it was requeued "
            "since: that batch does not take it up again; the next run of the partition "
            "renders it"
        )
    if how is not None:
        return "not in a running batch", (
            f"the running batch of partition {rec.partition} let it go without running it "
            "(its lines say why); the next run of the partition runs it"
        )
    return None


def _held(rec: JobRecord, look: _Look) -> tuple[str, str] | None:
    """A job the running batch holds back: for its upstream, a catch-up, or a backoff."""
    h = look.held.get(rec.job_id)
    if h is None:
        return None
    if h.get("reason") == "upstream":
        ups = [
            f"{u} ({look.records[u].state if u in look.records else look.upstream.get(u, '?')})"
            for u in h.get("upstream") or []
        ]
        return "waiting for its upstream job", ", ".join(ups)
    if h.get("reason") == "catch-up":
        return "waiting for a server", (
            f"its prompt went to {h.get('server')}, which does not answer: asked there again "
            f"until {_clock(h.get('until'))}, then posted anew (it may render twice)"
        )
    if h.get("reason") == "in backoff":
        after = h.get("after") or rec.reason or "a failed attempt"
        return "in backoff", f"until {_clock(h.get('until'))}, after: {after}"
    return None


def _waiting_in_group(rec: JobRecord, look: _Look) -> tuple[str, str] | None:
    """A job waiting for a server of its group (the servers that can run it)."""
    g = look.group_of.get(rec.job_id)
    if g is None:
        return None
    servers = look.servers
    able = g.get("servers") or []
    if not able:
        return "no server can run it", "none of the pool's servers has its nodes and models"
    if all(servers.get(s, {}).get("state") == "quarantined" for s in able):
        return "every server that can run it is quarantined", ", ".join(able)
    holding = g.get("holding") or []
    doing = "; ".join(f"{s} {_doing(servers.get(s))}" for s in able)
    if holding and not any(servers.get(s, {}).get("state") == "free" for s in able):
        return "waiting for a server holding its model", (f"{', '.join(holding)} hold it; {doing}")
    return "waiting for a server", f"{', '.join(able)} can run it; {doing}"


def _doing(server: dict[str, Any] | None) -> str:
    if server is None:
        return "not seen"
    state = server.get("state")
    if state == RENDERING:
        how_far = server.get("progress") or "no progress known here"
        return f"renders job {str(server.get('job'))[:8]} ({how_far})"
    if state == "unreachable":
        return f"unreachable ({server.get('reason')})"
    if state in ("quarantined", "trial"):
        reason = str(server.get("reason"))
        # The store's words already start with the state ("quarantined until 12:04:10").
        return reason if reason.startswith(("quarantined", "on trial")) else f"{state} ({reason})"
    if state == "busy":
        return f"runs another client's queue ({server.get('foreign_queue')} prompts)"
    if state == "idle":
        return "not used by a running batch"
    return str(state)


def _clock(epoch: object) -> str:
    if not isinstance(epoch, int | float):
        return "?"
    ago = time.time() - epoch
    when = time.strftime("%H:%M:%S", time.localtime(epoch))
    return f"{when} ({abs(ago):.0f} s {'ago' if ago >= 0 else 'from now'})"


def lines(report: dict[str, Any]) -> list[str]:
    """The report as lines for people."""
    out = []
    for p in report["partitions"]:
        states = p["states"]
        total = sum(states.values())
        done = sum(states.get(s, 0) for s in _DONE)
        by_state = ", ".join(f"{n} {s}" for s, n in sorted(states.items()) if n)
        text = f"partition {p['partition']}: {by_state or 'no jobs'}; {done}/{total} done"
        left = total - done - states.get("failed_fatal", 0)
        text += f", {left} left"
        if p.get("estimate_s") is not None and left:
            text += ", " + format_left(p["estimate_s"])
        waiting = p.get("waiting") or {}
        if waiting:
            text += " (" + ", ".join(f"{n} {why}" for why, n in waiting.items()) + ")"
        out.append(text)
    for s in report["servers"]:
        state = s.get("state")
        if state == RENDERING:
            out.append(
                f"server {s['server']}: renders job {s.get('job')} of {s.get('partition')} "
                f"since {_clock(s.get('since'))}, {s.get('progress') or 'no progress known here'}"
            )
        elif state == "held":
            out.append(f"server {s['server']}: held by {s.get('owner')} on {s.get('host')}")
        elif state == "idle":
            out.append(f"server {s['server']}: not used: no running batch uses it")
        elif state == "free":
            out.append(f"server {s['server']}: free")
        elif state == "trial" and not s.get("blocked"):
            out.append(f"server {s['server']}: {_doing(s)}")  # it takes its one trial job
        else:
            out.append(f"server {s['server']}: not used: {_doing(s)}")
    return out + _job_lines(report)


def _job_lines(report: dict[str, Any]) -> list[str]:
    """The lines of ``report``'s jobs not done (with ``--partition``), by cause."""
    out = []
    counted = Counter(j["reason"] for j in report.get("jobs", []))
    unlisted = report.get("jobs_not_listed")
    if unlisted:
        counted[unlisted["reason"]] += unlisted["count"]
    if "jobs" in report:
        summary = ", ".join(f"{counted[why]} {why}" for why in REASONS if counted[why])
        total = len(report["jobs"]) + (unlisted["count"] if unlisted else 0)
        out.append(f"{total} jobs not done" + (f": {summary}" if summary else ""))
    # A cause several jobs share (the servers' state, say) is said once, their ids under it.
    causes: dict[tuple[str, str], list[str]] = {}
    for j in report.get("jobs", []):
        causes.setdefault((j["reason"], j["detail"]), []).append(j["job_id"])
    for (reason, detail), ids in causes.items():
        if len(ids) == 1:
            out.append(f"job {ids[0]}: {reason}: {detail}")
        else:
            out.append(f"{reason} ({len(ids)} jobs): {detail}")
            out.extend(f"  job {job_id}" for job_id in ids)
    if unlisted:
        out.append(
            f"{unlisted['reason']} ({unlisted['count']} more jobs, not listed): "
            f"{unlisted['detail']}"
        )
    return out
