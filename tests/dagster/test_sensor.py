"""The job-file sensor: partitions added and runs requested exactly once per file version."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSeverity,
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRunStatus,
    DeleteDynamicPartitionsRequest,
    SensorResult,
    build_sensor_context,
)
from dagster._core.test_utils import create_run_for_test

from comfy_assets.farm import job_file_sensor as sensors
from comfy_assets.farm.partitions import (
    AmbiguousJobFileError,
    find_job_file,
    job_dirs_from_env,
    job_files_partitions,
    partition_key_for,
    storyboard_partitions,
)
from comfy_assets.sensors import SeenFile, dump_cursor, job_file_sensor, parse_cursor

REPO = Path(__file__).resolve().parents[2]


def job_line(n: int, color: int = 0x336699) -> str:
    job_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"test-sensor/{n}"))
    return json.dumps(
        {"id": job_id, "workflow": "../workflows/image.json", "set": {"1.color": color}}
    )


def write_jobs(path: Path, count: int = 2, color: int = 0x336699) -> Path:
    path.write_text("".join(job_line(n, color) + "\n" for n in range(count)))
    return path


def tick(instance: DagsterInstance, cursor: str | None) -> SensorResult:
    """One sensor evaluation, applying its partition requests like the daemon does."""
    with build_sensor_context(instance=instance, cursor=cursor) as context:
        result = job_file_sensor(context)
    assert isinstance(result, SensorResult)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    for request in result.dynamic_partitions_requests:
        if isinstance(request, DeleteDynamicPartitionsRequest):
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
        else:
            instance.add_dynamic_partitions(
                request.partitions_def_name, list(request.partition_keys)
            )
    return result


def valid_check(result: SensorResult) -> list[AssetCheckEvaluation]:
    """The evaluations of job_files' check ``valid`` the tick reported."""
    return [
        event
        for event in result.asset_events
        if isinstance(event, AssetCheckEvaluation) and event.check_name == "valid"
    ]


def latest_valid(instance: DagsterInstance) -> AssetCheckEvaluation:
    """The evaluation of ``valid`` the UI shows now (the latest recorded)."""
    key = AssetCheckKey(AssetKey("job_files"), "valid")
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key([key])[key]
    return record.event.dagster_event.event_specific_data


def run_keys(result: SensorResult) -> list[str]:
    return sorted(request.run_key or "" for request in result.run_requests)


def sha16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_new_files_become_partitions_with_one_run_each(jobs_dir: Path, instance) -> None:
    a = write_jobs(jobs_dir / "shots a.jsonl")
    b = write_jobs(jobs_dir / "b.jsonl", count=3)

    result = tick(instance, None)

    assert run_keys(result) == sorted([f"shots_a:{sha16(a)}", f"b:{sha16(b)}"])
    assert sorted(r.partition_key for r in result.run_requests) == ["b", "shots_a"]
    assert sorted(instance.get_dynamic_partitions(job_files_partitions.name)) == ["b", "shots_a"]
    tags = {r.partition_key: r.tags for r in result.run_requests}
    assert tags["b"][sensors.JOB_FILE_SHA_TAG] == sensors._sha256_file(b)


def test_second_tick_with_the_same_files_requests_nothing(jobs_dir: Path, instance) -> None:
    write_jobs(jobs_dir / "a.jsonl")
    first = tick(instance, None)
    assert len(first.run_requests) == 1

    second = tick(instance, first.cursor)

    assert second.run_requests == []
    assert second.dynamic_partitions_requests == []
    assert second.skip_reason is not None


def test_changed_file_requests_one_run_with_a_new_run_key(jobs_dir: Path, instance) -> None:
    path = write_jobs(jobs_dir / "a.jsonl")
    first = tick(instance, None)
    write_jobs(path, color=0xFF0000)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))  # a later mtime, whatever the clock

    second = tick(instance, first.cursor)
    third = tick(instance, second.cursor)

    assert run_keys(second) == [f"a:{sha16(path)}"]
    assert run_keys(second) != run_keys(first)
    assert second.dynamic_partitions_requests == []  # the partition exists already
    assert third.run_requests == []


def write_storyboard(path: Path, shots: int = 2) -> Path:
    lines = [json.loads(job_line(n)) | {"shot": n} for n in range(shots)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_only_a_job_file_with_shots_is_a_partition_of_films(jobs_dir: Path, instance) -> None:
    write_jobs(jobs_dir / "images.jsonl")
    story = write_storyboard(jobs_dir / "story.jsonl")

    first = tick(instance, None)

    assert sorted(instance.get_dynamic_partitions(job_files_partitions.name)) == [
        "images",
        "story",
    ]
    assert instance.get_dynamic_partitions(storyboard_partitions.name) == ["story"]

    # The storyboard loses its shots: no film partition waits for it any more.
    write_jobs(story, color=0xFF0000)
    os.utime(story, ns=(0, story.stat().st_mtime_ns + 1_000_000))
    tick(instance, first.cursor)

    assert instance.get_dynamic_partitions(storyboard_partitions.name) == []


def aged(cursor: str | None, seconds: float) -> str:
    """``cursor`` as if every partition naming no job file had been seen ``seconds`` earlier."""
    data = json.loads(cursor or "{}")
    data["stray"] = {key: first - seconds for key, first in data.get("stray", {}).items()}
    return json.dumps(data)


def test_a_partition_added_by_hand_that_names_no_job_file_is_deleted_after_a_while(
    jobs_dir: Path, instance
) -> None:
    write_jobs(jobs_dir / "a.jsonl")
    write_storyboard(jobs_dir / "gone.jsonl")
    first = tick(instance, None)
    instance.report_runless_asset_event(AssetMaterialization("renders", partition="gone"))
    (jobs_dir / "gone.jsonl").unlink()  # rendered once: its partition keeps its history
    # What the UI's Materialize dialog does with "+ Add a partition": a key with no file,
    # and a film partition for a job file without shots.
    instance.add_dynamic_partitions(job_files_partitions.name, ["nosuch"])
    instance.add_dynamic_partitions(storyboard_partitions.name, ["nosuch", "a"])

    # Kept for a while: the user launches a run of it right after adding it.
    second = tick(instance, first.cursor)
    assert "nosuch" in instance.get_dynamic_partitions(job_files_partitions.name)
    third = tick(instance, aged(second.cursor, sensors.STRAY_GRACE_S - 5))
    assert "nosuch" in instance.get_dynamic_partitions(job_files_partitions.name)

    fourth = tick(instance, aged(third.cursor, sensors.STRAY_GRACE_S))

    assert sorted(instance.get_dynamic_partitions(job_files_partitions.name)) == ["a", "gone"]
    # gone.jsonl has no film and no file: nothing to cut, its film partition goes too.
    assert instance.get_dynamic_partitions(storyboard_partitions.name) == []
    assert fourth.run_requests == []
    assert tick(instance, fourth.cursor).dynamic_partitions_requests == []


def test_a_partition_named_by_no_job_file_stays_while_a_run_of_it_is_running(
    jobs_dir: Path, instance
) -> None:
    first = tick(instance, None)
    instance.add_dynamic_partitions(job_files_partitions.name, ["nosuch"])
    run = create_run_for_test(
        instance,
        job_name="render_job",
        tags={"dagster/partition": "nosuch"},
        status=DagsterRunStatus.STARTED,
    )
    second = tick(instance, aged(tick(instance, first.cursor).cursor, sensors.STRAY_GRACE_S))
    assert instance.get_dynamic_partitions(job_files_partitions.name) == ["nosuch"]

    instance.report_run_canceled(run)
    tick(instance, aged(second.cursor, 1))

    assert instance.get_dynamic_partitions(job_files_partitions.name) == []


def test_touched_file_with_the_same_bytes_requests_nothing(jobs_dir: Path, instance) -> None:
    path = write_jobs(jobs_dir / "a.jsonl")
    first = tick(instance, None)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))

    second = tick(instance, first.cursor)

    assert second.run_requests == []
    assert parse_cursor(second.cursor)["a"].mtime_ns == path.stat().st_mtime_ns


def test_bad_file_is_reported_not_launched_and_launches_once_fixed(
    jobs_dir: Path, instance
) -> None:
    path = jobs_dir / "bad.jsonl"
    good = job_line(1)
    path.write_text(good + "\n" + good.replace('"1.color"', '"1.colour"') + "\n{not json\n")

    first = tick(instance, None)

    assert first.run_requests == []
    assert instance.get_dynamic_partitions(job_files_partitions.name) == []
    # Every error is reported, with its line.
    assert first.skip_reason is not None
    message = first.skip_reason.skip_message or ""
    assert f"{path}:2: set.1.colour" in message
    assert f"{path}:2: id: " in message  # the same id twice
    assert f"{path}:3: json" in message

    # Not re-validated while unchanged.
    second = tick(instance, first.cursor)
    assert second.run_requests == []

    write_jobs(path)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    fixed = tick(instance, second.cursor)
    assert run_keys(fixed) == [f"bad:{sha16(path)}"]
    assert instance.get_dynamic_partitions(job_files_partitions.name) == ["bad"]


def test_a_bad_file_fails_the_job_files_check_with_each_error_on_its_line_until_fixed(
    jobs_dir: Path, instance
) -> None:
    write_jobs(jobs_dir / "good.jsonl")
    first = tick(instance, None)
    (clean,) = valid_check(first)
    assert clean.passed

    path = jobs_dir / "bad.jsonl"
    line = job_line(7)
    path.write_text(line + "\n" + line.replace('"1.color"', '"1.colour"') + "\n{not json\n")
    bad = tick(instance, first.cursor)

    (failed,) = valid_check(bad)
    shown = latest_valid(instance)
    assert (shown.passed, shown.severity) == (False, AssetCheckSeverity.ERROR)
    errors = shown.metadata["errors"].value.splitlines()
    assert errors[0] == "```" and errors[-1] == "```"
    assert [e.split(": ")[0] for e in errors[1:-1]] == [f"{path}:2", f"{path}:2", f"{path}:3"]
    assert errors[3].startswith(f"{path}:3: json: ")
    assert shown.metadata["problems"].value == 1
    # The description (shown without a click) has the errors too, one a line.
    description = (shown.description or "").splitlines()
    assert description[0] == "1 job file is not valid, not launched until fixed:"
    assert description[2:] == errors  # the same code block, markdown as the UI renders it

    # Nothing new while the file stays bad: the failed verdict stays the latest.
    still = tick(instance, bad.cursor)
    assert valid_check(still) == []
    assert latest_valid(instance).passed is False

    write_jobs(path, count=1, color=0x010101)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    fixed = tick(instance, still.cursor)
    (passed,) = valid_check(fixed)
    assert passed.passed and latest_valid(instance).passed
    assert run_keys(fixed) == [f"bad:{sha16(path)}"]


def test_each_accepted_file_version_is_a_materialization_of_its_job_files_partition(
    jobs_dir: Path, instance
) -> None:
    path = write_jobs(jobs_dir / "a.jsonl", count=3)

    first = tick(instance, None)
    write_jobs(path, count=2)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    tick(instance, first.cursor)

    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey("job_files"), asset_partitions=["a"]), limit=10
    ).records
    metadata = [r.asset_materialization.metadata for r in records]  # newest first
    assert [m["jobs"].value for m in metadata] == [2, 3]
    assert metadata[0]["sha256"].value == sensors._sha256_file(path)
    assert metadata[0]["path"].value == str(path.resolve())


def test_a_bad_file_does_not_hold_back_good_ones(jobs_dir: Path, instance) -> None:
    (jobs_dir / "bad.jsonl").write_text("{not json\n")
    good = write_jobs(jobs_dir / "good.jsonl")

    result = tick(instance, None)

    assert run_keys(result) == [f"good:{sha16(good)}"]
    assert parse_cursor(result.cursor)["bad"].ok is False


def test_runs_per_tick_are_capped_and_the_rest_come_next_tick(
    jobs_dir: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMFY_ASSETS_MAX_RUNS_PER_TICK", "2")
    for n in range(5):
        write_jobs(jobs_dir / f"f{n}.jsonl")

    cursor = None
    per_tick = []
    keys: list[str] = []
    for _ in range(4):
        result = tick(instance, cursor)
        cursor = result.cursor
        per_tick.append(len(result.run_requests))
        keys += [r.partition_key or "" for r in result.run_requests]

    assert per_tick == [2, 2, 1, 0]
    assert sorted(keys) == [f"f{n}" for n in range(5)]


def test_same_name_in_two_folders_is_reported_and_not_launched(
    jobs_dir: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = jobs_dir.parent / "other"
    other.mkdir()
    write_jobs(jobs_dir / "shots.jsonl")
    write_jobs(other / "shots.jsonl")
    monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", f"{jobs_dir}{os.pathsep}{other}")

    result = tick(instance, None)

    assert result.run_requests == []
    assert "matches several job files" in (result.skip_reason.skip_message or "")
    with pytest.raises(AmbiguousJobFileError):
        find_job_file("shots")


def test_an_unchanged_folder_of_5000_files_is_only_listed(
    jobs_dir: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick over 5,000 known files stats them and reads none (the 2 s budget)."""
    seen = {}
    for n in range(5000):
        path = jobs_dir / f"j{n:04d}.jsonl"
        path.write_text(job_line(n) + "\n")
        stat = path.stat()
        seen[path.stem] = SeenFile("0" * 16, stat.st_size, stat.st_mtime_ns, True)

    def must_not_read(path: Path) -> None:
        raise AssertionError(f"{path} was read although unchanged")

    monkeypatch.setattr(sensors, "_sha256_file", must_not_read)
    monkeypatch.setattr(sensors, "scan_job_file", must_not_read)

    result = tick(instance, dump_cursor(seen))

    assert result.run_requests == []
    assert parse_cursor(result.cursor) == seen


def test_hidden_and_other_files_are_ignored(jobs_dir: Path, instance) -> None:
    write_jobs(jobs_dir / ".partial.jsonl")
    write_jobs(jobs_dir / "notes.txt")

    result = tick(instance, None)

    assert result.run_requests == []


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("images.jsonl", "images"),
        ("my shots (v2).jsonl", "my_shots__v2_"),
        ("a..b.jsonl", "a_b"),
        ("tab\there.jsonl", "tab_here"),
        ("café.jsonl", "caf_"),
        ("v1.2.jsonl", "v1.2"),
    ],
)
def test_partition_key_is_the_sanitized_file_name(name: str, key: str) -> None:
    assert partition_key_for(Path("/any/folder") / name) == key


def test_long_names_keep_distinct_keys() -> None:
    a = partition_key_for(Path("x" * 300 + "a.jsonl"))
    b = partition_key_for(Path("x" * 300 + "b.jsonl"))
    assert a != b and len(a) <= 100 and len(b) <= 100


def test_find_job_file_and_job_dirs(jobs_dir: Path) -> None:
    path = write_jobs(jobs_dir / "my shots.jsonl")
    assert job_dirs_from_env() == [jobs_dir]
    assert find_job_file("my_shots") == path
    with pytest.raises(FileNotFoundError):
        find_job_file("nothing")


def test_a_watched_folder_that_does_not_exist_fails_the_check_naming_it(
    jobs_dir: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    typo = jobs_dir.parent / "jbos"
    monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", os.pathsep.join([str(jobs_dir), str(typo)]))
    write_jobs(jobs_dir / "a.jsonl")

    first = tick(instance, None)

    (failed,) = valid_check(first)
    assert (failed.passed, failed.severity) == (False, AssetCheckSeverity.ERROR)
    description = (failed.description or "").splitlines()
    assert description[0] == "1 watched folder does not exist:"
    assert description[3] == (
        f"job folder {typo} does not exist: create it, or correct the farm's job_dirs"
    )
    assert run_keys(first) == [f"a:{sha16(jobs_dir / 'a.jsonl')}"]  # the other folder runs

    typo.mkdir()
    (passed,) = valid_check(tick(instance, first.cursor))
    assert passed.passed


def test_a_file_too_big_for_the_tick_is_hashed_and_requested_its_run_validating_it(
    jobs_dir: Path, instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sensors, "VALIDATED_IN_TICK_BYTES", 100)
    story = write_storyboard(jobs_dir / "story.jsonl", shots=3)
    broken = jobs_dir / "broken.jsonl"
    broken.write_text(job_line(7) + "\n{not json\n")

    def must_not_validate(path: Path, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{path} was validated in the tick")

    monkeypatch.setattr(sensors, "scan_job_file", must_not_validate)

    result = tick(instance, None)

    # The run of the broken file fails with its errors before posting anything.
    assert run_keys(result) == sorted([f"broken:{sha16(broken)}", f"story:{sha16(story)}"])
    assert instance.get_dynamic_partitions(storyboard_partitions.name) == ["story"]
    described = [
        event.description
        for event in result.asset_events
        if not isinstance(event, AssetCheckEvaluation)
    ]
    assert sorted(described) == [
        f"broken.jsonl: {broken.stat().st_size / 1e6:.1f} MB, run requested; its run validates it",
        f"story.jsonl: {story.stat().st_size / 1e6:.1f} MB, run requested; its run validates it",
    ]
