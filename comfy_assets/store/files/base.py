"""The files side of the store: one interface, two implementations.

A store keeps its records in a database and its files in a ``FileStore``: a folder on
one machine (``FolderFileStore``, the default) or a bucket and prefix of an S3 object
store (``S3FileStore``, ``--store s3://BUCKET/PREFIX``). The batch, the API, the films and
the results never ask which: they name what they want by partition, job and path, or by
a key relative to the store (``<partition>/results.csv``), and the file store decides
where the bytes are.

Two kinds of files:

- A job's outputs, written once by the attempt that rendered them (``write_output``),
  named by their path relative to the job's folder (``image/a_00001_.png``, POSIX
  separators, already checked safe by the ComfyUI layer) and described by the store's
  done record (``FileRecord``: path, sha256, bytes, content type), which is the job's
  manifest. A folder keeps them at ``<root>/<partition>/<job id>/<path>``; an object
  store by content hash, so the same bytes are stored once.
- The store's own files (results.csv, films, contact sheets, all_results), named by a key
  relative to the store (``<partition>/results.csv``), written whole and replaced
  atomically (``write_file``): a reader sees the old file or the new one, never a part.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

from comfy_assets.comfy.download import StoredOutput
from comfy_assets.store.errors import StoreError

# How long a presigned URL of ours is good for: long enough for a client that polls a job
# and then downloads its files over a slow link, short enough that a URL copied into a
# log or a chat stops working the same day.
DEFAULT_URL_EXPIRY_S = 3600


class FileStoreRefused(StoreError, ValueError):
    """The file store cannot be used at all: a folder that cannot be made or written, a
    wrong endpoint, bucket or credential. Its message is one line naming the store's
    location (never a credential); commands print it and exit 2 before any prompt."""


class FileStoreUnavailable(StoreError):
    """The file store did not answer, or answered 5xx / throttled, for longer than it is
    waited for: the store's failure, not the job's (the job waits and is tried again)."""


class FileStoreFull(StoreError):
    """The file store has no room: a full disk, a bucket over its quota. The store's
    failure, never the job's: the batch stops taking new jobs."""


# One output as stored: its sha256, bytes and content type (the ComfyUI layer's sink
# answer, which a FileStore's ``write_output`` is).
StoredFile = StoredOutput


class OutputRef(Protocol):
    """What names one stored output of a job (``store.FileRecord`` or ``OutputFile``):
    ``path`` relative to the job's folder, ``sha256``, ``bytes``."""

    @property
    def path(self) -> object: ...
    @property
    def sha256(self) -> str: ...
    @property
    def bytes(self) -> int: ...


class FileStore(Protocol):
    """The files side of a store (module docstring). Every method may raise
    FileStoreUnavailable or FileStoreFull besides what it names; sync methods block
    (call them off the event loop)."""

    @property
    def location(self) -> str:
        """Where the files are, for messages: a folder's path or ``s3://BUCKET/PREFIX``
        (never a credential)."""
        ...

    def check(self) -> None:
        """Make sure the files can be written and read (a folder made, a bucket reached
        with the credentials given). Raises FileStoreRefused."""
        ...

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        """Store one output of a job from ``chunks`` (read to their end; an error they
        raise is raised here and leaves nothing a reader can see). ``path`` is relative
        to the job's folder. Raises ValueError for a path that would leave it,
        OutputNotWritten (an OSError naming the file) for a local disk's refusal."""
        ...

    async def confirm_outputs(
        self, partition: str, job_id: str, files: Sequence[OutputRef]
    ) -> str | None:
        """None when every one of ``files`` is stored with its size (and, where the
        store can tell without reading it again, its checksum); else what is wrong
        ("missing: a.png"). Called before a done record is written."""
        ...

    def output_problem(self, partition: str, job_id: str, file: OutputRef) -> str | None:
        """None when ``file`` of a done job is still stored with its recorded size, else
        what is wrong ("missing: a.png", "changed: b.png (10 bytes, recorded 12)")."""
        ...

    def remove_stale_outputs(
        self, partition: str, job_id: str, keep: Sequence[OutputRef], take: int
    ) -> None:
        """Forget the outputs of take ``take`` of a job that ``keep`` does not list (a
        folder deletes them; an object store keeps objects other jobs may share)."""
        ...

    def open_output(self, partition: str, job_id: str, file: OutputRef) -> BinaryIO:
        """A binary stream of a stored output. Raises FileNotFoundError when it is gone."""
        ...

    def output_path(self, partition: str, job_id: str, file: OutputRef) -> Path | None:
        """The output's path on this machine's disk, or None for an object store."""
        ...

    def output_url(
        self, partition: str, job_id: str, file: OutputRef, expires_s: int = DEFAULT_URL_EXPIRY_S
    ) -> str | None:
        """A presigned GET URL good for ``expires_s`` seconds, or None for a folder (the
        API serves a folder's bytes itself)."""
        ...

    def write_file(self, key: str, source: bytes | Path, content_type: str) -> None:
        """Write the store's file ``key`` (``<partition>/results.csv``) whole from bytes
        or a local file, replacing any before it atomically."""
        ...

    def open_file(self, key: str) -> BinaryIO:
        """A binary stream of the store's file ``key``. Raises FileNotFoundError."""
        ...

    def file_path(self, key: str) -> Path | None:
        """The path of ``key`` on this machine's disk, or None for an object store."""
        ...

    def file_url(self, key: str, expires_s: int = DEFAULT_URL_EXPIRY_S) -> str | None:
        """A presigned GET URL of ``key``, or None for a folder."""
        ...

    def file_location(self, key: str) -> str:
        """Where the store's file ``key`` is, for a line or a metadata entry (never a
        credential): its path in a folder, its object's ``s3://BUCKET/KEY``. Raises
        ValueError for a key that would leave the store."""
        ...

    def list_files(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, bytes) of every store file whose key starts with ``prefix``."""
        ...

    def open_object(self, url: str) -> BinaryIO:
        """A binary stream of the object at ``url`` (``s3://BUCKET/KEY`` of this store's
        endpoint, read with its credentials): a job line's input. Raises
        FileNotFoundError for no such object, FileStoreRefused for a URL this store
        does not read (a folder store reads none)."""
        ...
