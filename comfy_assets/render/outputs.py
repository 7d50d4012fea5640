"""A job's outputs on our disk: are they still what the done record says, and nothing else."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from comfy_assets.store import Store

_TAKE = re.compile(r"take-[0-9]+")


def outputs_problem(store: Store, partition: str, job_id: str) -> str | None:
    """None when every recorded output of a done job is on disk with its recorded size;
    else what is wrong ("missing: a.png", "changed: b.png"). Sizes, not hashes: cheap
    enough to check at every run."""
    job_dir = store.job_dir(partition, job_id)
    for f in store.files(job_id):
        path = job_dir / f.path
        if not path.is_file():
            return f"missing: {f.path}"
        if path.stat().st_size != f.bytes:
            return f"changed: {f.path} ({path.stat().st_size} bytes, recorded {f.bytes})"
    return None


def take_folder(take: int) -> str:
    """The folder under a job's folder that take ``take`` writes to: "" for the first
    (the job's folder itself), ``take-N`` for the others, so every take's files stay."""
    return "" if take == 1 else f"take-{take}"


def remove_stale_outputs(job_dir: Path, keep: Sequence[object], take: int = 1) -> None:
    """Delete files in the folder of a job's take ``take`` that its new outputs don't
    include (those of its inputs before an edit), so the folder holds what the store
    says it holds; the folders of its other takes (``take-N``) are kept. A link to a
    folder is not followed (what it points at is not the job's); a link to a file is
    removed like a file. Raises OSError."""
    wanted = {str(getattr(f, "path", "")) for f in keep}
    top = job_dir / take_folder(take)
    # os.walk reads each folder once, without a stat per entry.
    for folder, subfolders, names in os.walk(top):
        if take == 1 and folder == str(top):
            subfolders[:] = [d for d in subfolders if not _TAKE.fullmatch(d)]
        base = Path(folder).relative_to(job_dir)
        for name in names:
            if (base / name).as_posix() not in wanted:
                os.unlink(os.path.join(folder, name))
