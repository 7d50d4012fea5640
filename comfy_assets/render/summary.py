"""What a batch came to, as the store has it (``BatchSummary``, ``summarize``)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from comfy_assets.jobs.states import DONE
from comfy_assets.jobs.stream import JobIds
from comfy_assets.store import JobRecord, Store


@dataclass
class BatchSummary:
    """What a batch came to. ``dead_letters``: (job_id, reason) pairs."""

    partition: str
    counts: dict[str, int]
    done: int
    dead_lettered: int
    dead_letters: list[tuple[str, str]]
    jobs: list
    gpu_seconds: float
    seconds: float
    stopped: str | None = None
    unreachable: dict[str, str] = field(default_factory=dict)
    no_server: bool = False  # stopped because no server was reachable (worth a retry)
    # How many jobs the summary is of; None: ``len(jobs)``. A summary of a file read a
    # chunk at a time (``summarize_file``) holds only the first jobs not done in ``jobs``.
    job_count: int | None = None

    @property
    def not_done(self) -> int:
        """Jobs neither done nor dead-lettered."""
        count = len(self.jobs) if self.job_count is None else self.job_count
        return count - self.done - self.dead_lettered

    def line(self) -> str:
        return f"summary: {self.done} done, {self.dead_lettered} dead-lettered"


def summarize(
    store: Store,
    partition: str,
    seconds: float,
    stopped: str | None = None,
    unreachable: dict[str, str] | None = None,
    job_ids: Sequence[str] | None = None,
) -> BatchSummary:
    """The summary of a partition as the store has it now; with ``job_ids``, of those
    jobs only (a line deleted from the job file leaves its record, not its count)."""
    jobs = store.jobs(partition)
    if job_ids is not None:
        wanted = set(job_ids)
        jobs = [j for j in jobs if j.job_id in wanted]
    counts: dict[str, int] = {}
    for j in jobs:
        counts[str(j.state)] = counts.get(str(j.state), 0) + 1
    dead = [(j.job_id, j.reason or "") for j in jobs if j.state == "failed_fatal"]
    done = sum(1 for j in jobs if j.state in DONE)
    gpu = sum(j.gpu_seconds or 0.0 for j in jobs)
    return BatchSummary(
        partition,
        counts,
        done,
        len(dead),
        dead,
        jobs,
        round(gpu, 3),
        round(seconds, 3),
        stopped,
        unreachable or {},
    )


PAGE = 10_000  # jobs a store read while summarizing a file read a chunk at a time


def summarize_file(
    store: Store,
    partition: str,
    seconds: float,
    stopped: str | None,
    unreachable: dict[str, str],
    job_ids: JobIds,
    named: int,
) -> BatchSummary:
    """``summarize`` of the jobs ``job_ids`` (a ``JobScan``'s), read a page at a time:
    what it holds does not grow with the partition but for the dead letters. ``jobs``
    holds the first ``named`` jobs neither done nor dead-lettered (by shot, then line, as
    ``Store.jobs`` orders them); ``job_count`` the jobs of the file, those the batch
    stopped before registering counted as pending."""
    import numpy as np  # here: the module is imported by every run

    wanted = np.sort(np.frombuffer(job_ids.ids, dtype="S16"))
    counts: dict[str, int] = {}
    dead: list[tuple[tuple[bool, int, int, str], str]] = []
    done = total = 0
    gpu = 0.0
    left: list[tuple[tuple[bool, int, int, str], JobRecord]] = []
    after = ""
    while page := store.job_page(partition, after, PAGE):
        after = page[-1].job_id
        keys = np.array([bytes.fromhex(r.job_id.replace("-", "")) for r in page], dtype="S16")
        at = np.minimum(np.searchsorted(wanted, keys), len(wanted) - 1)
        for rec, known in zip(page, wanted[at] == keys, strict=True):
            if not known:
                continue  # a line deleted from the job file leaves its record, not its count
            total += 1
            counts[str(rec.state)] = counts.get(str(rec.state), 0) + 1
            gpu += rec.gpu_seconds or 0.0
            order = (rec.shot is None, rec.shot or 0, rec.line or 0, rec.job_id)
            if rec.state in DONE:
                done += 1
            elif rec.state == "failed_fatal":
                dead.append((order, rec.reason or ""))
            else:
                left = heapq.nsmallest(named, [*left, (order, rec)], key=lambda e: e[0])
    if total < len(job_ids):
        # Jobs the batch stopped before reaching: not registered yet, so not run.
        counts["pending"] = counts.get("pending", 0) + len(job_ids) - total
    return BatchSummary(
        partition,
        counts,
        done,
        len(dead),
        [(order[-1], reason) for order, reason in sorted(dead)],
        [rec for _, rec in left],
        round(gpu, 3),
        round(seconds, 3),
        stopped,
        unreachable,
        job_count=len(job_ids),
    )
