"""What a batch came to, as the store has it (``BatchSummary``, ``summarize``)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from comfy_assets.jobs.states import DONE
from comfy_assets.jobs.stream import JobIds
from comfy_assets.store import JobRecord, Store

# Dead letters a summary names, (job_id, reason) each, in the file's order: a file whose
# every job is a dead letter (a model missing on every server) is a million of them; the
# rest are counted, by reason.
DEAD_LETTERS_NAMED = 20
# Distinct reasons a summary counts its dead letters by; those of any other reason are
# counted together (a reason naming its job makes as many reasons as jobs).
REASONS_COUNTED = 100
# Reasons a line names with their counts, and the characters of each it shows.
REASONS_SHOWN = 3
REASON_CHARS = 120

# A job's place in its file: shots in shot order, then the rest by line (``Store.jobs``).
Order = tuple[bool, int, int, str]


@dataclass
class BatchSummary:
    """What a batch came to. ``dead_lettered``: its dead letters' count;
    ``dead_letters``: the first ``DEAD_LETTERS_NAMED`` of them, (job_id, reason) pairs in
    the file's order; ``dead_reasons``: how many have each reason (of the first
    ``REASONS_COUNTED`` reasons met as the store is read), ``dead_other_reasons`` how
    many have another."""

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
    dead_reasons: dict[str, int] = field(default_factory=dict)
    dead_other_reasons: int = 0

    @property
    def not_done(self) -> int:
        """Jobs neither done nor dead-lettered."""
        count = len(self.jobs) if self.job_count is None else self.job_count
        return count - self.done - self.dead_lettered

    def line(self) -> str:
        return f"summary: {self.done} done, {self.dead_lettered} dead-lettered"

    def dead_letter_lines(self, where: str) -> list[str]:
        """``  dead letter <job_id>: <reason>`` for each dead letter named, then
        ``more_dead_letters``' line, if any."""
        more = self.more_dead_letters(where)
        named = [f"  dead letter {job_id}: {reason}" for job_id, reason in self.dead_letters]
        return named + ([more] if more else [])

    def more_dead_letters(self, where: str) -> str | None:
        """The line after the dead letters named one a line: how many more there are,
        all of them counted by reason, and ``where`` (``every one is in ...``) they are
        read; None when every one is named."""
        more = self.dead_lettered - len(self.dead_letters)
        if more <= 0:
            return None
        by_count = sorted(self.dead_reasons.items(), key=lambda e: -e[1])
        shown = [f"{n:,} × {_quoted(why)}" for why, n in by_count[:REASONS_SHOWN]]
        rest = sum(n for _, n in by_count[REASONS_SHOWN:]) + self.dead_other_reasons
        if rest:
            shown.append(f"{rest:,} with other reasons")
        letters = "dead letters" if more > 1 else "dead letter"
        reasons = "; ".join(shown)
        return (
            f"  … and {more:,} more {letters} ({self.dead_lettered:,} in all: {reasons}): {where}"
        )


def _quoted(reason: str) -> str:
    """``reason`` quoted for a line, cut at ``REASON_CHARS`` characters."""
    return repr(reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…")


class _DeadTally:
    """A batch's dead letters in bounded memory: the first ``DEAD_LETTERS_NAMED`` by
    their order, all counted, by reason for ``REASONS_COUNTED`` reasons."""

    def __init__(self) -> None:
        self.count = 0
        self.kept: list[tuple[Order, str]] = []
        self.reasons: dict[str, int] = {}
        self.other = 0

    def add(self, order: Order, reason: str) -> None:
        """Count a dead letter; ``order`` ends with its job id."""
        self.count += 1
        self.kept.append((order, reason))
        if len(self.kept) >= 2 * DEAD_LETTERS_NAMED + 64:  # trimmed now and then, not each time
            self.kept = heapq.nsmallest(DEAD_LETTERS_NAMED, self.kept)
        if reason in self.reasons or len(self.reasons) < REASONS_COUNTED:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        else:
            self.other += 1

    def named(self) -> list[tuple[str, str]]:
        """The first ``DEAD_LETTERS_NAMED``: (job_id, reason) in order."""
        return [(order[-1], why) for order, why in sorted(self.kept)[:DEAD_LETTERS_NAMED]]

    def fill(self, summary: BatchSummary) -> BatchSummary:
        """``summary`` with these dead letters."""
        summary.dead_lettered, summary.dead_letters = self.count, self.named()
        summary.dead_reasons, summary.dead_other_reasons = self.reasons, self.other
        return summary


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
    dead = _DeadTally()
    for j in jobs:
        if j.state == "failed_fatal":
            dead.add(_order(j), j.reason or "")
    done = sum(1 for j in jobs if j.state in DONE)
    gpu = sum(j.gpu_seconds or 0.0 for j in jobs)
    summary = BatchSummary(
        partition,
        counts,
        done,
        0,
        [],
        jobs,
        round(gpu, 3),
        round(seconds, 3),
        stopped,
        unreachable or {},
    )
    return dead.fill(summary)


def _order(rec: JobRecord) -> Order:
    return (rec.shot is None, rec.shot or 0, rec.line or 0, rec.job_id)


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
    what it holds does not grow with the partition. ``jobs``
    holds the first ``named`` jobs neither done nor dead-lettered (by shot, then line, as
    ``Store.jobs`` orders them); ``job_count`` the jobs of the file, those the batch
    stopped before registering counted as pending."""
    import numpy as np  # here: the module is imported by every run

    wanted = np.sort(np.frombuffer(job_ids.ids, dtype="S16"))
    counts: dict[str, int] = {}
    dead = _DeadTally()
    done = total = 0
    gpu = 0.0
    left: list[tuple[Order, JobRecord]] = []
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
            order = _order(rec)
            if rec.state in DONE:
                done += 1
            elif rec.state == "failed_fatal":
                dead.add(order, rec.reason or "")
            else:
                left = heapq.nsmallest(named, [*left, (order, rec)], key=lambda e: e[0])
    if total < len(job_ids):
        # Jobs the batch stopped before reaching: not registered yet, so not run.
        counts["pending"] = counts.get("pending", 0) + len(job_ids) - total
    summary = BatchSummary(
        partition,
        counts,
        done,
        0,
        [],
        [rec for _, rec in left],
        round(gpu, 3),
        round(seconds, 3),
        stopped,
        unreachable,
        job_count=len(job_ids),
    )
    return dead.fill(summary)
