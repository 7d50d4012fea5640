"""A big job file checked in two halves at once, on two cores (``read_halves``): the
second half by a forked process, the first here, each cut at a line boundary.

Only a file with no problem is told this way: when either half has an error of any kind
(a bad line, a header past line 1, a repeated id or shot inside a half, bytes that are
not UTF-8, a job taking another job's output), or the two halves have a shot in common,
the answer is None and the caller reads the file again in one pass, which says every
error in order as ``load_job_file`` does. Repeated ids across the halves are found after
(``_Pass.repeated_ids`` over the joined ids). The forked process hashes lines as this one
does (``hash`` of bytes: the same seed), so the reader checks its lines as its own.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from comfy_assets.jobs.parse import LineParser
from comfy_assets.jobs.regular_file import open_regular_file

if TYPE_CHECKING:
    from comfy_assets.jobs.stream import _Pass

# Smaller files are read in one pass: forking and joining cost more than half of it.
HALVES_BYTES = 16 << 20
_BLOCK = 1 << 20
# What of a half's pass is sent back: every field a clean pass fills in.
_SENT = ("job_lines", "offsets", "lines", "digests", "ids", "_id_lines", "seen_shots")
_MORE = ("input_files", "storyboard")


def can_halve(size: int) -> bool:
    """Whether a file of ``size`` bytes is worth checking in halves here. Only in a
    process of one Python thread (``comfy-assets run`` at its start): a fork copies the
    calling thread alone, and a lock another thread held then (logging's, an import's)
    would stay held in the forked process for good; a Dagster run's process reads in one
    pass."""
    return size >= HALVES_BYTES and (os.cpu_count() or 1) >= 2 and hasattr(os, "fork") and alone()


def alone() -> bool:
    """Whether this process runs one Python thread (``can_halve``)."""
    return threading.active_count() == 1


def read_halves(
    path: str, handle: BinaryIO, size: int, make: Callable[[LineParser], _Pass], parser: LineParser
) -> _Pass | None:
    """The pass over the file at ``path`` (open as ``handle``, ``size`` bytes) made of
    two halves checked at once, or None when the file must be read in one pass (see the
    module). ``make`` makes a pass over the lines with ``parser`` (a new one each)."""
    handle.seek(size // 2)
    handle.readline()
    middle = handle.tell()
    if middle >= size:
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the second half, in the forked process
        os.close(read_end)
        payload = b""
        try:
            payload = _second_half(path, middle, make, parser)
        finally:
            with os.fdopen(write_end, "wb") as out:
                out.write(payload)
            os._exit(0)
    os.close(write_end)
    try:
        handle.seek(0)
        first = make(parser)
        first.read(handle, end=middle)
        # The version's hash is of every byte: the second half's too.
        handle.seek(middle)
        for block in iter(lambda: handle.read(_BLOCK), b""):
            first.digest.update(block)
    finally:
        with os.fdopen(read_end, "rb") as pipe:
            payload = pipe.read()
        os.waitpid(pid, 0)
    if not payload or first.blank or _troubled(first):
        return None
    second = pickle.loads(payload)
    if first.seen_shots.keys() & second["seen_shots"].keys():
        return None
    first.job_lines += second["job_lines"]
    for name in ("offsets", "lines", "digests", "_id_lines"):
        getattr(first, name).extend(second[name])
    first.ids += second["ids"]
    first.seen_shots.update(second["seen_shots"])
    first.input_files += second["input_files"]
    first.storyboard = first.storyboard or second["storyboard"]
    # The second half's workflow files are read here too: the cache then holds every
    # workflow the file names, as after a pass in one piece (``WorkflowCache.longest_text``).
    for base_dir, spec in second["workflows"]:
        parser.cache.get(base_dir, spec)
    return first


def _troubled(found: _Pass) -> bool:
    return bool(found.parser.errors or found.odd_ids or found.shot_errors)


def _second_half(
    path: str, middle: int, make: Callable[[LineParser], _Pass], parser: LineParser
) -> bytes:
    """The second half's clean pass, pickled; no bytes when it has any problem (any
    exception too: the pass in one piece that follows says it, in its place)."""
    try:
        with open_regular_file(Path(path)) as handle:  # the parent's has its own place
            lines = 0
            for block in iter(lambda: handle.read(min(_BLOCK, middle - handle.tell())), b""):
                lines += block.count(b"\n")
            handle.seek(middle)
            found = make(parser)
            found.read(handle, start_line=lines + 1, offset=middle)
    except BaseException:  # told by the pass in one piece that follows (module doc)
        return b""
    if _troubled(found):
        return b""
    state: dict[str, Any] = {name: getattr(found, name) for name in _SENT + _MORE}
    state["workflows"] = found.parser.cache.specs()
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
