"""A job's outputs on our disk: are they still what the done record says, and nothing else."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from comfy_assets.store import Store


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


def remove_stale_outputs(job_dir: Path, keep: Sequence[object]) -> None:
    """Delete files in a job's folder that its new outputs don't include (those of its
    inputs before an edit), so the folder holds what the store says it holds. A link to
    a folder is not followed (what it points at is not the job's); a link to a file is
    removed like a file. Raises OSError."""
    wanted = {str(getattr(f, "path", "")) for f in keep}
    # os.walk reads each folder once, without a stat per entry.
    for folder, _, names in os.walk(job_dir):
        base = Path(folder).relative_to(job_dir)
        for name in names:
            if (base / name).as_posix() not in wanted:
                os.unlink(os.path.join(folder, name))
