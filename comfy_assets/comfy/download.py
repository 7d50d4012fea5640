"""Outputs listed in /history, written to our disk.

Names come from the server, so they are untrusted (README fact 10): every subfolder part
and file name is checked (no ``..``, separators, drive letters or control characters),
and the final path must resolve inside the destination. Each file streams to a hidden
temp name in its final folder and is renamed when complete, so a reader never sees half
a file; sha256 and size are computed while streaming, and a file over the size limit
stops the download (its temp file removed). A PNG must end with its IEND chunk: an answer
cut short on its way (a proxy's Content-Length cut alike) is not taken for the file.
"""

from __future__ import annotations

import hashlib
import os
import stat
import unicodedata
from contextlib import aclosing
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

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
    being written there ("output file", "output folder")."""

    what = "output file"

    def __str__(self) -> str:
        why = self.strerror or "cannot write"
        return f"{why[:1].lower()}{why[1:]}: writing the {self.what} {self.filename}"


def _not_written(path: Path, error: OSError, what: str) -> OutputNotWritten:
    if isinstance(error, OutputNotWritten):
        return error
    not_written = OutputNotWritten(error.errno, error.strerror, str(path))
    not_written.what = what
    return not_written


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


def safe_output_path(dest_dir: Path, subfolder: str, filename: str) -> Path:
    """``dest_dir / subfolder / filename`` when it is safe to write.

    ``subfolder`` may be nested (``video/takes``; ComfyUI on Windows may use ``\\``);
    ``filename`` must be a plain name. Raises UnsafeOutputName for ``..``, absolute paths,
    separators in the file name, control characters (Unicode category Cc: C0 with NUL
    and newline, DEL, C1) anywhere, or anything resolving outside ``dest_dir`` (an
    existing symlink included).
    """
    _check_part(filename, "filename", filename)
    parts: list[str] = []
    if subfolder:
        if subfolder.startswith(_SEPARATORS):
            raise UnsafeOutputName(f"unsafe output subfolder {subfolder!r}: absolute path")
        for part in subfolder.replace("\\", "/").split("/"):
            _check_part(part, "subfolder", subfolder)
            parts.append(part)
    path = dest_dir.joinpath(*parts, filename)
    # Checked parts can leave dest_dir only through a link among them: resolving both
    # paths (a stat per component of each) is needed only when one is there.
    if _has_link(dest_dir, [*parts, filename]) and not path.resolve().is_relative_to(
        dest_dir.resolve()
    ):
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
    dest_dir: Path,
    *,
    max_bytes: int | None = MAX_OUTPUT_BYTES,
    under: str = "",
) -> list[DownloadedFile]:
    """Download every ``type: output`` file of a history entry under ``dest_dir``
    (in its folder ``under``, a plain name of ours, when given; the files' paths stay
    relative to ``dest_dir``).

    Previews (``temp``) and anything else not ``output`` are skipped; a file listed twice
    is written once. Names are validated before any request. Each file may have up to
    ``max_bytes`` bytes (None: no limit). Raises UnsafeOutputName, OutputTooLarge (the
    file over the limit is not left on disk, not even in part), the client's typed
    errors (OutputMissing for a 404), OutputNotWritten (an OSError naming the file) for
    our disk.
    """
    base = dest_dir / under if under else dest_dir
    wanted: dict[Path, OutputFile] = {}
    for out in entry.output_files:
        if out.type != "output":
            continue
        wanted.setdefault(safe_output_path(base, out.subfolder, out.filename), out)
    for folder in {path.parent for path in wanted}:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _not_written(folder, e, "output folder") from e
    results = []
    for path, out in wanted.items():
        results.append(await _download_one(client, out, path, dest_dir, max_bytes))
    return results


async def _download_one(
    client: ComfyClient, out: OutputFile, path: Path, dest_dir: Path, max_bytes: int | None
) -> DownloadedFile:
    temp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.part")
    digest = hashlib.sha256()
    size = 0
    tail = b""
    try:
        with temp.open("wb") as f:
            view = client.iter_view(out.filename, out.subfolder, out.type, max_bytes=max_bytes)
            async with aclosing(view) as chunks:
                async for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    tail = (tail + chunk[-len(_PNG_END) :])[-len(_PNG_END) :]
        if path.suffix.lower() == ".png" and tail != _PNG_END:
            raise NotTheFile(
                f"{client.name}: GET /view {out.filename}: {size} bytes of a PNG without its "
                "end (IEND chunk): the answer was cut short on its way",
                server=client.base_url,
            )
        os.replace(temp, path)
    except OSError as e:  # our disk: the client's own errors are ComfyErrors
        temp.unlink(missing_ok=True)  # no half file left behind
        raise _not_written(path, e, "output file") from e
    except BaseException:
        temp.unlink(missing_ok=True)  # no half file left behind; the error goes on
        raise
    return DownloadedFile(
        path=PurePosixPath(*path.relative_to(dest_dir).parts).as_posix(),
        sha256=digest.hexdigest(),
        bytes=size,
        node_id=out.node_id,
        key=out.key,
    )
