"""The job-file sensor: watched folders in, partitions and runs out.

Each tick lists the watched folders (one ``os.scandir`` per folder plus a ``stat`` per
file) and compares every ``*.jsonl`` file with the cursor. Only files whose size or
mtime changed are read and hashed; only files whose content hash changed are validated.
A new or changed valid file gets its partition (if new) and one run request whose
``run_key`` is ``<partition>:<sha256[:16]>``, so Dagster launches each file version
once even if the cursor is lost. Reverting a file to a version that already ran launches
nothing (its jobs are done in the store anyway).

The cursor is JSON: ``{"v": 1, "files": {partition_key: [sha256[:16], size, mtime_ns,
ok]}}``. A file that fails validation is reported once (tick log, skip reason) and
remembered as not ok; it launches as soon as its content changes. ``touch`` re-validates
a bad file whose content did not change (for a fix made elsewhere, e.g. a workflow).
Files beyond the per-tick cap are left out of the cursor so the next tick takes them.

Write job files atomically (to a hidden name, then rename): hidden files are ignored,
and a half-written file could be valid and launch with only part of its jobs.
"""

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.workflows import WorkflowCache
from comfy_assets.partitions import (
    iter_job_files,
    job_dirs_from_env,
    job_files_partitions,
    partition_key_for,
)

SENSOR_INTERVAL_ENV = "COMFY_ASSETS_SENSOR_INTERVAL_S"
MAX_RUNS_ENV = "COMFY_ASSETS_MAX_RUNS_PER_TICK"
DEFAULT_SENSOR_INTERVAL_S = 10
DEFAULT_MAX_RUNS_PER_TICK = 10

# Tags on every run the sensor requests: which file version the run was asked for.
JOB_FILE_TAG = "comfy_assets/job_file"
JOB_FILE_SHA_TAG = "comfy_assets/job_file_sha256"

CURSOR_VERSION = 1
_HASH_CHARS = 16


def _int_from_env(name: str, default: int) -> int:
    """Read a positive integer setting; a bad value is an error, not a silent default."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from exc
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


@dataclass(frozen=True)
class SeenFile:
    """What the cursor remembers of one job file."""

    sha: str  # first 16 hex digits of the sha256 of its bytes
    size: int
    mtime_ns: int
    ok: bool  # passed validation (and so was launched)

    def to_json(self) -> list[object]:
        """Compact form: thousands of these live in one cursor string."""
        return [self.sha, self.size, self.mtime_ns, int(self.ok)]

    @classmethod
    def from_json(cls, raw: list[object]) -> "SeenFile":
        """Inverse of :meth:`to_json`."""
        sha, size, mtime_ns, ok = raw
        return cls(str(sha), int(size), int(mtime_ns), bool(ok))


def parse_cursor(cursor: str | None) -> dict[str, SeenFile]:
    """Return the files remembered by a cursor (an empty cursor remembers nothing)."""
    if not cursor:
        return {}
    data = json.loads(cursor)
    if not isinstance(data, dict) or data.get("v") != CURSOR_VERSION:
        raise ValueError(
            f"job_file_sensor cursor is not version {CURSOR_VERSION}; "
            "clear the cursor in the UI to rescan every file"
        )
    return {key: SeenFile.from_json(raw) for key, raw in data["files"].items()}


def dump_cursor(seen: dict[str, SeenFile]) -> str:
    """Serialize the remembered files (sorted, so equal states give equal cursors)."""
    files = {key: seen[key].to_json() for key in sorted(seen)}
    return json.dumps({"v": CURSOR_VERSION, "files": files}, separators=(",", ":"))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@sensor(
    job_name="render_job",
    minimum_interval_seconds=_int_from_env(SENSOR_INTERVAL_ENV, DEFAULT_SENSOR_INTERVAL_S),
    default_status=DefaultSensorStatus.RUNNING,
    description="Adds each job file (*.jsonl) in the watched folders as a partition and "
    "requests one render_job run per new or changed file.",
)
def job_file_sensor(context: SensorEvaluationContext) -> SensorResult:
    """Add new job files as partitions and request a run per new file version."""
    max_runs = _int_from_env(MAX_RUNS_ENV, DEFAULT_MAX_RUNS_PER_TICK)
    previous = parse_cursor(context.cursor)

    by_key: dict[str, list[os.DirEntry[str]]] = defaultdict(list)
    for entry in iter_job_files(job_dirs_from_env()):
        by_key[partition_key_for(Path(entry.name))].append(entry)

    seen: dict[str, SeenFile] = {}
    problems: list[str] = []
    # Files whose stat changed since the last tick, taken oldest first below.
    candidates: list[tuple[int, str, Path, os.stat_result]] = []
    for key, entries in by_key.items():
        if len(entries) > 1:
            paths = ", ".join(sorted(entry.path for entry in entries))
            problems.append(
                f"partition {key!r} matches several job files, rename all but one: {paths}"
            )
            continue
        entry = entries[0]
        stat = entry.stat()
        old = previous.get(key)
        if old is not None and (old.size, old.mtime_ns) == (stat.st_size, stat.st_mtime_ns):
            seen[key] = old  # unchanged since the last tick: not even read
            continue
        candidates.append((stat.st_mtime_ns, key, Path(entry.path), stat))

    run_requests: list[RunRequest] = []
    deferred = 0
    workflows = WorkflowCache()  # files dropped together share a workflow: read it once
    for _, key, path, stat in sorted(candidates, key=lambda item: (item[0], item[1])):
        old = previous.get(key)
        if len(run_requests) >= max_runs:
            deferred += 1
            if old is not None:
                seen[key] = old  # keep the old version; the new one is taken next tick
            continue
        sha = _sha256_file(path)
        if old is not None and old.ok and old.sha == sha[:_HASH_CHARS]:
            # Touched or rewritten with the same bytes: this version already ran.
            seen[key] = SeenFile(old.sha, stat.st_size, stat.st_mtime_ns, True)
            continue
        try:
            job_file = load_job_file(path, workflows)
        except JobFileError as exc:
            problems.append(f"{path} is not a valid job file, not launched:\n{exc}")
            seen[key] = SeenFile(sha[:_HASH_CHARS], stat.st_size, stat.st_mtime_ns, False)
            continue
        # The file may have changed between hashing and loading: the loaded bytes win.
        sha = job_file.sha256
        seen[key] = SeenFile(sha[:_HASH_CHARS], stat.st_size, stat.st_mtime_ns, True)
        run_requests.append(
            RunRequest(
                run_key=f"{key}:{sha[:_HASH_CHARS]}",
                partition_key=key,
                tags={JOB_FILE_TAG: str(path), JOB_FILE_SHA_TAG: sha},
            )
        )
        context.log.info(f"{path}: {len(job_file.jobs)} jobs, requesting a run of partition {key}")

    for problem in problems:
        context.log.error(problem)
    if deferred:
        context.log.info(
            f"{deferred} changed job files left for the next tick ({max_runs} runs per tick)"
        )

    new_keys: list[str] = []
    if run_requests:
        existing = set(context.instance.get_dynamic_partitions(job_files_partitions.name))
        new_keys = [req.partition_key for req in run_requests if req.partition_key not in existing]

    skip_reason: str | None = None
    if not run_requests:
        skip_reason = "\n\n".join(problems) if problems else "no new or changed job files"
    return SensorResult(
        run_requests=run_requests,
        skip_reason=skip_reason,
        cursor=dump_cursor(seen),
        dynamic_partitions_requests=(
            [job_files_partitions.build_add_request(new_keys)] if new_keys else []
        ),
    )
