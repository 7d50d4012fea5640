"""A job's outputs in the store's files (``FileStore``): where an attempt streams them
(``output_sink``), whether a done job's are still what its record says
(``outputs_problem``), and whether a new done record's are all stored
(``unconfirmed_outputs``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from comfy_assets.store import Store
from comfy_assets.store.files import FileStore, FileStoreUnavailable, OutputRef, StoredFile
from comfy_assets.store.files.folder import take_folder

__all__ = ["JobOutputs", "outputs_problem", "take_folder", "unconfirmed_outputs"]


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
    cheap enough to check at every run. Blocks (call it off the event loop)."""
    for f in store.files(job_id):
        problem = store.file_store.output_problem(partition, job_id, f)
        if problem is not None:
            return problem
    return None


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
