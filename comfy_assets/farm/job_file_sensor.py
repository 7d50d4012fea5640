"""The job-file sensor: watched folders in, partitions and runs out.

Each tick lists the watched folders (one ``os.scandir`` per folder plus a ``stat`` per
file) and compares every ``*.jsonl`` file with the cursor. Only files whose size or
mtime changed are read and hashed; only files whose content hash changed are validated
(those over ``VALIDATED_IN_TICK_BYTES`` by their run instead, for the tick's budget).
A new or changed valid file gets its partition (if new) and one run request whose
``run_key`` is ``<partition>:<sha256[:16]>``, so Dagster launches each file version
once even if the cursor is lost. Reverting a file to a version that already ran launches
nothing (its jobs are done in the store anyway).

Each accepted file version is reported as a materialization of its partition of the
``job_files`` asset (upstream of ``renders``); a version whose jobs have shot numbers is a
partition of ``storyboards`` too (``films``), and one without is taken out of it. A
partition that names no job file and was never built (added by hand in the UI's
Materialize dialog) is deleted once no run of it is waiting or running, STRAY_GRACE_S
after the sensor first saw it (a run of it materializes nothing and succeeds), so it
stays neither Missing nor red. The ``job_files`` asset's check ``valid`` is
evaluated whenever the set of bad files changes: failed, with every error on its own
line, while any file is invalid or ambiguous; passed once none is.

The cursor is JSON: ``{"v": 1, "files": {partition_key: [sha256[:16], size, mtime_ns,
ok, errors?]}, "reported": digest, "stray": {"<definition>/<key>": first seen}}``. A file that fails validation is reported once (tick
log, skip reason, the ``valid`` check) and remembered as not ok with its errors; it
launches as soon as its content changes. ``touch`` re-validates a bad file whose content
did not change (for a fix made elsewhere, e.g. a workflow). Files beyond the per-tick
cap are left out of the cursor so the next tick takes them. ``reported`` is a digest of
the problems the ``valid`` check last showed.

Write job files atomically (to a hidden name, then rename): hidden files are ignored,
and a half-written file could be valid and launch with only part of its jobs.
"""

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dagster import (
    AddDynamicPartitionsRequest,
    AssetCheckEvaluation,
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    DeleteDynamicPartitionsRequest,
    IntMetadataValue,
    MetadataValue,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from comfy_assets.farm.metadata import job_file_problems, job_files_check_evaluation, missing_folder
from comfy_assets.farm.names import DEFAULT_FARM, Farm
from comfy_assets.farm.partitions import (
    input_rules_from_env,
    iter_job_files,
    partition_key_for,
)
from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import JobFile, JobFileError
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.jobs.workflows import WorkflowCache

SENSOR_INTERVAL_ENV = "COMFY_ASSETS_SENSOR_INTERVAL_S"
MAX_RUNS_ENV = "COMFY_ASSETS_MAX_RUNS_PER_TICK"
DEFAULT_SENSOR_INTERVAL_S = 10
DEFAULT_MAX_RUNS_PER_TICK = 10

# Tags on every run the sensor requests: which file version the run was asked for.
JOB_FILE_TAG = "comfy_assets/job_file"
JOB_FILE_SHA_TAG = "comfy_assets/job_file_sha256"

CURSOR_VERSION = 1
# A partition that names no job file is deleted this long after the sensor first saw it.
STRAY_GRACE_S = 300.0
UNFINISHED = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]
_HASH_CHARS = 16
# A bigger file is hashed in the tick but validated by its run (``renders`` fails it, with
# every error, before posting anything): its pass, about 5 µs a line, would take the tick
# past its 2 s budget (a 118 MB file of 1,000,000 jobs: seconds; docs/scaling.md).
VALIDATED_IN_TICK_BYTES = 16 << 20
# A tick logs the first this many run requests one a line, then how many more.
LOGGED_REQUESTS = 20


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
    errors: str = ""  # a bad file's errors, one a line, as the ``valid`` check shows them

    def to_json(self) -> list[str | int]:
        """Compact form: thousands of these live in one cursor string."""
        raw: list[str | int] = [self.sha, self.size, self.mtime_ns, int(self.ok)]
        return [*raw, self.errors] if self.errors else raw

    @classmethod
    def from_json(cls, raw: list[str | int]) -> "SeenFile":
        """Inverse of :meth:`to_json`."""
        sha, size, mtime_ns, ok, *errors = raw
        return cls(str(sha), int(size), int(mtime_ns), bool(ok), str(errors[0]) if errors else "")


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


def reported_digest(cursor: str | None) -> str | None:
    """The digest of the problems the ``valid`` check last showed; None before the first."""
    return json.loads(cursor).get("reported") if cursor else None


def stray_since(cursor: str | None) -> dict[str, float]:
    """When each partition that names no job file was first seen (epoch seconds), by
    ``<partitions definition>/<key>``."""
    return dict(json.loads(cursor).get("stray", {})) if cursor else {}


def dump_cursor(
    seen: dict[str, SeenFile], reported: str | None = None, stray: dict[str, float] | None = None
) -> str:
    """Serialize the remembered files (sorted, so equal states give equal cursors)."""
    files = {key: seen[key].to_json() for key in sorted(seen)}
    data: dict[str, object] = {"v": CURSOR_VERSION, "files": files}
    if reported is not None:
        data["reported"] = reported
    if stray:
        data["stray"] = {key: stray[key] for key in sorted(stray)}
    return json.dumps(data, separators=(",", ":"))


def _digest(problems: list[str]) -> str:
    return hashlib.sha256("\n\n".join(problems).encode()).hexdigest()[:_HASH_CHARS]


@functools.lru_cache(maxsize=64)
def _resolved_folder(folder: Path) -> Path:
    # One realpath per watched folder, not one per file: thousands of files share a few.
    return folder.resolve()


def _counts(job_file: JobScan | JobFile) -> tuple[int, int]:
    """The jobs of a validated job file, and how many of them have a shot."""
    if isinstance(job_file, JobScan):
        return job_file.count, job_file.shots
    return len(job_file.jobs), sum(1 for job in job_file.jobs if job.shot is not None)


def _materialization(
    key: str, path: Path, job_file: JobScan | JobFile, asset_key: AssetKey
) -> AssetMaterialization:
    """The job file version the sensor accepted, as a partition of ``job_files``."""
    jobs, shots = _counts(job_file)
    return AssetMaterialization(
        asset_key=asset_key,
        partition=key,
        description=f"{path.name}: {jobs} jobs accepted, run requested",
        metadata={
            "path": MetadataValue.path(str(_resolved_folder(path.parent) / path.name)),
            "sha256": job_file.sha256,
            "jobs": jobs,
            "shots": shots,
            "policy": job_file.header.policy,
        },
    )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _by_key(dirs: list[Path]) -> dict[str, list[os.DirEntry[str]]]:
    by_key: dict[str, list[os.DirEntry[str]]] = defaultdict(list)
    for entry in iter_job_files(dirs):
        by_key[partition_key_for(Path(entry.name))].append(entry)
    return by_key


def _ambiguous(key: str, entries: list[os.DirEntry[str]]) -> str:
    paths = ", ".join(sorted(entry.path for entry in entries))
    return f"partition {key!r} matches several job files, rename all but one: {paths}"


def _shots_accepted(instance: DagsterInstance, key: str, farm: Farm) -> int:
    """Shots of the version of ``key``'s job file the sensor last accepted (0 for none)."""
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=farm.job_files_key, asset_partitions=[key]), limit=1
    ).records
    materialization = records[0].asset_materialization if records else None
    shots = materialization.metadata.get("shots") if materialization else None
    if shots is None:
        return 0
    if not isinstance(shots, IntMetadataValue) or shots.value is None:
        raise TypeError(f"partition {key}: the job files' metadata shots is {shots!r}")
    return shots.value


def _has_unfinished_run(instance: DagsterInstance, key: str) -> bool:
    """Whether a run of partition ``key`` is queued or running."""
    runs = instance.get_runs(
        filters=RunsFilter(tags={"dagster/partition": key}, statuses=UNFINISHED), limit=1
    )
    return bool(runs)


def stray_partitions(
    instance: DagsterInstance,
    present: set[str],
    job_files: set[str],
    storyboards: set[str],
    since: dict[str, float],
    now: float,
    farm: Farm = DEFAULT_FARM,
) -> tuple[list[str], list[str], dict[str, float]]:
    """The partitions to delete now, of ``job_files`` and of ``storyboards``, and when each
    one that stays was first seen. A partition is stray when it names no job file of the
    watched folders (``present``) and was never rendered, or (of ``storyboards``) never
    filmed, with its file gone or accepted without shots: someone added it by hand (the
    UI's "+ Add a partition"). It stays while a run of it is queued or running (that run
    finds no file and materializes nothing), and STRAY_GRACE_S after it was first seen, so
    the run launched right after adding it finds it; then it goes, Missing for good
    otherwise. ``since`` (from the cursor) says when each was first seen."""
    candidates: list[tuple[str, str]] = []
    absent = job_files - present
    if absent:
        rendered = instance.get_materialized_partitions(farm.key("renders"))
        candidates += [(farm.job_files_partitions_name, key) for key in sorted(absent - rendered)]
    if storyboards:
        waiting = storyboards - instance.get_materialized_partitions(farm.key("films"))
        candidates += [
            (farm.storyboard_partitions_name, key)
            for key in sorted(waiting)
            if key not in present or _shots_accepted(instance, key, farm) == 0
        ]
    delete: dict[str, list[str]] = {
        farm.job_files_partitions_name: [],
        farm.storyboard_partitions_name: [],
    }
    still: dict[str, float] = {}
    for definition, key in candidates:
        first = since.get(f"{definition}/{key}", now)
        if now - first >= STRAY_GRACE_S and not _has_unfinished_run(instance, key):
            delete[definition].append(key)
        else:
            still[f"{definition}/{key}"] = first
    return delete[farm.job_files_partitions_name], delete[farm.storyboard_partitions_name], still


def missing_folders(dirs: list[Path]) -> list[str]:
    """The problem of each watched folder that is not a folder (``missing_folder``)."""
    return [missing_folder(folder) for folder in dirs if not folder.is_dir()]


def sensor_rules() -> InputRules:
    """The input rules of a tick: the environment's, ``s3://`` inputs taken by their form
    (a tick reads no object store; the run reads them, ``InputRules.objects_later``)."""
    return dataclasses.replace(input_rules_from_env(), objects_later=True)


def current_problems(dirs: list[Path] | None = None) -> list[str]:
    """Every problem of the watched folders now, each a text of one or more lines: a
    folder that does not exist, a name several files share, or a file that does not validate (its errors, ``path:line:
    field: message`` one a line). Reads and validates every file."""
    dirs = dirs if dirs is not None else DEFAULT_FARM.dirs()
    problems = missing_folders(dirs)
    workflows = WorkflowCache()
    by_key = _by_key(dirs)
    for key, entries in sorted(by_key.items()):
        if len(entries) > 1:
            problems.append(_ambiguous(key, entries))
            continue
        try:
            scan_job_file(Path(entries[0].path), workflows, rules=sensor_rules())
        except JobFileError as exc:
            problems.append(job_file_problems(exc))
    return problems


def build_job_file_sensor(farm: Farm) -> SensorDefinition:
    """The farm's job-file sensor (``job_file_sensor``, prefixed), launching its render job.
    Raises ValueError for a bad COMFY_ASSETS_SENSOR_INTERVAL_S when the farm sets none."""
    interval = farm.sensor_interval_s or _int_from_env(
        SENSOR_INTERVAL_ENV, DEFAULT_SENSOR_INTERVAL_S
    )

    @sensor(
        name=farm.name("job_file_sensor"),
        job_name=farm.name("render_job"),
        minimum_interval_seconds=interval,
        default_status=DefaultSensorStatus.RUNNING,
        description="Adds each job file (*.jsonl) in the watched folders as a partition and "
        f"requests one {farm.name('render_job')} run per new or changed file.",
    )
    def job_file_sensor(context: SensorEvaluationContext) -> SensorResult:
        """Add new job files as partitions and request a run per new file version."""
        return job_file_tick(context, farm)

    return job_file_sensor


@dataclass
class _Accepted:
    """What one tick made of the changed job files: a run request and a materialization
    per accepted version, its partitions with and without shots, the files that did not
    validate, and how many changed files it left for the next tick (``max_runs`` a tick)."""

    max_runs: int
    run_requests: list[RunRequest] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # the partition of each run request
    materializations: list[AssetMaterialization] = field(default_factory=list)
    with_shots: list[str] = field(default_factory=list)
    without_shots: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    deferred: int = 0

    def request(self, key: str, path: Path, sha: str) -> None:
        """A run of the version ``sha`` of the file at ``path``, partition ``key``."""
        self.run_requests.append(
            RunRequest(
                run_key=f"{key}:{sha[:_HASH_CHARS]}",
                partition_key=key,
                tags={JOB_FILE_TAG: str(path), JOB_FILE_SHA_TAG: sha},
            )
        )
        self.keys.append(key)


def _changed_files(
    by_key: dict[str, list[os.DirEntry[str]]],
    previous: dict[str, SeenFile],
    seen: dict[str, SeenFile],
) -> tuple[list[str], list[tuple[int, str, Path, os.stat_result]]]:
    """The names several files share, and the files whose stat changed since the last
    tick (mtime, key, path, stat); an unchanged file goes to ``seen`` as it was, unread."""
    ambiguous: list[str] = []
    candidates: list[tuple[int, str, Path, os.stat_result]] = []
    for key, entries in by_key.items():
        if len(entries) > 1:
            ambiguous.append(_ambiguous(key, entries))
            continue
        entry = entries[0]
        stat = entry.stat()
        old = previous.get(key)
        if old is not None and (old.size, old.mtime_ns) == (stat.st_size, stat.st_mtime_ns):
            seen[key] = old  # unchanged since the last tick: not even read
            continue
        candidates.append((stat.st_mtime_ns, key, Path(entry.path), stat))
    return ambiguous, candidates


def _accept(
    context: SensorEvaluationContext,
    farm: Farm,
    candidates: list[tuple[int, str, Path, os.stat_result]],
    previous: dict[str, SeenFile],
    seen: dict[str, SeenFile],
) -> _Accepted:
    """Read, hash and validate the changed files, oldest first, up to the runs a tick may
    request; each goes to ``seen`` with what the tick made of it."""
    accepted = _Accepted(_int_from_env(MAX_RUNS_ENV, DEFAULT_MAX_RUNS_PER_TICK))
    workflows = WorkflowCache()  # files dropped together share a workflow: read it once
    for _, key, path, stat in sorted(candidates, key=lambda item: (item[0], item[1])):
        old = previous.get(key)
        if len(accepted.run_requests) >= accepted.max_runs:
            accepted.deferred += 1
            if old is not None:
                seen[key] = old  # keep the old version; the new one is taken next tick
            continue
        sha = _sha256_file(path)
        if old is not None and old.ok and old.sha == sha[:_HASH_CHARS]:
            # Touched or rewritten with the same bytes: this version already ran.
            seen[key] = SeenFile(old.sha, stat.st_size, stat.st_mtime_ns, True)
            continue
        if stat.st_size > VALIDATED_IN_TICK_BYTES:
            _request_unvalidated(context, accepted, key, path, sha, farm.job_files_key)
            seen[key] = SeenFile(sha[:_HASH_CHARS], stat.st_size, stat.st_mtime_ns, True)
            continue
        try:
            # One streaming pass, no job held (``jobs/stream.py``).
            job_file = scan_job_file(path, workflows, rules=sensor_rules())
        except JobFileError as exc:
            accepted.problems.append(f"{path} is not a valid job file, not launched:\n{exc}")
            errors = job_file_problems(exc)
            seen[key] = SeenFile(sha[:_HASH_CHARS], stat.st_size, stat.st_mtime_ns, False, errors)
            continue
        # The file may have changed between hashing and loading: the loaded bytes win.
        sha = job_file.sha256
        seen[key] = SeenFile(sha[:_HASH_CHARS], stat.st_size, stat.st_mtime_ns, True)
        accepted.request(key, path, sha)
        accepted.materializations.append(_materialization(key, path, job_file, farm.job_files_key))
        jobs, shots = _counts(job_file)
        (accepted.with_shots if shots else accepted.without_shots).append(key)
        if len(accepted.run_requests) <= LOGGED_REQUESTS:
            context.log.info(f"{path}: {jobs} jobs, requesting a run of partition {key}")
    return accepted


def _request_unvalidated(
    context: SensorEvaluationContext,
    accepted: _Accepted,
    key: str,
    path: Path,
    sha: str,
    asset_key: AssetKey,
) -> None:
    """Request a run of a file too big to validate in the tick (its run validates it).
    It is a storyboard when its bytes hold ``"shot"`` (a key, or rarely a text)."""
    accepted.request(key, path, sha)
    size_mb = path.stat().st_size / 1e6
    accepted.materializations.append(
        AssetMaterialization(
            asset_key=asset_key,
            partition=key,
            description=f"{path.name}: {size_mb:.1f} MB, run requested; its run validates it",
            metadata={
                "path": MetadataValue.path(str(_resolved_folder(path.parent) / path.name)),
                "sha256": sha,
                "megabytes": MetadataValue.float(size_mb),
            },
        )
    )
    (accepted.with_shots if _mentions_shot(path) else accepted.without_shots).append(key)
    if len(accepted.run_requests) <= LOGGED_REQUESTS:
        context.log.info(
            f"{path}: {size_mb:.1f} MB, requesting a run of partition {key} (validated by it)"
        )


def _mentions_shot(path: Path) -> bool:
    """Whether the file's bytes hold ``"shot"`` (blocks overlap by the word's length)."""
    word = b'"shot"'
    tail = b""
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            if word in tail + chunk[: len(word)] or word in chunk:
                return True
            tail = chunk[-len(word) :]
    return False


def _partition_requests(
    context: SensorEvaluationContext,
    farm: Farm,
    present: set[str],
    accepted: _Accepted,
) -> tuple[list[AddDynamicPartitionsRequest | DeleteDynamicPartitionsRequest], dict[str, float]]:
    """The partitions to add (new job files, new storyboards) and to delete (strays, and
    storyboards whose new version has no shots), and when each stray that stays was first
    seen (for the cursor)."""
    job_files_partitions = farm.job_files_partitions
    storyboard_partitions = farm.storyboard_partitions
    instance = context.instance
    existing = set(instance.get_dynamic_partitions(farm.job_files_partitions_name))
    new_keys = [key for key in accepted.keys if key not in existing]
    existing_storyboards = set(instance.get_dynamic_partitions(farm.storyboard_partitions_name))
    new_storyboards = [key for key in accepted.with_shots if key not in existing_storyboards]
    # A storyboard whose new version has no shots is no film any more.
    unshot = [key for key in accepted.without_shots if key in existing_storyboards]
    stray, stray_storyboards, stray_seen = stray_partitions(
        instance,
        present,
        existing,
        existing_storyboards - set(accepted.with_shots) - set(accepted.without_shots),
        stray_since(context.cursor),
        time.time(),
        farm,
    )
    for key in stray:
        context.log.warning(
            f"partition {key} names no job file in the watched folders and was never "
            f"rendered (added by hand?): deleted {STRAY_GRACE_S:.0f} s after it was seen"
        )
    for key in stray_storyboards:
        context.log.warning(
            f"partition {key} of storyboards names no job file with shots and has no film "
            f"(added by hand?): deleted {STRAY_GRACE_S:.0f} s after it was seen"
        )
    for key in unshot:
        context.log.info(f"partition {key}: no job has a shot number now; no film partition")
    requests: list[AddDynamicPartitionsRequest | DeleteDynamicPartitionsRequest] = []
    if new_keys:
        requests.append(job_files_partitions.build_add_request(new_keys))
    if new_storyboards:
        requests.append(storyboard_partitions.build_add_request(new_storyboards))
    if stray:
        requests.append(job_files_partitions.build_delete_request(stray))
    if unshot or stray_storyboards:
        requests.append(storyboard_partitions.build_delete_request(unshot + stray_storyboards))
    return requests, stray_seen


def job_file_tick(context: SensorEvaluationContext, farm: Farm = DEFAULT_FARM) -> SensorResult:
    """One tick of the farm's job-file sensor (see the module docstring)."""
    previous = parse_cursor(context.cursor)
    by_key = _by_key(farm.dirs())
    seen: dict[str, SeenFile] = {}
    ambiguous, candidates = _changed_files(by_key, previous, seen)
    accepted = _accept(context, farm, candidates, previous, seen)
    run_requests = accepted.run_requests

    if len(run_requests) > LOGGED_REQUESTS:
        context.log.info(
            f"and {len(run_requests) - LOGGED_REQUESTS} more job files, a run requested for "
            f"each ({len(run_requests)} in all)"
        )
    # Found this tick: logged and given as the skip reason.
    problems = ambiguous + accepted.problems
    for problem in problems:
        context.log.error(problem)
    if accepted.deferred:
        context.log.info(
            f"{accepted.deferred} changed job files left for the next tick "
            f"({accepted.max_runs} runs per tick)"
        )
    requests, stray_seen = _partition_requests(context, farm, set(by_key), accepted)

    # Every problem standing now (not only this tick's), for the ``valid`` check; it is
    # evaluated again only when they change, so the asset stays red until they are fixed.
    standing = (
        missing_folders(farm.dirs())
        + ambiguous
        + [
            seen[key].errors or f"partition {key}: not valid; touch the file to see why"
            for key in sorted(seen)
            if not seen[key].ok
        ]
    )
    reported = _digest(standing)
    events: list[AssetMaterialization | AssetCheckEvaluation] = list(accepted.materializations)
    if reported != reported_digest(context.cursor):
        events.append(job_files_check_evaluation(standing, farm.job_files_key))

    skip_reason: str | None = None
    if not run_requests:
        skip_reason = "\n\n".join(problems) if problems else "no new or changed job files"
    return SensorResult(
        run_requests=run_requests,
        skip_reason=skip_reason,
        asset_events=events,
        cursor=dump_cursor(seen, reported, stray_seen),
        dynamic_partitions_requests=requests,
    )
