"""What each server does now, for ``comfy-assets status``: which job's prompt it renders,
or why it is not used, and which jobs' prompts have left it (their outputs still being
downloaded).

Two sources say what a server does, neither alone enough: the jobs' rows (a job moves to
``submitted`` with its server before its POST, and stays ``submitted`` or ``rendering``
until its result is recorded, downloads included) and the rows each running batch
writes every few seconds (``render/publish.py``: the prompt on each server of its pool,
with how far it is). A server renders the newest job on it by the store whose holder is
alive, unless that holder's batch looked at the server after the job's last move and saw
no prompt of that job there; every other job on it by the store has had its prompt end.
So one job at most renders on a server, and a server line and the job lines of one
output agree. A server rendering nothing reads as its store health says (quarantined, on
trial), else as its batch saw it, else as its lease says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from comfy_assets.jobs.states import IN_FLIGHT
from comfy_assets.render.steering import FINISHING, RENDERING
from comfy_assets.store import JobRecord, OwnerRecord, ServerLease
from comfy_assets.store.health import ServerHealthRecord
from comfy_assets.store.live import LiveRow, StatusSnapshot
from comfy_assets.store.owners import owner_of


def alive(owners: Mapping[str, OwnerRecord], claimed_by: str | None) -> bool:
    """Whether the holder of a claim (``claimed_by``) is a process that still runs."""
    if not claimed_by:
        return False
    o = owners.get(owner_of(claimed_by))
    return o is not None and not o.gone and o.released_at is None


def servers(
    snap: StatusSnapshot,
    health: Mapping[str, ServerHealthRecord],
    leases: Mapping[str, ServerLease],
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """(one entry per server, by name; where the jobs on a server by the store are:
    ``{job_id: ("rendering" | "finishing", server)}``). An entry is ``{"server",
    "state"}`` with, for ``rendering``: ``job``, ``partition``, ``since`` (epoch
    seconds), ``progress`` (None when not known here) and ``owner``; for ``quarantined``
    and ``trial``: ``reason``, ``until`` and ``blocked`` (why it takes no job, or None);
    for ``unreachable``: ``reason``; for ``busy``: ``foreign_queue``; for ``held``:
    ``owner`` and ``host``; ``free`` and ``idle`` (no running batch uses it) alone."""
    owners = {o.owner: o for o in snap.owners}
    rows: dict[str, dict[str, LiveRow]] = {}  # server -> owner -> its batch's row
    for r in snap.live:
        if r.kind == "server":
            rows.setdefault(r.subject, {})[r.owner] = r
    on: dict[str, list[JobRecord]] = {}
    for rec in snap.jobs:
        if rec.state in IN_FLIGHT and rec.server and alive(owners, rec.claimed_by):
            on.setdefault(rec.server, []).append(rec)
    where: dict[str, tuple[str, str]] = {}
    entries = []
    for name in sorted(set(rows) | set(on) | set(leases) | set(health)):
        seen = rows.get(name, {})
        current = None
        for rec in sorted(on.get(name, []), key=lambda r: r.updated_at, reverse=True):
            if current is None and _renders(snap, seen.get(owner_of(rec.claimed_by or "")), rec):
                current = rec
                where[rec.job_id] = (RENDERING, name)
            else:
                where[rec.job_id] = (FINISHING, name)
        if current is not None:
            entry = _rendering(current, seen.get(owner_of(current.claimed_by or "")))
        else:
            entry = _not_rendering(snap, name, seen, health.get(name), leases.get(name), owners)
        entries.append({"server": name, **entry})
    return entries, where


def _renders(snap: StatusSnapshot, row: LiveRow | None, rec: JobRecord) -> bool:
    """Whether ``rec``'s prompt may be on its server still: its batch's row for that
    server (``row``) names it, or was written before the job's last move (or there is
    none: its holder has written no row yet)."""
    if row is None:
        return True
    if row.detail.get("state") == RENDERING and row.detail.get("job") == rec.job_id:
        return True
    return rec.updated_at > snap.now - row.age_s


def _rendering(rec: JobRecord, row: LiveRow | None) -> dict[str, Any]:
    said = row is not None and row.detail.get("job") == rec.job_id
    detail = row.detail if row is not None and said else {}
    return {
        "state": RENDERING,
        "job": rec.job_id,
        "partition": rec.partition,
        # Without the batch's word: the job's last move (its submit, or its POST's answer).
        "since": detail.get("since") or rec.updated_at,
        "progress": detail.get("progress"),
        "owner": owner_of(rec.claimed_by or ""),
    }


def _not_rendering(
    snap: StatusSnapshot,
    name: str,
    seen: Mapping[str, LiveRow],
    record: ServerHealthRecord | None,
    lease: ServerLease | None,
    owners: Mapping[str, OwnerRecord],
) -> dict[str, Any]:
    if record is not None and record.state in ("quarantined", "trial"):
        return {
            "state": record.state,
            "reason": record.line().removeprefix(f"{name} "),
            "until": record.until,
            "blocked": record.blocked(),
        }
    if seen:
        newest = min(seen.values(), key=lambda r: r.age_s)
        if newest.detail.get("state") == RENDERING:
            # The job it named is on no server by the store any more: its prompt ended.
            return {"state": "free"}
        keep = ("state", "reason", "foreign_queue")
        entry = {k: v for k, v in newest.detail.items() if k in keep}
        if entry.get("state") == "trial":  # its pool takes no job there: its trial job failed
            entry["blocked"] = entry.get("reason")
        return entry
    if lease is not None and lease.owner and lease.expires_at and lease.expires_at > snap.now:
        o = owners.get(lease.owner)
        return {"state": "held", "owner": lease.owner, "host": o.host if o else None}
    return {"state": "idle"}
