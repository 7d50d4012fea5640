"""Reading a file a job file names, or the job file itself, when its path may point
anywhere: only a regular file is read (a device such as ``/dev/zero`` never ends, and a
FIFO nobody writes to would hang the open), and at most so many bytes of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotARegularFile(Exception):
    """Why a path is not read, in words that follow its name ("is not a regular file",
    "is over the limit of N bytes")."""


def open_regular_file(path: Path) -> BinaryIO:
    """The regular file at ``path``, open for reading in binary. Raises NotARegularFile
    for anything else (a device, a FIFO, a folder), OSError for a file that can't be
    opened, ValueError for a NUL in the path."""
    # Opened without blocking: a FIFO nobody writes to would otherwise hang the open
    # (Windows has neither the flag nor FIFOs).
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise NotARegularFile("is not a regular file")
    return os.fdopen(fd, "rb")  # closes fd when closed


def read_regular_file(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``max_bytes``; None: no
    limit). Raises NotARegularFile for anything else (a device, a FIFO, a folder) or a
    bigger file, OSError for a file that can't be opened or read, ValueError for a NUL
    in the path."""
    with open_regular_file(path) as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise NotARegularFile(f"is over the limit of {max_bytes} bytes")
    return data
