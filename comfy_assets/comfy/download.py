"""Outputs listed in /history, streamed into a sink (the store's files).

Names come from the server, so they are untrusted (README fact 10): every subfolder part
and file name is checked (no ``..``, separators, drive letters or control characters)
before any request. Each file streams from ``/view`` into an ``OutputSink`` in chunks
(never whole in memory); the sink stores it so that a reader never sees half a file and
says its sha256, size and media type. A file over the size limit stops its stream, and a
PNG must end with its IEND chunk: an answer cut short on its way (a proxy's
Content-Length cut alike) is not taken for the file. Either error is raised from the
chunks the sink reads, so the sink keeps nothing of that file.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

from comfy_assets.comfy.errors import NotTheFile, UnsafeOutputName
from comfy_assets.comfy.types import DownloadedFile, HistoryEntry, OutputFile

if TYPE_CHECKING:  # MAX_OUTPUT_BYTES is read by argparse defaults, which need no aiohttp
    from comfy_assets.comfy.client import ComfyClient

_SEPARATORS = ("/", "\\")
# The last 12 bytes of every PNG (an empty IEND chunk and its CRC, PNG spec 11.2.5): an
# answer that ends otherwise was cut short, whatever its Content-Length said.
_PNG_END = bytes.fromhex("0000000049454e44ae426082")

# Per output file: generous for video (a minute of 4K ProRes 4444 is about 1.3 GB), and
# still a bound on what a broken or hostile server can write to our disk.
MAX_OUTPUT_BYTES = 4 * 1024**3


class OutputNotWritten(OSError):
    """An output could not be written to our disk (no space left, no permission): the
    cause's ``errno`` and ``strerror``, ``filename`` the output's path, and ``what`` was
    being written there ("output file", "output folder"). Raised by a sink that writes
    to a local disk."""

    what = "output file"

    def __str__(self) -> str:
        why = self.strerror or "cannot write"
        return f"{why[:1].lower()}{why[1:]}: writing the {self.what} {self.filename}"


@dataclass(frozen=True)
class StoredOutput:
    """What a sink says of one output it stored: ``sha256`` hex digest and ``bytes`` size
    of what it read, ``content_type`` its media type (``image/png``, from its name)."""

    sha256: str
    bytes: int
    content_type: str


class OutputSink(Protocol):
    """Where a job's outputs go (the store's ``FileStore.write_output`` for one job):
    called with an output's ``path`` relative to the job's folder (POSIX, checked safe)
    and its ``chunks``, it reads them to their end and stores them, or raises what they
    raise (then nothing of that output is left for a reader), or its own error
    (``OutputNotWritten`` for a local disk)."""

    def __call__(self, path: str, chunks: AsyncIterator[bytes]) -> Awaitable[StoredOutput]: ...


def _check_part(part: str, what: str, full: str) -> None:
    if part in ("", ".", ".."):
        raise UnsafeOutputName(f"unsafe output {what} {full!r}: empty, '.' or '..' part")
    control = next((c for c in part if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        # C0 (NUL, newline...), DEL and C1: a newline would split a line of FFmpeg's
        # concat list, and none of them belongs in a file name we write.
        raise UnsafeOutputName(
            f"unsafe output {what} {full!r}: control character U+{ord(control):04X}"
        )
    if any(sep in part for sep in _SEPARATORS):
        raise UnsafeOutputName(f"unsafe output {what} {full!r}: path separator")
    if len(part) >= 2 and part[1] == ":":
        raise UnsafeOutputName(f"unsafe output {what} {full!r}: drive letter")


def safe_output_parts(subfolder: str, filename: str) -> list[str]:
    """The parts of ``subfolder / filename`` when they are safe to name a file by: a
    path relative to a job's folder, whatever stores it.

    ``subfolder`` may be nested (``video/takes``; ComfyUI on Windows may use ``\\``);
    ``filename`` must be a plain name. Raises UnsafeOutputName for ``..``, absolute paths,
    separators in the file name, control characters (Unicode category Cc: C0 with NUL
    and newline, DEL, C1) anywhere.
    """
    _check_part(filename, "filename", filename)
    parts: list[str] = []
    if subfolder:
        if subfolder.startswith(_SEPARATORS):
            raise UnsafeOutputName(f"unsafe output subfolder {subfolder!r}: absolute path")
        for part in subfolder.replace("\\", "/").split("/"):
            _check_part(part, "subfolder", subfolder)
            parts.append(part)
    return [*parts, filename]


def safe_output_path(dest_dir: Path, subfolder: str, filename: str) -> Path:
    """``dest_dir / subfolder / filename`` when it is safe to write: the checks of
    ``safe_output_parts``, and UnsafeOutputName for a path resolving outside
    ``dest_dir`` (through an existing symlink)."""
    parts = safe_output_parts(subfolder, filename)
    path = dest_dir.joinpath(*parts)
    # Checked parts can leave dest_dir only through a link among them: resolving both
    # paths (a stat per component of each) is needed only when one is there.
    if _has_link(dest_dir, parts) and not path.resolve().is_relative_to(dest_dir.resolve()):
        raise UnsafeOutputName(
            f"unsafe output {subfolder!r}/{filename!r}: resolves outside {dest_dir}"
        )
    return path


def _has_link(dest_dir: Path, parts: list[str]) -> bool:
    """Whether one of ``parts`` below ``dest_dir``, in turn, is an existing symlink."""
    current = str(dest_dir)
    for part in parts:
        current = os.path.join(current, part)
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False  # nothing exists from here on, so no link either
        if stat.S_ISLNK(mode):
            return True
    return False


async def download_outputs(
    client: ComfyClient,
    entry: HistoryEntry,
    sink: OutputSink,
    *,
    max_bytes: int | None = MAX_OUTPUT_BYTES,
    under: str = "",
) -> list[DownloadedFile]:
    """Stream every ``type: output`` file of a history entry into ``sink`` (in its folder
    ``under``, a plain name of ours, when given: the files' paths start with it).

    Previews (``temp``) and anything else not ``output`` are skipped; a file listed twice
    is written once. Names are validated before any request. Each file may have up to
    ``max_bytes`` bytes (None: no limit). Raises UnsafeOutputName, OutputTooLarge (the
    sink keeps nothing of the file over the limit), NotTheFile (a PNG without its end),
    the client's typed errors (OutputMissing for a 404), and what the sink raises
    (OutputNotWritten, an OSError naming the file, for a local disk).
    """
    wanted: dict[str, OutputFile] = {}
    for out in entry.output_files:
        if out.type != "output":
            continue
        parts = safe_output_parts(out.subfolder, out.filename)
        wanted.setdefault(PurePosixPath(*([under] if under else []), *parts).as_posix(), out)
    results = []
    for path, out in wanted.items():
        chunks = _checked_view(client, out, max_bytes)
        async with aclosing(chunks):
            stored = await sink(path, chunks)
        stored_as = (stored.sha256, stored.bytes, out.node_id, out.key, stored.content_type)
        results.append(DownloadedFile(path, *stored_as))
    return results


async def _checked_view(
    client: ComfyClient, out: OutputFile, max_bytes: int | None
) -> AsyncGenerator[bytes, None]:
    """The chunks of ``/view`` for ``out``; raises NotTheFile after the last one when a
    PNG does not end with its IEND chunk (so the sink keeps none of it)."""
    size = 0
    tail = b""
    view = client.iter_view(out.filename, out.subfolder, out.type, max_bytes=max_bytes)
    async with aclosing(view) as chunks:
        async for chunk in chunks:
            size += len(chunk)
            tail = (tail + chunk[-len(_PNG_END) :])[-len(_PNG_END) :]
            yield chunk
    if out.filename.lower().endswith(".png") and tail != _PNG_END:
        raise NotTheFile(
            f"{client.name}: GET /view {out.filename}: {size} bytes of a PNG without its "
            "end (IEND chunk): the answer was cut short on its way",
            server=client.base_url,
        )
