"""What must hold after a farm scenario, read from the store, the fakes' own records
(``/fake/stats``, ``/queue``), results.csv and the processes' output.

``collect(...)`` gathers a ``Snapshot`` once everything has ended; ``violations(snapshot)``
returns one line per broken invariant (empty: all hold). Each check is a function of
plain data, so a test can feed it a broken record:

- ``ended``: every job is done (a done state, with files) or dead-lettered with a reason;
- ``once``: a done job's prompt succeeded exactly once across every fake, on the server
  its done record names; a dead letter's at most once (both unless the job's events say
  why, as the campaign allows: ``EXCUSED``);
- ``one_at_a_time``: never two of our prompts at once on a server: none is posted while
  another is queued or executing there (the fake's posted/end times);
- ``nothing_queued``: nothing of ours queued or running on any fake at the end;
- ``results_rows``: results.csv has one row per job, in file order, with its state
  (checked when the snapshot has the CSV: ``comfy-assets run`` writes it);
- ``no_tracebacks``: no Python traceback in any process's output.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import DONE, FAILED_FATAL
from comfy_assets.store import Store
from tests.campaign.invariants import EXCUSED, TRACEBACK, overlapping_posts


@dataclass
class JobEnd:
    """A job as the store has it at the end."""

    job_id: str
    prompt_id: str
    state: str | None  # None: not in the store
    server: str | None = None
    reason: str | None = None
    files: int = 0
    details: list[str] = field(default_factory=list)  # its events' details


@dataclass
class Snapshot:
    """Everything the invariants read (see the module docstring)."""

    jobs: list[JobEnd]
    stats: dict[str, dict[str, Any]]  # server name -> /fake/stats
    queued: dict[str, list[str]]  # server name -> prompt_ids running or pending
    results: list[dict[str, str]] | None = None  # results.csv rows; None: not checked
    outputs: dict[str, str] = field(default_factory=dict)  # process name -> its output


def collect(
    farm: Any,
    store_root: Path,
    jobs_path: Path,
    *,
    partition: str | None = None,
    results_csv: bool = True,
    procs: list[Any] = (),  # type: ignore[assignment]
) -> Snapshot:
    """A ``Snapshot`` of ``farm`` (a ``Farm``) after the jobs of ``jobs_path`` ran on the
    store at ``store_root`` (its database the farm's); ``partition`` defaults to the file's
    stem; ``procs``: the processes whose output is checked."""
    job_file = load_job_file(jobs_path)
    partition = partition or jobs_path.stem
    jobs = []
    with Store(store_root, farm.local_db_url) as store:
        for job in job_file.jobs:
            record = store.get(job.id)
            if record is None:
                jobs.append(JobEnd(job.id, job.prompt_id, None))
                continue
            jobs.append(
                JobEnd(
                    job.id,
                    job.prompt_id,
                    record.state,
                    record.server,
                    record.reason,
                    len(store.files(job.id)),
                    [e.detail or "" for e in store.events(job.id)],
                )
            )
    results = None
    if results_csv:
        path = store_root / partition / "results.csv"
        results = []
        if path.is_file():
            with path.open(newline="") as f:
                results = list(csv.DictReader(f))
    return Snapshot(
        jobs=jobs,
        stats=farm.stats(),
        queued=farm.queued(),
        results=results,
        outputs={p.name: p.text() for p in procs},
    )


def violations(snapshot: Snapshot) -> list[str]:
    """Every broken invariant of ``snapshot``, one line each."""
    found = ended(snapshot.jobs)
    found += once(snapshot.jobs, snapshot.stats)
    found += one_at_a_time(snapshot.stats)
    found += nothing_queued(snapshot.queued)
    if snapshot.results is not None:
        found += results_rows(snapshot.results, snapshot.jobs)
    found += no_tracebacks(snapshot.outputs)
    return found


def ended(jobs: list[JobEnd]) -> list[str]:
    found = []
    for job in jobs:
        if job.state is None:
            found.append(f"job {job.job_id}: not in the store")
        elif job.state in DONE:
            if job.files == 0:
                found.append(f"job {job.job_id}: {job.state} without files")
        elif job.state == FAILED_FATAL:
            if not (job.reason or "").strip():
                found.append(f"job {job.job_id}: dead-lettered without a reason")
        else:
            found.append(f"job {job.job_id}: ended {job.state}, neither done nor a dead letter")
    return found


def successes(stats: dict[str, dict[str, Any]], prompt_id: str) -> list[str]:
    """The servers where ``prompt_id`` ran to success, one entry per success."""
    return [
        server
        for server, s in stats.items()
        for run in s["runs"]
        if run["prompt_id"] == prompt_id and run["outcome"] == "success"
    ]


def once(jobs: list[JobEnd], stats: dict[str, dict[str, Any]]) -> list[str]:
    found = []
    for job in jobs:
        where = successes(stats, job.prompt_id)
        excused = any(EXCUSED.search(d) for d in job.details)
        if job.state in DONE:
            if len(where) != 1 and not (excused and where):
                found.append(
                    f"job {job.job_id}: done, its prompt {job.prompt_id} succeeded "
                    f"{len(where)} times ({where}); events: {job.details}"
                )
            elif len(where) == 1 and where[0] != job.server:
                found.append(
                    f"job {job.job_id}: done on {job.server} by its record, but its prompt "
                    f"succeeded on {where[0]}"
                )
        elif len(where) > 1 and not excused:
            found.append(
                f"job {job.job_id}: {job.state}, its prompt succeeded {len(where)} times ({where})"
            )
    return found


def one_at_a_time(stats: dict[str, dict[str, Any]]) -> list[str]:
    found = []
    for server, s in stats.items():
        found += overlapping_posts(server, s["runs"])
    return found


def nothing_queued(queued: dict[str, list[str]]) -> list[str]:
    return [
        f"{server}: prompts still queued or running at the end: {left}"
        for server, left in queued.items()
        if left
    ]


def results_rows(rows: list[dict[str, str]], jobs: list[JobEnd]) -> list[str]:
    found = []
    if [r.get("job_id") for r in rows] != [j.job_id for j in jobs]:
        found.append(f"results.csv: {len(rows)} rows, not one per job of the {len(jobs)}")
    states = {j.job_id: j.state for j in jobs}
    for row in rows:
        if row.get("job_id") in states and row.get("state") != states[row["job_id"]]:
            found.append(
                f"results.csv says {row['job_id']} {row.get('state')}, the store "
                f"{states[row['job_id']]}"
            )
    return found


def no_tracebacks(outputs: dict[str, str]) -> list[str]:
    found = []
    for name, text in outputs.items():
        if TRACEBACK in text:
            start = text.index(TRACEBACK)
            found.append(f"{name}: traceback: {text[start : start + 2000]}")
    return found
