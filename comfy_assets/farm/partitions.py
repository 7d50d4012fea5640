"""Job-file partitions: one dynamic partition per job file in the watched folders.

Shared by the sensor (which adds partitions) and the assets (which find the file of a
partition), so neither imports the other.

A partition key is the job file's name without its extension, with every character
outside ``[A-Za-z0-9._-]`` replaced by ``_`` and every run of dots by ``_`` (so a key is
always a safe single directory name in the result store and never contains ``..``).
Keys are stable across runs because they depend on the name only. Two files that map to
the same key (``shots.jsonl`` in two watched folders, or ``a b.jsonl`` beside
``a_b.jsonl``) are ambiguous: :func:`find_job_file` refuses them and the sensor reports
them instead of launching either. Rename one of them.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from dagster import DynamicPartitionsDefinition

from comfy_assets.jobs.inputs import FOLLOW_INPUT_LINKS_ENV, MAX_INPUT_BYTES_ENV, InputRules

job_files_partitions = DynamicPartitionsDefinition(name="job_files")
# The job files whose jobs have shot numbers (storyboards), by the same keys: the partitions
# of ``films``, so a job file without shots is no film partition waiting for ever.
storyboard_partitions = DynamicPartitionsDefinition(name="storyboards")

# The asset of the job files themselves (reported by the sensor, upstream of ``renders``)
# and its check that every file in the watched folders is valid.
JOB_FILES_ASSET = "job_files"
JOB_FILES_CHECK = "valid"

JOB_DIRS_ENV = "COMFY_ASSETS_JOB_DIRS"
DEFAULT_JOB_DIR = "data/jobs"
JOB_FILE_SUFFIX = ".jsonl"

# Long names are cut and given a hash of the full name so keys stay distinct and fit
# in a file name on every filesystem.
_MAX_KEY_LENGTH = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_DOTS = re.compile(r"\.{2,}")


class AmbiguousJobFileError(ValueError):
    """Two or more job files map to the same partition key."""


def partition_key_for(path: Path) -> str:
    """Return the partition key of a job file: its sanitized name without extension."""
    name = path.name
    stem = name[: -len(JOB_FILE_SUFFIX)] if name.endswith(JOB_FILE_SUFFIX) else path.stem
    key = _DOTS.sub("_", _UNSAFE.sub("_", stem))
    if key in ("", "."):
        key = "_"
    if len(key) > _MAX_KEY_LENGTH:
        digest = hashlib.sha256(stem.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        key = f"{key[: _MAX_KEY_LENGTH - 9]}-{digest}"
    return key


def job_dirs_from_env() -> list[Path]:
    """Return the watched folders: ``COMFY_ASSETS_JOB_DIRS`` (os.pathsep-separated)."""
    raw = os.environ.get(JOB_DIRS_ENV, "").strip() or DEFAULT_JOB_DIR
    return [Path(part) for part in raw.split(os.pathsep) if part.strip()]


def input_rules_from_env() -> InputRules:
    """What job lines' input files may be in Dagster: ``COMFY_ASSETS_FOLLOW_INPUT_LINKS``
    (``1``: accept a link leading out of the job file's folder tree) and
    ``COMFY_ASSETS_MAX_INPUT_BYTES`` (bytes, default 64 MiB), as ``run``'s
    ``--follow-input-links`` and ``--max-input-bytes``. Raises ValueError for a size
    that is not a whole number of bytes >= 1."""
    follow = os.environ.get(FOLLOW_INPUT_LINKS_ENV, "").strip().lower() in ("1", "true", "yes")
    raw = os.environ.get(MAX_INPUT_BYTES_ENV, "").strip()
    if not raw:
        return InputRules(follow_links=follow)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MAX_INPUT_BYTES_ENV}: expected a number of bytes >= 1, got {raw!r}")
    return InputRules(max_input_bytes=int(raw), follow_links=follow)


def iter_job_files(dirs: Sequence[Path]) -> Iterator[os.DirEntry[str]]:
    """Yield the job files (``*.jsonl``, regular, not hidden) of the watched folders.

    ``os.scandir`` entries carry their stat on most platforms, so listing thousands of
    files costs one directory read per folder. A missing folder yields nothing.
    """
    for folder in dirs:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            # Hidden files are editor swap files and partial copies, never job files.
            if entry.name.startswith(".") or not entry.name.endswith(JOB_FILE_SUFFIX):
                continue
            if entry.is_file():
                yield entry


def find_job_file(partition_key: str, dirs: Sequence[Path] | None = None) -> Path:
    """Return the job file of a partition in the watched folders.

    Raises FileNotFoundError when no file has this key and AmbiguousJobFileError when
    several do.
    """
    folders = list(dirs) if dirs is not None else job_dirs_from_env()
    matches = [
        Path(entry.path)
        for entry in iter_job_files(folders)
        if partition_key_for(Path(entry.name)) == partition_key
    ]
    if not matches:
        shown = ", ".join(str(folder) for folder in folders)
        raise FileNotFoundError(f"no job file for partition {partition_key!r} in {shown}")
    if len(matches) > 1:
        shown = ", ".join(str(path) for path in sorted(matches))
        raise AmbiguousJobFileError(
            f"partition {partition_key!r} matches several job files: {shown}; rename all but one"
        )
    return matches[0]
