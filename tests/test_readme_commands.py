"""The README's Dagster commands, run as written (bash, from a project folder) against a
Dagster home like the demo's: the launch prints its run id and queues that run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)

pytestmark = pytest.mark.timeout(180)


def readme_block(containing: str) -> str:
    """The README's ```sh block holding ``containing``, without its indentation."""
    blocks = re.findall(r"^( *)```sh\n(.*?)^\1```", (REPO / "README.md").read_text(), re.M | re.S)
    (block,) = [
        "\n".join(line[len(indent) :] for line in body.splitlines())
        for indent, body in blocks
        if containing in body
    ]
    return block


def test_the_readme_launch_command_queues_the_partition_and_prints_its_run_id(
    tmp_path: Path,
) -> None:
    if not (VENV / "bin" / "dagster").exists():
        pytest.skip(f"no dagster command in {VENV}")
    # A project folder as the README assumes one: .venv, workspace.yaml and the demo's
    # home (made here from the template, with the partition the sensor would have added).
    (tmp_path / ".venv").symlink_to(VENV)
    workspace = (REPO / "workspace.yaml").read_text()
    (tmp_path / "workspace.yaml").write_text(
        workspace.replace("working_directory: .", f"working_directory: {REPO}")
    )
    home = tmp_path / ".demo" / "dagster_home"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("job_files", ["images"])

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_block("dagster job launch")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )

    assert done.returncode == 0, done.stderr
    (run_id,) = re.findall(r"^launched run ([0-9a-f-]{36})$", done.stdout, re.M)
    uuid.UUID(run_id)
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        assert run.job_name == "render_job"
        assert run.tags["dagster/partition"] == "images"
        assert run.status == DagsterRunStatus.QUEUED  # the daemon (not running here) takes it
