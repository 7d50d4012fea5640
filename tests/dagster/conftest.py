"""What the Dagster layer's tests share: a watched job folder beside its workflows, and a
throwaway Dagster instance."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance, instance_for_test

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """``watch(workflow)``: ``tmp_path/workflows`` holding a copy of ``data/workflows/<workflow>``
    and an empty ``tmp_path/jobs``, named the one watched folder (``COMFY_ASSETS_JOB_DIRS``);
    returns the jobs folder."""

    def watched(workflow: str) -> Path:
        (tmp_path / "workflows").mkdir()
        shutil.copy(REPO / "data/workflows" / workflow, tmp_path / "workflows" / workflow)
        folder = tmp_path / "jobs"
        folder.mkdir()
        monkeypatch.setenv("COMFY_ASSETS_JOB_DIRS", str(folder))
        return folder

    return watched


@pytest.fixture
def jobs_dir(watch: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A watched job folder beside ``workflows/image.json``, with the sensor's default runs
    per tick whatever the shell sets."""
    monkeypatch.delenv("COMFY_ASSETS_MAX_RUNS_PER_TICK", raising=False)
    return watch("image.json")


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    """A Dagster instance in a temporary folder, gone after the test."""
    with instance_for_test() as inst:
        yield inst
