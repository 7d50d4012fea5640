"""``FolderFileStore``: a store's files in a folder on this machine (``--store DIR``).

Outputs are at ``<root>/<partition>/<job id>/<path>``, the store's files at
``<root>/<key>``. Every write goes to a hidden temporary name in its final folder and is
renamed when complete, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from comfy_assets.comfy.download import OutputNotWritten, safe_output_path
from comfy_assets.store.base import folder_name
from comfy_assets.store.files.base import (
    DEFAULT_URL_EXPIRY_S,
    FileStoreRefused,
    OutputRef,
    StoredFile,
)

_TAKE = re.compile(r"take-[0-9]+")


def content_type(name: str) -> str:
    """The media type of a file by its name (``image/png``), ``application/octet-stream``
    when its extension says nothing."""
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


def take_folder(take: int) -> str:
    """The folder under a job's folder that take ``take`` writes to: "" for the first
    (the job's folder itself), ``take-N`` for the others, so every take's files stay."""
    return "" if take == 1 else f"take-{take}"


def _not_written(path: Path, error: OSError, what: str) -> OutputNotWritten:
    if isinstance(error, OutputNotWritten):
        return error
    not_written = OutputNotWritten(error.errno, error.strerror, str(path))
    not_written.what = what
    return not_written


class FolderFileStore:
    """The files of a store in the folder ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def location(self) -> str:
        return str(self.root)

    def check(self) -> None:
        """Make the folder. Raises FileStoreRefused when it cannot be made."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FileStoreRefused(f"--store {self.root}: cannot make the folder ({e})") from e

    def job_dir(self, partition: str, job_id: str) -> Path:
        """``<root>/<partition>/<job id>/`` (not created). Raises ValueError for a name
        that would leave the root (empty, ".", "..", or holding a slash)."""
        return self.root / folder_name(partition, "partition") / folder_name(job_id, "job id")

    def _output(self, partition: str, job_id: str, path: object) -> Path:
        return self.job_dir(partition, job_id) / str(path)

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        job_dir = self.job_dir(partition, job_id)
        relative = PurePosixPath(path)
        final = safe_output_path(job_dir, relative.parent.as_posix().strip("."), relative.name)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _not_written(final.parent, e, "output folder") from e
        temp = final.with_name(f".{final.name}.{os.urandom(4).hex()}.part")
        digest = hashlib.sha256()
        size = 0
        try:
            with temp.open("wb") as f:
                async for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            os.replace(temp, final)
        except OSError as e:  # our disk: the chunks' own errors are ComfyErrors
            temp.unlink(missing_ok=True)  # no half file left behind
            raise _not_written(final, e, "output file") from e
        except BaseException:
            temp.unlink(missing_ok=True)  # no half file left behind; the error goes on
            raise
        return StoredFile(digest.hexdigest(), size, content_type(final.name))

    async def confirm_outputs(
        self, partition: str, job_id: str, files: Sequence[OutputRef]
    ) -> str | None:
        for f in files:
            problem = self.output_problem(partition, job_id, f)
            if problem is not None:
                return problem
        return None

    def output_problem(self, partition: str, job_id: str, file: OutputRef) -> str | None:
        """Sizes, not hashes: cheap enough to check at every run."""
        path = self._output(partition, job_id, file.path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"missing: {file.path}"
        if not path.is_file():
            return f"missing: {file.path}"
        if size != file.bytes:
            return f"changed: {file.path} ({size} bytes, recorded {file.bytes})"
        return None

    def remove_stale_outputs(
        self, partition: str, job_id: str, keep: Sequence[OutputRef], take: int
    ) -> None:
        """Delete files in the folder of take ``take`` that ``keep`` does not list (those
        of the job's inputs before an edit), so the folder holds what the store says it
        holds; the folders of its other takes (``take-N``) are kept. A link to a folder
        is not followed (what it points at is not the job's); a link to a file is
        removed like a file. Raises OSError."""
        job_dir = self.job_dir(partition, job_id)
        wanted = {str(f.path) for f in keep}
        top = job_dir / take_folder(take)
        # os.walk reads each folder once, without a stat per entry.
        for folder, subfolders, names in os.walk(top):
            if take == 1 and folder == str(top):
                subfolders[:] = [d for d in subfolders if not _TAKE.fullmatch(d)]
            base = Path(folder).relative_to(job_dir)
            for name in names:
                if (base / name).as_posix() not in wanted:
                    os.unlink(os.path.join(folder, name))

    def open_output(self, partition: str, job_id: str, file: OutputRef) -> BinaryIO:
        return self._output(partition, job_id, file.path).open("rb")

    def output_path(self, partition: str, job_id: str, file: OutputRef) -> Path | None:
        return self._output(partition, job_id, file.path)

    def output_url(
        self, partition: str, job_id: str, file: OutputRef, expires_s: int = DEFAULT_URL_EXPIRY_S
    ) -> str | None:
        return None

    def _file(self, key: str) -> Path:
        parts = PurePosixPath(key).parts
        if not parts or any(p in ("", ".", "..") for p in parts) or key.startswith("/"):
            raise ValueError(f"store file key {key!r} would leave the store")
        return self.root.joinpath(*parts)

    def write_file(self, key: str, source: bytes | Path, content_type: str) -> None:
        path = self._file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.part")
        try:
            if isinstance(source, Path):
                with source.open("rb") as src, temp.open("wb") as dst:
                    while block := src.read(1 << 20):
                        dst.write(block)
            else:
                temp.write_bytes(source)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def open_file(self, key: str) -> BinaryIO:
        return self._file(key).open("rb")

    def file_path(self, key: str) -> Path | None:
        return self._file(key)

    def file_url(self, key: str, expires_s: int = DEFAULT_URL_EXPIRY_S) -> str | None:
        return None

    def list_files(self, prefix: str) -> Iterator[tuple[str, int]]:
        for folder, _subfolders, names in os.walk(self.root):
            for name in names:
                path = Path(folder, name)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not name.startswith("."):
                    yield key, path.stat().st_size

    def open_object(self, url: str) -> BinaryIO:
        """Raises FileStoreRefused: a folder store reads no ``s3://`` object."""
        raise FileStoreRefused(
            f"the store {self.root} is a folder: s3:// inputs are read only with an S3 store "
            "(--store s3://BUCKET/PREFIX)"
        )
