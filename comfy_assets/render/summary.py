"""What a batch came to, as the store has it (``BatchSummary``, ``summarize``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from comfy_assets.jobs.states import DONE
from comfy_assets.store import Store


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
