"""Files on this machine's disk for the readers and writers that need one (PyAV for films
and contact sheets, the csv module for results tables, ``comfy-assets sync``), whatever
the file store: a folder store's files are used where they are; an object store's are
copied to a scratch folder first (``output_copy``, ``file_copy``), or made there and then
stored whole (``writing``). No ``if s3:`` here either: the file store's ``output_path``
and ``file_path`` say whether its files are on this disk.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from comfy_assets.store.files.base import FileStore, OutputRef
from comfy_assets.store.files.folder import content_type

# Bytes read at once when copying a stored file: large enough for few system calls, small
# enough that a copy holds little memory however big the file.
COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class Copied:
    """What a copy wrote: ``sha256`` hex digest and ``bytes`` size."""

    sha256: str
    bytes: int


class NotAsRecorded(ValueError):
    """What a copy read is not the file the store recorded (another size or sha256)."""


def copy_stream(source: BinaryIO, dest: Path, expect: OutputRef | None = None) -> Copied:
    """Copy ``source`` (read to its end, ``COPY_CHUNK`` bytes at a time) to ``dest``
    through a hidden temporary name beside it, renamed when complete: ``dest`` is the old
    file or the new one, never a part. Folders are made. With ``expect``, the copy is
    kept only if it has its size and sha256. Raises OSError, NotAsRecorded (nothing left
    behind but ``dest`` as it was)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.with_name(f".{dest.name}.{os.urandom(4).hex()}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        with temp.open("wb") as f:
            while block := source.read(COPY_CHUNK):
                f.write(block)
                digest.update(block)
                size += len(block)
        if expect is not None and (size, digest.hexdigest()) != (expect.bytes, expect.sha256):
            raise NotAsRecorded(
                f"{expect.path}: {size} bytes, sha256 {digest.hexdigest()[:12]}; recorded "
                f"{expect.bytes} bytes, sha256 {expect.sha256[:12]}"
            )
        os.replace(temp, dest)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return Copied(digest.hexdigest(), size)


def file_sha256(path: Path) -> Copied:
    """The sha256 and size of the file at ``path``, read ``COPY_CHUNK`` at a time.
    Raises OSError."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while block := f.read(COPY_CHUNK):
            digest.update(block)
            size += len(block)
    return Copied(digest.hexdigest(), size)


def inside(folder: Path, *parts: str) -> Path:
    """``folder`` joined with the POSIX paths ``parts``; ValueError for one that would
    leave it (the names come from the store's records, checked when written, and are
    checked again here: a copy must land where it is said to)."""
    relative = PurePosixPath(*parts)
    if relative.is_absolute() or any(p in ("", ".", "..") for p in relative.parts):
        raise ValueError(f"{relative} would leave {folder}")
    return folder.joinpath(*relative.parts)


def output_copy(
    files: FileStore, partition: str, job_id: str, file: OutputRef, scratch: Path
) -> Path:
    """A path on this disk of the stored output ``file`` of a job: where a folder store
    keeps it, else a copy made at ``<scratch>/<job id>/<path>``. Raises FileNotFoundError
    when it is gone from the store, OSError, and what the file store raises."""
    path = files.output_path(partition, job_id, file)
    if path is not None:
        return path
    copy = inside(scratch, job_id, str(file.path))
    with files.open_output(partition, job_id, file) as source:
        copy_stream(source, copy)
    return copy


def file_copy(files: FileStore, key: str, scratch: Path) -> Path:
    """A path on this disk of the store's file ``key``: where a folder store keeps it,
    else a copy made at ``<scratch>/<key>``. Raises FileNotFoundError when there is no
    such file, OSError, and what the file store raises."""
    path = files.file_path(key)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        return path
    copy = inside(scratch, key)
    with files.open_file(key) as source:
        copy_stream(source, copy)
    return copy


@contextmanager
def writing(files: FileStore, keys: Sequence[str], scratch: Path) -> Iterator[list[Path]]:
    """Paths to make the store's files ``keys`` at, one per key, for a tool that writes
    files (and replaces them atomically itself, as ``write_csv`` and the film's writers
    do): where a folder store keeps them, else ``<scratch>/<key>``; in that case, when
    the block ends without an error, each file made is stored whole (``write_file``)
    and a key whose file was not made is left as it was. Keys of one folder get paths
    of one folder. Raises what the file store raises."""
    local = [files.file_path(key) for key in keys]
    paths = [
        p if p is not None else inside(scratch, key) for p, key in zip(local, keys, strict=True)
    ]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    yield paths
    for key, here, path in zip(keys, local, paths, strict=True):
        if here is None and path.is_file():
            files.write_file(key, path, content_type(path.name))


def file_location(files: FileStore, key: str, *, resolved: bool = False) -> str:
    """Where the store's file ``key`` is, for a line or a metadata entry: its path on
    this disk (absolute when ``resolved``), else its object's URL
    (``FileStore.file_location``: ``s3://BUCKET/PREFIX/files/images/results.csv``)."""
    path = files.file_path(key)
    if path is not None and resolved:
        return str(path.resolve())
    return files.file_location(key)
