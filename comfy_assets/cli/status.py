"""``comfy-assets status --store DIR [--db-url URL] [--partition P] [--json]``: per
partition its jobs by state and its estimate; per server what it renders now or why it
is not used; with ``--partition``, every job not done with the one reason it waits.

Read from the store only: the jobs' rows, the owners' heartbeats, the server leases and
what each running batch writes there every few seconds (``store/live.py``,
``render/publish.py``). A job's reason is one of ``REASONS``, each naming what it waits
for:

- ``rendering``: on a server now (which, since when, how far);
- ``waiting for a server``: which servers can run it and what they do now;
- ``waiting for a server holding its model``: the servers that hold the model files its
  workflow names are busy, and a load elsewhere would not be sooner (``comfy/plan.py``);
- ``waiting for its upstream job``: the job it continues from (its id and state);
- ``in backoff``: until when, after which failure;
- ``claimed by another process``: its owner, host and heartbeat age;
- ``no server can run it``: the reason it was dead-lettered for;
- ``every server that can run it is quarantined``: which;
- ``dead-lettered``: failed for good (requeue it to run again), with the reason;
- ``not in a running batch``: no run holds its partition now (a run, or a worker's
  queue, brings it; workers write no status rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

from comfy_assets.cli.run import EXISTING_STORE_HELP, add_store_options, open_store
from comfy_assets.render.eta import format_left
from comfy_assets.store import JobRecord, OwnerRecord, Store
from comfy_assets.store.live import LiveRow
from comfy_assets.store.owners import owner_of

REASONS = (
    "rendering",
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
    p = sub.add_parser(
        "status",
        help="per partition its jobs by state and time left; per server what it renders; "
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


def gather(store: Store, partition: str | None = None) -> dict[str, Any] | None:
    """The status as one JSON-ready object (``--json`` prints it): ``partitions`` (each
    ``partition``, ``states``, ``estimate_s``, ``waiting`` and ``owner``, the same keys
    whether a batch runs it or not: None and empty when none does), ``servers`` and,
    with ``partition``, ``jobs``; None for an unknown ``partition``."""
    live = store.live()
    owners = {o.owner: o for o in store.owners()}
    parts = {r.subject: r for r in live if r.kind == "partition"}
    names = store.partitions()
    if partition is not None and partition not in names:
        return None
    report: dict[str, Any] = {"partitions": [], "servers": []}
    for name in [partition] if partition else names:
        counts = store.counts(name)
        row = parts.get(name)
        entry: dict[str, Any] = {
            "partition": name,
            "states": counts,
            "estimate_s": None,
            "waiting": {},
            "owner": None,
        }
        if row is not None:
            d = row.detail
            entry.update(
                estimate_s=d.get("estimate_s"), waiting=d.get("waiting") or {}, owner=row.owner
            )
        report["partitions"].append(entry)
    report["servers"] = _servers(store, live, owners)
    if partition is not None:
        report["jobs"] = _jobs(store, partition, parts.get(partition), live, owners)
    return report


def _servers(
    store: Store, live: list[LiveRow], owners: dict[str, OwnerRecord]
) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for r in live:
        if r.kind != "server":
            continue
        row = {"server": r.subject, **r.detail, "seen_by": r.owner}
        # A server rendering for one batch is "free" or "busy" for the others.
        if r.subject not in seen or row.get("state") == "rendering":
            seen[r.subject] = row
    for name, lease in store.server_leases().items():
        if name in seen:
            continue
        if lease.owner and lease.expires_at and lease.expires_at > store.now():
            o = owners.get(lease.owner)
            seen[name] = {"state": "held", "owner": lease.owner, "host": o.host if o else None}
        else:
            seen[name] = {"state": "idle"}
        seen[name]["server"] = name
    return [seen[n] for n in sorted(seen)]


def _jobs(
    store: Store,
    partition: str,
    row: LiveRow | None,
    live: list[LiveRow],
    owners: dict[str, OwnerRecord],
) -> list[dict[str, Any]]:
    detail = row.detail if row is not None else {}
    held = detail.get("held") or {}
    group_of: dict[str, dict[str, Any]] = {}
    for g in detail.get("groups") or []:
        for job_id in g.get("jobs") or []:
            group_of[job_id] = g
    servers = {r.subject: r.detail for r in live if r.kind == "server"}
    rendering_on = {
        d.get("job"): (name, d) for name, d in servers.items() if d.get("state") == "rendering"
    }
    records = {r.job_id: r for r in store.jobs(partition)}
    for job_id, h in held.items():
        if h.get("reason") == "in backoff" and job_id in records:
            tries = store.attempts(job_id)
            where = f" on {tries[-1].server}" if tries and tries[-1].server else ""
            h["after"] = (
                f"attempt {tries[-1].attempt}{where}: {tries[-1].reason}" if tries else None
            )
    out = []
    for rec in records.values():
        if rec.state in _DONE:
            continue
        reason, what = _reason(rec, row, held, group_of, servers, rendering_on, records, owners)
        out.append({"job_id": rec.job_id, "state": rec.state, "reason": reason, "detail": what})
    return out


def _reason(
    rec: JobRecord,
    row: LiveRow | None,
    held: dict[str, Any],
    group_of: dict[str, dict[str, Any]],
    servers: dict[str, dict[str, Any]],
    rendering_on: dict[str, tuple[str, dict[str, Any]]],
    records: dict[str, JobRecord],
    owners: dict[str, OwnerRecord],
) -> tuple[str, str]:
    """(one of REASONS, what it waits for) for a job not done."""
    if rec.state == "failed_fatal":
        text = rec.reason or "no reason recorded"
        if text.startswith("no server"):
            return "no server can run it", text
        return "dead-lettered", f"{text}; requeue it to run again"
    if rec.job_id in rendering_on:
        name, d = rendering_on[rec.job_id]
        return "rendering", f"on {name} since {_clock(d.get('since'))}, {d.get('progress')}"
    if rec.state in ("submitted", "rendering") and rec.server:
        who = f", for {owner_of(rec.claimed_by)}" if rec.claimed_by else ""
        return "rendering", f"on {rec.server} (no progress known here{who})"
    if rec.claimed_by and (row is None or owner_of(rec.claimed_by) != row.owner):
        o = owners.get(owner_of(rec.claimed_by))
        if o is not None and not o.gone:
            return "claimed by another process", (
                f"owner {o.owner} on {o.host} (pid {o.pid}), heartbeat {o.beat_age_s:.0f} s ago"
            )
    if row is None:
        return "not in a running batch", (
            f"no running batch holds partition {rec.partition} (a run, or a worker's "
            "queue, brings it)"
        )
    h = held.get(rec.job_id)
    if h is not None and h.get("reason") == "upstream":
        ups = [
            f"{u} ({records[u].state if u in records else 'not in this partition'})"
            for u in h.get("upstream") or []
        ]
        return "waiting for its upstream job", ", ".join(ups)
    if h is not None and h.get("reason") == "in backoff":
        after = h.get("after") or rec.reason or "a failed attempt"
        return "in backoff", f"until {_clock(h.get('until'))}, after: {after}"
    g = group_of.get(rec.job_id)
    if g is not None:
        able = g.get("servers") or []
        if not able:
            return "no server can run it", "none of the pool's servers has its nodes and models"
        if all(servers.get(s, {}).get("state") == "quarantined" for s in able):
            return "every server that can run it is quarantined", ", ".join(able)
        holding = g.get("holding") or []
        doing = "; ".join(f"{s} {_doing(servers.get(s))}" for s in able)
        if holding and not any(servers.get(s, {}).get("state") == "free" for s in able):
            return "waiting for a server holding its model", (
                f"{', '.join(holding)} hold it; {doing}"
            )
        return "waiting for a server", f"{', '.join(able)} can run it; {doing}"
    return "waiting for a server", "in line"


def _doing(server: dict[str, Any] | None) -> str:
    if server is None:
        return "not seen"
    state = server.get("state")
    if state == "rendering":
        return f"renders job {str(server.get('job'))[:8]} ({server.get('progress')})"
    if state == "unreachable":
        return f"unreachable ({server.get('reason')})"
    if state == "quarantined":
        return f"quarantined ({server.get('reason')})"
    if state == "busy":
        return f"runs another client's queue ({server.get('foreign_queue')} prompts)"
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
        if state == "rendering":
            out.append(
                f"server {s['server']}: renders job {s.get('job')} of {s.get('partition')} "
                f"since {_clock(s.get('since'))}, {s.get('progress')}"
            )
        elif state == "held":
            out.append(f"server {s['server']}: held by {s.get('owner')} on {s.get('host')}")
        elif state == "idle":
            out.append(f"server {s['server']}: not used: no running batch uses it")
        elif state == "free":
            out.append(f"server {s['server']}: free")
        else:
            out.append(f"server {s['server']}: not used: {_doing(s)}")
    counted = Counter(j["reason"] for j in report.get("jobs", []))
    if "jobs" in report:
        summary = ", ".join(f"{n} {why}" for why, n in counted.items())
        out.append(f"{len(report['jobs'])} jobs not done" + (f": {summary}" if summary else ""))
    for j in report.get("jobs", []):
        out.append(f"job {j['job_id']}: {j['reason']}: {j['detail']}")
    return out
