"""``dg launch --partition KEY`` of a job file the sensor has not added yet: the
definitions add it from the watched folder as they load (``launched_partition``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DagsterInstance, instance_for_test

from comfy_assets.farm.launched_partition import add_launched_partition, partition_argument
from comfy_assets.farm.names import farm_of
from tests.support import write_jobs


@pytest.mark.parametrize(
    "argv, key",
    [
        (["dg", "launch", "--assets", "renders", "--partition", "images"], "images"),
        (["dagster", "asset", "materialize", "--partition=shots"], "shots"),
        (["dagster", "dev"], None),
        (["dg", "launch", "--partition"], None),
    ],
)
def test_the_partition_is_read_from_the_command_line(argv: list[str], key: str | None) -> None:
    assert partition_argument(argv) == key


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "home").mkdir()
    with instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
        yield instance


def test_a_job_file_of_the_watched_folder_is_added_as_the_launched_partition(
    tmp_path: Path, home: DagsterInstance, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = write_jobs(tmp_path / "jobs" / "draft", 1, name="images.jsonl")
    farm = farm_of(key_prefix=["draft"], job_dirs=[tmp_path / "jobs" / "draft"])
    argv = ["dg", "launch", "--assets", "draft/renders", "--partition", "images"]

    assert add_launched_partition(farm, argv) == job_file

    with DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions("draft_job_files") == ["images"]
    said = capsys.readouterr().err
    assert f"added partition images of draft_job_files from {job_file}" in said
    assert add_launched_partition(farm, argv) is None  # added already: nothing said


def test_a_key_no_job_file_has_adds_nothing(tmp_path: Path, home: DagsterInstance) -> None:
    write_jobs(tmp_path / "jobs", 1, name="images.jsonl")
    farm = farm_of(job_dirs=[tmp_path / "jobs"])

    assert add_launched_partition(farm, ["dg", "launch", "--partition", "nosuch"]) is None

    with DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions("job_files") == []
