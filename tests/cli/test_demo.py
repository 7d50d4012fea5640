"""The end-to-end demo as a user runs it (about 20 s: real daemon, sensor, fake servers)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from comfy_assets.cli.demo import pages, write_env
from comfy_assets.jobs.parse import load_job_file

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "comfy_assets.cli.demo", "--no-ui", "--timeout", "150", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )


def test_demo_renders_every_job_file_through_the_daemon(tmp_path: Path) -> None:
    # The project's two job files in a folder of their own: not the working tree's
    # data/jobs, where a user following docs/ui.md may have dropped a file of theirs.
    data = tmp_path / "data"
    for name in ("images.jsonl", "storyboard.jsonl"):
        (data / "jobs").mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "data" / "jobs" / name, data / "jobs" / name)
    shutil.copytree(REPO / "data" / "workflows", data / "workflows")
    demo_dir = tmp_path / "demo"

    done = run_demo("--dir", str(demo_dir), "--jobs", str(data / "jobs"))

    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("images", "storyboard"):
        job_file = load_job_file(data / "jobs" / f"{name}.jsonl")
        frame = pd.read_csv(demo_dir / "store" / name / "results.csv", dtype=str)
        assert frame["job_id"].tolist() == [job.id for job in job_file.jobs]
        assert set(frame["state"]) == {"succeeded"}
        assert f"partition {name} " in done.stdout
    assert (demo_dir / "store" / "storyboard" / "film.mp4").stat().st_size > 0
    assert "every job line has its row" in done.stdout
    assert not (demo_dir / "pids.json").exists()  # nothing kept running


def test_demo_stops_at_once_on_an_invalid_job_file(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    line = {"id": "not-a-uuid", "workflow": "missing.json"}
    (jobs / "broken.jsonl").write_text(json.dumps(line) + "\n")

    done = run_demo("--dir", str(tmp_path / "demo"), "--jobs", str(jobs))

    assert done.returncode == 1
    assert "broken.jsonl:1: id: not a lowercase hyphenated UUID" in done.stdout
    assert not (tmp_path / "demo").exists()  # failed before starting anything


def test_the_printed_pages_open_each_asset_on_a_partition() -> None:
    lines = pages("http://127.0.0.1:3310", ["images", "storyboard"], ["storyboard"])

    links = [line.split()[-1] for line in lines if "view=partitions" in line]
    assert links == [
        "http://127.0.0.1:3310/assets/renders?view=partitions&partition=images",
        "http://127.0.0.1:3310/assets/renders?view=partitions&partition=storyboard",
        "http://127.0.0.1:3310/assets/films?view=partitions&partition=storyboard",
    ]


def test_the_kept_demos_settings_load_in_a_shell(tmp_path: Path) -> None:
    env = {
        "DAGSTER_HOME": str(tmp_path / "a home"),
        "COMFY_ASSETS_SERVERS": "gpu0=http://127.0.0.1:1,gpu1=http://127.0.0.1:2",
        "COMFY_ASSETS_STORE": str(tmp_path / "store"),
        "PATH": "/usr/bin:/bin",
    }

    name = write_env(tmp_path, env)
    shown = subprocess.run(
        ["bash", "-c", f'. "{name}" && echo "$DAGSTER_HOME|$COMFY_ASSETS_SERVERS"'],
        capture_output=True,
        text=True,
        check=True,
    )

    assert shown.stdout.strip() == f"{env['DAGSTER_HOME']}|{env['COMFY_ASSETS_SERVERS']}"
    assert "PATH" not in (tmp_path / "env").read_text()  # only the project's settings
