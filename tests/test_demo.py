"""The end-to-end demo as a user runs it (about 20 s: real daemon, sensor, fake servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from comfy_assets.jobs.parse import load_job_file

REPO = Path(__file__).resolve().parents[1]

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
    demo_dir = tmp_path / "demo"

    done = run_demo("--dir", str(demo_dir))

    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("images", "storyboard"):
        job_file = load_job_file(REPO / "data" / "jobs" / f"{name}.jsonl")
        frame = pd.read_csv(demo_dir / "store" / name / "results.csv", dtype=str)
        assert frame["job_id"].tolist() == [job.id for job in job_file.jobs]
        assert set(frame["state"]) == {"succeeded"}
        assert f"partition {name} " in done.stdout
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
