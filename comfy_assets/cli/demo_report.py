"""What the demo expects of each job file and what it found: the runs Dagster made, each
partition's materializations, its results CSV and film, said a line each."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
)

from comfy_assets.cli.demo_processes import Child, DemoFailed, announce, tail
from comfy_assets.farm.partitions import iter_job_files, partition_key_for
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import DONE
from comfy_assets.render.results import results_csv_path
from comfy_assets.sensors import JOB_FILE_SHA_TAG

FILMS_ASSET = "films"
ALL_RESULTS_ASSET = "all_results"
# The demo's sensor interval: the daemon evaluates sensors at most every 5 s anyway.
SENSOR_INTERVAL_S = 5


@dataclass
class Expected:
    """A job file the demo waits for: its partition and current version."""

    key: str
    path: Path
    sha256: str
    job_ids: list[str]
    shots: int  # jobs with a shot number: a storyboard has a film


def expected_files(jobs_dir: Path) -> list[Expected]:
    """Every job file of ``jobs_dir``, validated now so a bad one fails fast."""
    found: list[Expected] = []
    problems: list[str] = []
    for entry in sorted(iter_job_files([jobs_dir]), key=lambda e: e.name):
        path = Path(entry.path)
        try:
            job_file = load_job_file(path)
        except JobFileError as exc:
            problems.append(str(exc))
            continue
        shots = sum(1 for job in job_file.jobs if job.shot is not None)
        found.append(
            Expected(
                partition_key_for(path),
                path,
                job_file.sha256,
                [j.id for j in job_file.jobs],
                shots,
            )
        )
    if problems:
        raise DemoFailed("invalid job files:\n" + "\n".join(problems))
    if not found:
        raise DemoFailed(f"no job files (*.jsonl) in {jobs_dir}")
    return found


@dataclass
class PartitionState:
    """Where one job file stands: ``waiting``, ``running``, ``success`` or ``failed``."""

    state: str
    detail: str
    run_id: str | None = None


def partition_state(instance: DagsterInstance, item: Expected) -> PartitionState:
    """The state of the runs for this file version (retries keep the parent's tags)."""
    runs = instance.get_runs(
        filters=RunsFilter(tags={"dagster/partition": item.key, JOB_FILE_SHA_TAG: item.sha256})
    )
    if not runs:
        return PartitionState(
            "waiting", f"no run yet (the sensor ticks every {SENSOR_INTERVAL_S} s)"
        )
    for run in runs:
        if run.status == DagsterRunStatus.SUCCESS:
            return PartitionState("success", "SUCCESS", run.run_id)
    newest = runs[0]  # get_runs lists the newest first
    status = newest.status.value
    if not newest.is_finished:
        return PartitionState("running", f"run {newest.run_id[:8]} {status}", newest.run_id)
    if (
        newest.status == DagsterRunStatus.FAILURE
        and newest.tags.get("dagster/will_retry") == "true"
    ):
        return PartitionState(
            "running", f"run {newest.run_id[:8]} failed, retry coming", newest.run_id
        )
    return PartitionState("failed", f"run {newest.run_id[:8]} {status}", newest.run_id)


def run_errors(instance: DagsterInstance, run_id: str) -> str:
    """The step and run failures of a run, from its event log."""
    lines: list[str] = []
    kinds = {DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE}
    for record in instance.all_logs(run_id, of_type=kinds):
        event = record.dagster_event
        if event is None:
            continue
        lines.append(f"  {event.event_type_value} {event.step_key or ''}: {event.message or ''}")
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            lines.append("    " + error.to_string().strip().replace("\n", "\n    "))
    return "\n".join(lines) or "  (no step errors in the event log)"


def wait_for_runs(
    instance: DagsterInstance, expected: list[Expected], watched: list[Child], timeout_s: float
) -> dict[str, PartitionState]:
    """Poll the instance until every file version has a successful run, or fail."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    last_print = 0.0
    while True:
        for child in watched:
            if not child.alive():
                raise DemoFailed(
                    f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
                )
        states = {item.key: partition_state(instance, item) for item in expected}
        failed = {key: s for key, s in states.items() if s.state == "failed"}
        if failed:
            report = [
                f"partition {key}: {s.detail}\n{run_errors(instance, s.run_id or '')}"
                for key, s in failed.items()
            ]
            raise DemoFailed("runs failed:\n" + "\n".join(report))
        now = time.monotonic()
        snapshot = {key: s.detail for key, s in states.items()}
        parts = ", ".join(f"{key}: {s.detail}" for key, s in states.items())
        if snapshot != last or now - last_print > 15:
            done = sum(1 for s in states.values() if s.state == "success")
            announce(f"{done}/{len(expected)} job files rendered ({parts})")
            last, last_print = snapshot, now
        if all(s.state == "success" for s in states.values()):
            return states
        if now > deadline:
            daemon = next((c for c in watched if c.name == "daemon"), None)
            log = f"\ndaemon log:\n{tail(daemon.log)}" if daemon else ""
            raise DemoFailed(f"timed out after {timeout_s:.0f} s waiting for runs ({parts}){log}")
        time.sleep(1.0)


def _film_of(instance: DagsterInstance, item: Expected) -> AssetMaterialization | None:
    """The newest film materialization of the partition's current version, if any."""
    films = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(FILMS_ASSET), asset_partitions=[item.key]),
        limit=1,
        ascending=False,
    )
    film = films.records[0].asset_materialization if films.records else None
    if film is None or _meta_value(dict(film.metadata), "job_file_sha256") != item.sha256:
        return None
    return film


def wait_for_films(
    instance: DagsterInstance, expected: list[Expected], watched: list[Child], timeout_s: float
) -> None:
    """Wait (bounded) until films_automation_sensor has cut the film of every storyboard's
    current version; a films run that failed for good ends the wait with its errors."""
    storyboards = [item for item in expected if item.shots]
    if not storyboards:
        return
    announce("waiting for films_automation_sensor to cut the films")
    deadline = time.monotonic() + timeout_s
    while True:
        for child in watched:
            if not child.alive():
                raise DemoFailed(
                    f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
                )
        waiting = []
        for item in storyboards:
            if _film_of(instance, item) is not None:
                continue
            failed = [
                run
                for run in instance.get_runs(
                    filters=RunsFilter(
                        tags={"dagster/partition": item.key}, statuses=[DagsterRunStatus.FAILURE]
                    )
                )
                if AssetKey(FILMS_ASSET) in (run.asset_selection or ())
                and run.tags.get("dagster/will_retry") != "true"
            ]
            if failed:
                raise DemoFailed(
                    f"the film of {item.key} failed (run {failed[0].run_id[:8]}):\n"
                    + run_errors(instance, failed[0].run_id)
                )
            waiting.append(item.key)
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise DemoFailed(
                f"no film of {', '.join(waiting)} within {timeout_s:.0f} s of its render"
            )
        time.sleep(1.0)


def _meta_value(metadata: dict, key: str) -> object:
    entry = metadata.get(key)
    return getattr(entry, "value", entry)


def report_partition(
    instance: DagsterInstance, item: Expected, run_id: str, store_root: Path
) -> list[str]:
    """Print a partition's summary and results CSV; return what is wrong with it."""
    problems: list[str] = []
    counts: object = None
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION):
        materialization = record.asset_materialization
        if materialization and materialization.asset_key == AssetKey("renders"):
            counts = _meta_value(dict(materialization.metadata), "counts")
    checks = []
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
        event = record.dagster_event
        if event is not None:
            evaluation = event.asset_check_evaluation_data
            checks.append(f"{evaluation.check_name} {'passed' if evaluation.passed else 'FAILED'}")
            if not evaluation.passed:
                problems.append(f"{item.key}: check {evaluation.check_name} failed")
    if isinstance(counts, dict):  # {"succeeded": 20}: "20 succeeded", as `run` says it
        counts = ", ".join(f"{n} {state}" for state, n in counts.items()) or "none"
    announce(f"partition {item.key} ({item.path.name}, {len(item.job_ids)} jobs): {counts}")
    announce(f"  checks: {', '.join(checks) or 'none recorded'}")

    csv_path = results_csv_path(store_root, item.key)
    if not csv_path.exists():
        return [*problems, f"{item.key}: no results CSV at {csv_path}"]
    frame = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
    announce(f"  results: {csv_path} ({len(frame)} rows)")
    rows = frame["job_id"].tolist()
    if rows != item.job_ids:
        missing = sorted(set(item.job_ids) - set(rows))
        extra = sorted(set(rows) - set(item.job_ids))
        problems.append(
            f"{item.key}: CSV rows do not match the job lines "
            f"({len(rows)} rows, {len(item.job_ids)} lines; missing {missing}, extra {extra})"
        )
    not_done = frame[~frame["state"].isin(sorted(DONE))]
    for _, row in not_done.iterrows():
        problems.append(f"{item.key}: job {row['job_id']} is {row['state']}: {row['reason']}")

    if not item.shots:
        announce("  film: none (no job of this file has a shot number)")
        return problems
    film = _film_of(instance, item)
    if film is None:
        return [*problems, f"{item.key}: no film materialized for {item.shots} shots"]
    metadata = dict(film.metadata)
    link = _meta_value(metadata, "film")
    announce(f"  film: {_meta_value(metadata, 'path')}" + (f" (plays at {link})" if link else ""))
    return problems


def report_all_results(
    instance: DagsterInstance, expected: list[Expected], watched: list[Child], timeout_s: float
) -> list[str]:
    """Wait (bounded) until results_automation_sensor has built ``all_results`` after every
    partition's results; print its rows; return what is wrong."""
    keys = [item.key for item in expected]
    deadline = time.monotonic() + timeout_s
    announce("waiting for results_automation_sensor to build all_results")
    while True:
        for child in watched:
            if not child.alive():
                raise DemoFailed(
                    f"{child.name} exited with {child.proc.returncode}:\n{tail(child.log)}"
                )
        results = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey("render_results"), asset_partitions=keys),
            limit=len(keys) * 4,
            ascending=False,
        ).records
        newest_partition = max((r.timestamp for r in results), default=0.0)
        built = instance.fetch_materializations(
            AssetKey(ALL_RESULTS_ASSET), limit=1, ascending=False
        ).records
        built_one = built[0].asset_materialization if built else None
        if built_one is not None and built[0].timestamp > newest_partition:
            metadata = dict(built_one.metadata)
            rows = _meta_value(metadata, "dagster/row_count")
            announce(f"all_results: {rows} rows in {_meta_value(metadata, 'path')}")
            total = sum(len(item.job_ids) for item in expected)
            return [] if rows == total else [f"all_results has {rows} rows, not {total}"]
        if time.monotonic() > deadline:
            return [f"all_results was not built within {timeout_s:.0f} s of the renders"]
        time.sleep(1.0)
