"""A job's outputs in the store's files (``FileStore``): where an attempt streams them
(``output_sink``), whether a done job's are still what its record says
(``outputs_problem``), and whether a new done record's are all stored
(``unconfirmed_outputs``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from comfy_assets.jobs.states import DONE
from comfy_assets.store import JobRecord, Store
from comfy_assets.store.files import FileStore, FileStoreUnavailable, OutputRef, StoredFile
from comfy_assets.store.files.folder import take_folder

__all__ = [
    "EndedBefore",
    "JobOutputs",
    "ended_before",
    "outputs_problem",
    "take_folder",
    "unconfirmed_outputs",
]


@dataclass(frozen=True)
class JobOutputs:
    """The sink of one job's outputs (``comfy.download.OutputSink``): each one written
    with ``file_store.write_output`` under ``partition`` / ``job_id``."""

    file_store: FileStore
    partition: str
    job_id: str

    async def __call__(self, path: str, chunks: AsyncIterator[bytes]) -> StoredFile:
        return await self.file_store.write_output(self.partition, self.job_id, path, chunks)


def outputs_problem(store: Store, partition: str, job_id: str) -> str | None:
    """None when every recorded output of a done job is still stored with its recorded
    size; else what is wrong ("missing: a.png", "changed: b.png"). Sizes, not hashes:
    cheap enough to check at every run. Blocks (call it off the event loop). Raises
    FileStoreUnavailable when the store's files do not answer."""
    return _first_problem(store.file_store, partition, job_id, store.files(job_id))


def _first_problem(
    file_store: FileStore, partition: str, job_id: str, files: Sequence[OutputRef]
) -> str | None:
    problems = (file_store.output_problem(partition, job_id, f) for f in files)
    return next((p for p in problems if p is not None), None)


@dataclass(frozen=True)
class EndedBefore:
    """A job its registration found ended already (``RegisterResult.ended``): ``rec``, its
    record as read then; for a done one, ``problem``: what is wrong with its stored
    outputs (``outputs_problem``; None when nothing is), and ``unchecked``: why they were
    not checked (the store's files did not answer: nothing said against them)."""

    rec: JobRecord
    problem: str | None = None
    unchecked: str | None = None


def ended_before(
    store: Store, partition: str, ended: Mapping[str, JobRecord]
) -> dict[str, EndedBefore]:
    """``ended`` (job id -> record, of jobs registered under ``partition`` and ended
    already) with the outputs of the done ones checked as ``outputs_problem`` checks
    them: their file records read in one query a few hundred jobs (``Store.files_of``),
    not one a job. Blocks (call it off the event loop)."""
    done = [job_id for job_id, rec in ended.items() if rec.state in DONE]
    files = store.files_of(done) if done else {}
    found: dict[str, EndedBefore] = {}
    for job_id, rec in ended.items():
        if rec.state not in DONE:
            found[job_id] = EndedBefore(rec)
            continue
        try:
            problem = _first_problem(store.file_store, partition, job_id, files.get(job_id, []))
        except FileStoreUnavailable as e:
            found[job_id] = EndedBefore(rec, unchecked=str(e))
            continue
        found[job_id] = EndedBefore(rec, problem)
    return found


async def unconfirmed_outputs(
    file_store: FileStore, partition: str, job_id: str, files: Sequence[OutputRef]
) -> str | None:
    """None when the store confirms every one of ``files`` (``confirm_outputs``), else
    what is wrong, for people: the problem it names, or that it did not answer. Never
    raises FileStoreUnavailable: a store that does not answer confirms nothing."""
    try:
        problem = await file_store.confirm_outputs(partition, job_id, files)
    except FileStoreUnavailable as e:
        return f"not confirmed ({e})"
    return problem
