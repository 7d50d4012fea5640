"""A partition of ``renders`` read a page at a time (``read_view``): what its
materialization shows, held and written in a size that does not grow with the partition.

A 1,000,000-job partition is read as pages of ``PAGE`` jobs in job id order, a few
columns each (``Store.job_brief_page``), each with its files, failed attempts and model
tries (one indexed range each). Of each page the view keeps counts, a running sha256 (the data version),
the jobs its job table shows (at most ``JOB_TABLE_ROWS``: dead letters first, then
failures, then a sample spread over the file) and the first done jobs of its contact
sheet (``metadata.SHEET_TILES`` at most); the rest of the page is let go.
"""

from __future__ import annotations

import hashlib
import heapq
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from comfy_assets.farm import metadata
from comfy_assets.jobs.states import DEGRADED, DONE, FAILED_FATAL, FAILED_RETRYABLE
from comfy_assets.jobs.stream import JobIds
from comfy_assets.render.cost import ModelCostTally
from comfy_assets.render.results import JobResults, last_model_tries
from comfy_assets.store import FileRecord, JobBrief, JobRecord, Store

# Rows of the job table of a partition of more jobs than this: its dead letters, then its
# other failures, then a sample spread over the file (a partition of this many jobs or
# fewer shows every job, in line order). As many as ``metadata.TABLE_ROWS`` shows.
JOB_TABLE_ROWS = 200
# Jobs read from the store at a time.
PAGE = 10_000

# The table's rank of a job: what a user must see first.
_DEAD, _FAILED, _SAMPLE, _REST = range(4)
# A job's place in the file: shots in shot order, then the rest by line.
Order = tuple[bool, int, int, str]


def _order(record: JobBrief) -> Order:
    return (record.shot is None, record.shot or 0, record.line, record.job_id)


@dataclass
class _Row:
    """A job the table may show, with what its row needs of the page it came in."""

    key: tuple[int, Order]
    record: JobBrief
    failed_on: tuple[str, ...]
    # Its models and whether its last try loaded one (``last_model_tries``).
    models: tuple[tuple[str, ...], bool] | None


@dataclass
class PartitionView:
    """What ``renders`` shows of a partition's jobs of the job file (``read_view``).

    ``jobs``: the file's jobs; ``done``: of them succeeded or degraded; ``data_version``:
    a sha256 (hex) of every one of their records' job id, prompt_id and state and of
    each of its output files' path and sha256, by job id (equal when a render changed
    nothing); ``done_by_server``: jobs done per server; ``rows``: the job table's jobs
    (every job of the file in line order, or ``shown`` of them: dead letters first);
    ``sample_step``: with ``shown`` < ``jobs``, the sample's lines are every
    ``sample_step``-th (``shown_ranks``: how many rows are dead letters, other failures,
    the sample); ``sheet``: the first done jobs with pictures and their pictures (node
    order), of ``outputs`` pictures of ``output_jobs`` jobs; ``tries``: every model try
    of the file's jobs, counted in ``model_cost``."""

    jobs: int
    done: int = 0
    data_version: str = ""
    done_by_server: dict[str, int] = field(default_factory=dict)
    rows: JobResults = field(default_factory=lambda: JobResults.of([], {}, []))
    sample_step: int = 1
    sheet: list[tuple[JobRecord, list[FileRecord]]] = field(default_factory=list)
    outputs: int = 0
    output_jobs: int = 0
    model_cost: ModelCostTally = field(default_factory=ModelCostTally)
    # Rows of the job table: dead letters, other failures, the sample.
    shown_ranks: tuple[int, int, int] = (0, 0, 0)

    @property
    def shown(self) -> int:
        """Rows of the job table."""
        return len(self.rows.job_ids)

    def cut(self) -> bool:
        """The job table shows fewer jobs than the file has."""
        return self.shown < self.jobs

    def shown_line(self, results: str) -> str:
        """What the job table shows of the file's jobs, and where all of them are
        (``results``: where results.csv is): ``200 of 1,000,000 jobs shown (100 dead
        letters, 12 other failures, 88 of a sample every 5,000 lines); the whole table is
        results.csv at /store/big/results.csv``."""
        if not self.cut():
            return f"all {self.jobs:,} jobs shown; the whole table is results.csv at {results}"
        dead, failed, sampled = self.shown_ranks
        return (
            f"{self.shown:,} of {self.jobs:,} jobs shown ({dead:,} dead letters, {failed:,} "
            f"other failures, {sampled:,} of a sample every {self.sample_step:,} lines); "
            f"the whole table is results.csv at {results}"
        )


def dead_letter_lines(dead: Sequence[tuple[str, str]], count: int, results: str) -> list[str]:
    """The log's lines of a run's ``count`` dead letters, of which ``dead`` names the
    first ((job_id, reason) pairs in order, ``BatchSummary.dead_letters``): ``job <id>:
    DEAD LETTER, <reason>`` for each, then ``… and 9,800 more dead letters: every one is
    in results.csv at <results>``."""
    lines = [f"job {job_id}: DEAD LETTER, {reason}" for job_id, reason in dead]
    if count > len(dead):
        more = count - len(dead)
        letters = "dead letters" if more > 1 else "dead letter"
        lines.append(f"… and {more:,} more {letters}: every one is in results.csv at {results}")
    return lines


def _digest_job(digest: Any, record: JobBrief, files: Sequence[FileRecord]) -> None:
    """Add a job to the data version: its id, prompt_id and state, and each of its output
    files' path and sha256 (by path)."""
    digest.update(f"{record.job_id} {record.prompt_id} {record.state}\n".encode())
    for file in files:
        digest.update(f"  {file.path} {file.sha256}\n".encode())


def _membership(job_ids: Sequence[str]) -> Callable[[list[JobBrief]], list[bool]]:
    """Which records of a page are of a job of ``job_ids`` (a record of a line deleted
    from the file is not): a sorted array of 16-byte ids for a ``JobIds``, a set else."""
    if isinstance(job_ids, JobIds):
        import numpy as np  # as render/summary.py: only where a big file is read

        wanted = np.sort(np.frombuffer(job_ids.ids, dtype="S16"))
        if not len(wanted):
            return lambda page: [False] * len(page)

        def known(page: list[JobBrief]) -> list[bool]:
            keys = np.array([bytes.fromhex(r.job_id.replace("-", "")) for r in page], dtype="S16")
            at = np.minimum(np.searchsorted(wanted, keys), len(wanted) - 1)
            return [bool(b) for b in wanted[at] == keys]

        return known
    ids = set(job_ids)
    return lambda page: [r.job_id in ids for r in page]


def _rank(record: JobBrief, failed_on: tuple[str, ...], step: int) -> int:
    if record.state == FAILED_FATAL:
        return _DEAD
    if record.state in (DEGRADED, FAILED_RETRYABLE) or failed_on:
        return _FAILED
    return _SAMPLE if record.line % step == 0 else _REST


def sample_step(jobs: int, rows: int, failures: int) -> int:
    """Every how many lines the sample takes a job so that it spreads over a file of
    ``jobs`` jobs and fills the ``rows`` the ``failures`` leave (at least 1)."""
    free = max(rows - failures, 1)
    return max(1, -(-jobs // free))


def read_view(
    store: Store, partition: str, job_ids: Sequence[str], counts: Mapping[str, int]
) -> PartitionView:
    """``partition``'s jobs of the job file ``job_ids`` (line order), read a page at a
    time (``PartitionView``). ``counts``: the file's jobs per state (the batch's), so the
    sample spreads over the rows its failures leave. Raises StoreUnavailable."""
    failures = sum(counts.get(state, 0) for state in (FAILED_FATAL, DEGRADED, FAILED_RETRYABLE))
    rows_max = JOB_TABLE_ROWS
    tiles = metadata.SHEET_TILES
    view = PartitionView(len(job_ids))
    whole = len(job_ids) <= rows_max
    view.sample_step = 1 if whole else sample_step(len(job_ids), rows_max, failures)
    known = _membership(job_ids)
    digest = hashlib.sha256()
    kept: list[_Row] = []
    sheet: list[tuple[Order, JobBrief, list[FileRecord]]] = []
    after = ""
    # Pages of a few columns: a job's whole record (its JSON parsed) is read only for a
    # row the table shows or a job of the sheet.
    while page := store.job_brief_page(partition, after, PAGE):
        upto = page[-1].job_id
        files = store.partition_files(partition, after, upto)
        failed = store.failed_on(partition, after, upto)
        in_file = known(page)
        wanted = {r.job_id for r, ok in zip(page, in_file, strict=True) if ok}
        tries = [t for t in store.model_loads(partition, after, upto) if t.job_id in wanted]
        view.model_cost.add(tries)
        models = last_model_tries(tries)
        after = upto
        candidates: list[_Row] = []
        pictured: list[tuple[Order, JobBrief, list[FileRecord]]] = []
        for record, ok in zip(page, in_file, strict=True):
            if not ok:
                continue
            outputs = files.get(record.job_id, [])
            _digest_job(digest, record, outputs)
            servers = failed.get(record.job_id, ())
            rank = _REST if whole else _rank(record, servers, view.sample_step)
            row = _Row((rank, _order(record)), record, servers, models.get(record.job_id))
            candidates.append(row)
            if record.state not in DONE:
                continue
            view.done += 1
            if record.server:
                view.done_by_server[record.server] = view.done_by_server.get(record.server, 0) + 1
            # splitext: Path(...).suffix's answer here, at a third of its cost a file.
            pictures = [
                f
                for f in outputs
                if posixpath.splitext(f.path)[1].lower() in metadata.PICTURE_SUFFIXES
            ]
            if pictures:
                pictures.sort(key=lambda f: (metadata.node_order(f.node_id), f.path))
                view.outputs += len(pictures)
                view.output_jobs += 1
                pictured.append((_order(record), record, pictures))
        kept = heapq.nsmallest(rows_max, [*kept, *candidates], key=lambda row: row.key)
        # A job with pictures shows one tile at least: the first ``tiles`` jobs hold them.
        sheet = heapq.nsmallest(tiles, [*sheet, *pictured], key=lambda pick: pick[0])
    view.data_version = digest.hexdigest()
    full = _records(store, [row.record.job_id for row in kept] + [p[1].job_id for p in sheet])
    kept = [row for row in kept if row.record.job_id in full]
    view.sheet = [
        (full[brief.job_id], pictures) for _, brief, pictures in sheet if brief.job_id in full
    ]
    view.rows = _rows(store, kept, full, job_ids if whole else None)
    ranks = [row.key[0] for row in kept]
    view.shown_ranks = (
        ranks.count(_DEAD),
        ranks.count(_FAILED),
        len(ranks) - ranks.count(_DEAD) - ranks.count(_FAILED),
    )
    return view


def _records(store: Store, job_ids: Sequence[str]) -> dict[str, JobRecord]:
    """The records of ``job_ids`` by id, read one by one (a few hundred); one gone
    since its page was read (the job removed) is left out."""
    found = {job_id: store.get(job_id) for job_id in dict.fromkeys(job_ids)}
    return {job_id: record for job_id, record in found.items() if record is not None}


def _rows(
    store: Store,
    kept: list[_Row],
    full: dict[str, JobRecord],
    job_ids: Sequence[str] | None,
) -> JobResults:
    """The job table's model of the ``kept`` rows: with ``job_ids``, every job of the
    file in line order (a job without a record ``missing``), else the kept in their
    order; the files of their upstream jobs (an input's sha256) read by job."""
    records = [full[row.record.job_id] for row in kept]
    upstream = {str(item["job"]) for record in records for item in record.inputs if "job" in item}
    files = {job_id: store.files(job_id) for job_id in sorted(upstream)}
    models = {row.record.job_id: row.models for row in kept if row.models is not None}
    order = list(job_ids) if job_ids is not None else [record.job_id for record in records]
    failed_on = {row.record.job_id: row.failed_on for row in kept if row.failed_on}
    return JobResults.of(records, files, order, models, failed_on)
