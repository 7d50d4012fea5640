"""A partition's outputs copied from the store to a folder of this machine, only what is
new or changed (``sync_outputs``, the work of ``comfy-assets sync``).

The folder holds ``<DIR>/<job id>/<path>``, as a folder store holds a partition. A file
already there with the size and sha256 the store's record gives is left alone (its
sha256 is read only when its size matches); any other is copied from the store (read
once, its size and sha256 checked against the record before it replaces what was
there, through a temporary name, so the folder never holds a part). Files in the folder
that the store does not list are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from comfy_assets.store.files.base import FileStore, OutputRef
from comfy_assets.store.files.local import NotAsRecorded, copy_stream, file_sha256, inside


@dataclass
class SyncCounts:
    """What a sync did: files ``new`` (not in the folder before), ``changed`` (there, but
    not as recorded), ``unchanged``, ``copied_bytes``; ``failed``: one line per file
    not copied (gone from the store, or not as recorded there)."""

    new: int = 0
    changed: int = 0
    unchanged: int = 0
    copied_bytes: int = 0
    failed: list[str] = field(default_factory=list)

    def line(self, partition: str, to: Path) -> str:
        """``sync images -> out: 3 new, 1 changed, 5 unchanged, 0 failed (12345 bytes
        copied)``."""
        return (
            f"sync {partition} -> {to}: {self.new} new, {self.changed} changed, "
            f"{self.unchanged} unchanged, {len(self.failed)} failed "
            f"({self.copied_bytes} bytes copied)"
        )


def _as_recorded(path: Path, file: OutputRef) -> bool | None:
    """True when ``path`` is a file of ``file``'s size and sha256, False when it is
    another, None when there is none."""
    if not path.is_file():
        return None
    if path.stat().st_size != file.bytes:
        return False
    return file_sha256(path).sha256 == file.sha256


def sync_outputs(
    files: FileStore, partition: str, outputs: Iterable[tuple[str, OutputRef]], to: Path
) -> SyncCounts:
    """Copy each of ``outputs`` ((job id, output) of ``partition``) that the folder
    ``to`` lacks or holds otherwise to ``<to>/<job id>/<path>`` (module docstring).
    Raises OSError (the folder: no room, no permission), ValueError for a path that
    would leave ``to``, FileStoreUnavailable; a file gone from the store or not as
    recorded there is a line of ``failed``."""
    counts = SyncCounts()
    for job_id, file in outputs:
        dest = inside(to, job_id, str(file.path))
        found = _as_recorded(dest, file)
        if found:
            counts.unchanged += 1
            continue
        try:
            source = files.open_output(partition, job_id, file)
        except FileNotFoundError:
            counts.failed.append(f"{job_id}/{file.path}: gone from the store")
            continue
        with source:
            try:
                copied = copy_stream(source, dest, expect=file)
            except NotAsRecorded as e:
                counts.failed.append(f"{job_id}/{e}")
                continue
        counts.copied_bytes += copied.bytes
        if found is None:
            counts.new += 1
        else:
            counts.changed += 1
    return counts
