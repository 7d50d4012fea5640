"""Every ``sh`` block of the README and of docs/*.md, run as written (bash -euo pipefail) in
a project folder like a fresh clone after ``make``, against fake ComfyUI servers: each exits
0 and does what the page says (or is listed in NOT_RUN with why). The fakes' ports in the
pages (82xx, the UI's 3000) are swapped for free ones, so the blocks never meet a real
ComfyUI or another engineer's UI. Every ``--help`` in docs/command-line.md is the
program's own."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from comfy_assets.cli.main import COMMANDS
from comfy_assets.jobs.parse import load_job_file
from fake_comfy import FakeComfy
from tests.ports import free_port
from tests.s3_server import S3Server

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)

pytestmark = pytest.mark.timeout(400)

SH_BLOCK = re.compile(r"^( *)```sh\n(.*?)^\1```", re.M | re.S)
# The fakes' ports in the README's examples, the UI's, and the API's (docs/api.md).
README_PORTS = re.compile(r"\b(8288|8289|8290|8291|8292|3000|8380)\b")

# Blocks no test runs, each with why. Any other block must be claimed by a test below.
BENCH = "a benchmark: minutes of machine time; tests/system/test_benches.py runs each bench small"
HOST = "sets up a production host (/opt, sudo, system services, a real ComfyUI per GPU)"
NOT_RUN = {
    "make demo    #": "make reinstalls the venv; tests/cli/test_demo.py runs the demo, and "
    "make test is this suite",
    "dg scaffold defs comfy_assets.RenderFarm draft": "runs in a project made by "
    "create-dagster: tests/dagster/test_component.py makes one and runs these commands there",
    "bench/overhead.py": BENCH + " (its first run needs a real ComfyUI)",
    "bench/http_clients.py": BENCH,
    "times.append(time.perf_counter() - t)": "a timing of 23 health probes: a benchmark",
    "bench/models.py": BENCH,
    "bench/farm.py        #": BENCH,
    "bench/pool.py": BENCH,
    "bench/million_reads.py": BENCH,
    "bench/results.py": BENCH,
    "bench/renders_metadata.py": BENCH,
    "bench/gap_parts.py": BENCH,
    "bench/throughput.py": BENCH,
    "bench/s3.py; done": BENCH,
    "bench/sensor.py": BENCH,
    "the measured farm this projection starts from": BENCH,
    "bench/faults.py --schedules 200": "the fault campaign: tests/system/test_faults.py is the "
    "suite's part of it, bench/faults.py the rest (a benchmark)",
    "cp dagster_home/production/dagster.yaml /opt": HOST,
    "sudo -u postgres createuser render": HOST,
    "DAGSTER_POSTGRES_URL=postgresql+psycopg2://render": HOST + " (an environment file)",
    "dagster code-server start -m comfy_assets.definitions": HOST,
    "export COMFY_ASSETS_RABBITMQ_URL=amqp://user:pass@rabbit": HOST + " (hosts rabbit, "
    "postgres); tests/service/test_worker_rabbitmq.py runs the worker on this machine's RabbitMQ",
    "rabbitmqctl set_policy render-jobs": HOST + " (RabbitMQ's own command line)",
    "chromium --headless --screenshot": "needs a browser and a kept demo: how docs/ui.md "
    "was looked at",
}
# A string of each block a test below runs.
RUN_HERE = [
    "fake_comfy --port 8288",
    "--policy draft --out tour/draft.mp4",
    ".venv/bin/dg check defs",
    ".venv/bin/dg dev --port 3000",
    "dagster job launch",
    "comfy-assets api --store tour/api/store",
    "make wheel",
    "tour/s3/fake.log",
]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_blocks() -> list[str]:
    """The ```sh blocks of the README and docs/*.md, without their indentation."""
    return [
        "\n".join(line[len(indent) :] for line in body.splitlines())
        for page in PAGES
        for indent, body in SH_BLOCK.findall(page.read_text())
    ]


def readme_block(containing: str) -> str:
    """The one ```sh block of the README or docs holding ``containing``."""
    (block,) = [block for block in readme_blocks() if containing in block]
    return block


def with_free_ports(block: str, ports: dict[str, int]) -> str:
    """``block`` with each README port swapped for a free one (the same one every time)."""

    def swap(match: re.Match[str]) -> str:
        if match.group(1) not in ports:
            ports[match.group(1)] = free_port()
        return str(ports[match.group(1)])

    return README_PORTS.sub(swap, block)


def refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder as a fresh clone after ``make`` has it: .venv, the packages (dg
    looks for them there), pyproject.toml, workspace.yaml, the template home, data."""
    root = tmp_path / "project"
    root.mkdir()
    (root / ".venv").symlink_to(VENV)
    for name in ("comfy_assets", "fake_comfy", "dagster_home"):
        (root / name).symlink_to(REPO / name)
    for name in ("pyproject.toml", "workspace.yaml"):
        shutil.copy(REPO / name, root / name)
    for name in ("jobs", "workflows"):
        shutil.copytree(REPO / "data" / name, root / "data" / name)
    return root


def clean_env() -> dict[str, str]:
    """This environment without the project's settings (a new shell)."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("COMFY_ASSETS_") and key != "DAGSTER_HOME"
    }


def start_block(block: str, cwd: Path) -> subprocess.Popen[str]:
    """``block`` started in bash as pasted into a terminal that stops at the first error, in
    a process group of its own, without our COMFY_ASSETS_ settings; its output in one pipe."""
    return subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_block(block: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``block`` in bash as pasted into a terminal that stops at the first error; stop
    what it left in the background (its process group) when it ends."""
    proc = start_block(block, cwd)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Look at ``condition`` every 50 ms (the condition is the signal, not the time)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_every_sh_block_of_the_readme_is_run_here_or_said_why_not() -> None:
    for block in readme_blocks():
        claimed = [key for key in [*NOT_RUN, *RUN_HERE] if key in block]
        assert len(claimed) == 1, f"no test (or several) runs this README block:\n{block}"
    for key in [*NOT_RUN, *RUN_HERE]:
        assert sum(key in block for block in readme_blocks()) == 1, key


def test_the_by_hand_example_renders_requeues_and_cuts_the_film(project: Path) -> None:
    ports: dict[str, int] = {}
    example = with_free_ports(readme_block("fake_comfy --port 8288"), ports)

    before = [p.name for p in project.iterdir()]
    done = run_block(example, project)

    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert "run exited 1 (a dead letter)" in out
    # shot 3's events
    assert "failed_fatal gpu2 attempt 1 failed on gpu2, the only server that can run it: " in out
    assert "job 24c31bfd-4ab1-5bcb-bf13-588f244c3bf2: requeued (pending)" in out
    assert "summary: 6 done, 0 dead-lettered" in out
    assert "film: 6 shots, 7.750 s, delivery" in out
    assert f"gpu3 unreachable: connection refused (http://127.0.0.1:{ports['8291']})" in out
    assert (project / "tour" / "reel.mp4").stat().st_size > 0
    # Everything it wrote is inside tour/, which git ignores: nothing else in the folder.
    assert sorted(p.name for p in project.iterdir()) == sorted([*before, "tour"])
    assert "/tour/" in (REPO / ".gitignore").read_text().splitlines()
    # The dead letter's only attempt ended on gpu2: nothing could render twice.
    assert "may render twice" not in out
    job_file = load_job_file(project / "data/jobs/storyboard.jsonl")
    frame = pd.read_csv(project / "tour/store/storyboard/results.csv")
    assert frame["job_id"].tolist() == [job.id for job in job_file.jobs]
    assert set(frame["state"]) == {"succeeded"}
    assert frame["shot"].tolist() == [1, 2, 3, 4, 5, 6]
    for port in (ports["8288"], ports["8289"], ports["8290"]):  # the fakes were stopped
        wait_until(lambda port=port: refused(port), f"the fake on port {port} to stop")

    # docs/films.md's command, on the store the tour left.
    draft = run_block(readme_block("--policy draft --out tour/draft.mp4"), project)

    assert draft.returncode == 0, draft.stdout
    assert "film: 6 shots, 7.750 s, draft" in draft.stdout
    assert (project / "tour" / "draft.mp4").stat().st_size > 0


def test_dg_checks_and_lists_the_definitions(project: Path) -> None:
    done = run_block(readme_block(".venv/bin/dg check defs"), project)

    assert done.returncode == 0, done.stdout
    assert "All definitions loaded successfully." in done.stdout
    for name in ("renders", "films", "render_job", "job_file_sensor", "films_automation_sensor"):
        assert name in done.stdout
    assert "virtual environment" not in done.stdout  # no warning about an inactive venv


def test_dg_dev_serves_the_ui_until_stopped(project: Path) -> None:
    ports: dict[str, int] = {}
    command = with_free_ports(readme_block(".venv/bin/dg dev --port 3000"), ports)
    url = f"http://127.0.0.1:{ports['3000']}/server_info"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            return False

    proc = start_block(command, project)
    try:
        wait_until(lambda: answers() or proc.poll() is not None, "dg dev's UI", 240)
        assert proc.poll() is None, proc.communicate()[0]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C
        out, _ = proc.communicate(timeout=120)
    assert "Serving dagster-webserver" in out or "dagster-webserver" in out, out


@contextmanager
def serving(*fakes: FakeComfy) -> Iterator[str]:
    """Serve the fakes in threads; yield them as a COMFY_ASSETS_SERVERS value."""
    with ExitStack() as stack:
        yield ",".join(
            f"gpu{i}={stack.enter_context(fake.serve_in_thread(port=0))}"
            for i, fake in enumerate(fakes)
        )


def test_the_dagster_launches_queue_a_run_and_render_a_partition(project: Path) -> None:
    # The demo's home as make demo KEEP=1 leaves it: the partition the sensor added, and
    # .demo/env naming the home, the servers and the store.
    home = project / ".demo" / "dagster_home"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    with DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("job_files", ["images"])
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    store = project / ".demo" / "store"
    with ExitStack() as stack:
        servers = stack.enter_context(serving(*fakes))
        (project / ".demo" / "env").write_text(
            f"export DAGSTER_HOME={home}\n"
            f"export COMFY_ASSETS_SERVERS={servers}\n"
            f"export COMFY_ASSETS_STORE={store}\n"
            f"export COMFY_ASSETS_JOB_DIRS={project / 'data' / 'jobs'}\n"
        )

        done = run_block(readme_block("dagster job launch"), project)

    assert done.returncode == 0, done.stdout
    (run_id,) = re.findall(r"^launched run ([0-9a-f-]{36})$", done.stdout, re.M)
    uuid.UUID(run_id)
    job_file = load_job_file(project / "data" / "jobs" / "images.jsonl")
    with DagsterInstance.from_config(str(home)) as instance:
        launched = instance.get_run_by_id(run_id)
        assert launched is not None
        assert launched.job_name == "render_job"
        assert launched.tags["dagster/partition"] == "images"
        assert launched.status == DagsterRunStatus.QUEUED  # the daemon (not running here) takes it
        # dg launch rendered the partition in its own process: every job once.
        (in_process,) = [
            run
            for run in instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.SUCCESS]))
        ]
        assert in_process.tags["dagster/partition"] == "images"
        assert "images" in instance.get_materialized_partitions(AssetKey("renders"))
    executed = sum(len(fake.stats["runs"]) for fake in fakes)
    assert executed == len(job_file.jobs)
    assert (store / "images" / "outputs.contact.png").is_file()
    # render_results came along: every job a row.
    assert len(pd.read_csv(store / "images" / "results.csv")) == len(job_file.jobs)


HELP_SECTION = re.compile(
    r"^### `(comfy-assets[^`]*|python -m fake_comfy) --help`\n\n```text\n(.*?)^```", re.M | re.S
)


def test_every_help_in_the_command_line_reference_is_the_programs_own() -> None:
    sections = dict(HELP_SECTION.findall((REPO / "docs" / "command-line.md").read_text()))
    commands = ["", *COMMANDS]
    wanted = [f"comfy-assets {c}".strip() for c in commands] + ["python -m fake_comfy"]
    missing = sorted(set(wanted) - set(sections))
    assert not missing, f"docs/command-line.md has no `--help` section for {missing}"
    assert sorted(sections) == sorted(wanted), "a section for a command that is not there"
    env = {**clean_env(), "COLUMNS": "100"}
    for title, shown in sections.items():
        argv = title.split()
        program = (
            [str(VENV / "bin" / "comfy-assets")]
            if argv[0] == "comfy-assets"
            else [str(VENV / "bin" / "python"), "-m", "fake_comfy"]
        )
        rest = argv[1:] if argv[0] == "comfy-assets" else []
        done = subprocess.run(
            [*program, *rest, "--help"], capture_output=True, text=True, env=env, check=True
        )
        assert done.stdout.rstrip() == shown.rstrip(), (
            f"`{title} --help` in docs/command-line.md should read:\n{done.stdout}"
        )


@pytest.mark.s3
def test_the_storage_docs_example_renders_into_a_bucket_cuts_and_syncs(
    project: Path, s3_endpoint: S3Server
) -> None:
    """docs/storage.md's example against a SeaweedFS of the tests (its endpoint, keys and
    a fresh bucket swapped in for the page's): every output, results.csv and the film are
    objects, nothing but the records and the synced copies is written on this disk, and
    the second sync copies nothing."""
    import hashlib

    from comfy_assets.film.probe import probe
    from comfy_assets.store.files import S3FileStore, S3Settings
    from comfy_assets.store.files.local import file_copy

    bucket = f"docs-{uuid.uuid4().hex[:12]}"
    s3_endpoint.create_bucket(bucket)
    block = with_free_ports(readme_block("tour/s3/fake.log"), {})
    for page, ours in (
        ("http://127.0.0.1:8333", s3_endpoint.endpoint),
        ("AWS_ACCESS_KEY_ID=farm-key", f"AWS_ACCESS_KEY_ID={s3_endpoint.access_key}"),
        ("AWS_SECRET_ACCESS_KEY=farm-secret", f"AWS_SECRET_ACCESS_KEY={s3_endpoint.secret_key}"),
        ("s3://renders/", f"s3://{bucket}/"),
    ):
        assert page in block
        block = block.replace(page, ours)

    done = run_block(block, project)

    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    shown = f"s3://{bucket}/studio/files/storyboard"
    for line in (
        "summary: 6 done, 0 dead-lettered",
        f"results: {shown}/results.csv",
        f"{shown}/film.mp4",
        "film: 6 shots, 7.750 s, delivery, concat reencode",
        "sync storyboard -> tour/s3/desk: 0 new, 0 changed, 6 unchanged, 0 failed (0 bytes copied)",
    ):
        assert line in lines, line
    [first_sync] = [line for line in lines if ": 6 new, 0 changed, 0 unchanged, 0 failed (" in line]
    assert first_sync.startswith("sync storyboard -> tour/s3/desk: ")
    assert s3_endpoint.secret_key not in done.stdout
    # On this disk: the records and the desk copies only (no store folder, no film).
    assert sorted(p.name for p in (project / "tour" / "s3").iterdir()) == [
        "desk",
        "fake.log",
        "records.db",
    ]
    objects = S3FileStore(
        f"s3://{bucket}/studio",
        S3Settings(
            endpoint=s3_endpoint.endpoint,
            access_key_id=s3_endpoint.access_key,
            secret_access_key=s3_endpoint.secret_key,
        ),
    )
    frame = pd.read_csv(objects.open_file("storyboard/results.csv"), dtype=str)
    listed = {cell.split(":")[1] for cell in frame["files"]}  # name:sha256[:12]
    desk = [p for p in (project / "tour/s3/desk").rglob("*") if p.is_file()]
    assert len(desk) == 6 == len(listed)
    assert {hashlib.sha256(p.read_bytes()).hexdigest()[:12] for p in desk} == listed
    film = file_copy(objects, "storyboard/film.mp4", project / "check")
    assert probe(film).duration_s == pytest.approx(7.75, abs=1 / 24)


def test_the_api_docs_example_submits_follows_and_fetches_a_picture(project: Path) -> None:
    """docs/api.md's one sh block, on a queue of its own (deleted after)."""
    import asyncio
    import hashlib
    import json

    import aio_pika

    block = readme_block("comfy-assets api --store tour/api/store")
    queue = f"test-docs-api-{uuid.uuid4().hex[:8]}"
    assert block.count("--queue renders") == 2
    example = with_free_ports(block, {}).replace("--queue renders", f"--queue {queue}")
    try:
        done = run_block(example, project, timeout_s=120)
    finally:

        async def delete_queues() -> None:
            url = "amqp://guest:guest@127.0.0.1:5672/"
            async with await aio_pika.connect(url) as connection:
                channel = await connection.channel()
                for name in (queue, f"{queue}.dead"):
                    await channel.queue_delete(name)

        asyncio.run(delete_queues())

    assert done.returncode == 0, done.stdout
    assert '"state": "pending"' in done.stdout  # the 202
    assert "event: end" in done.stdout and '"state": "succeeded"' in done.stdout
    job = json.loads((project / "tour/api/job.json").read_text())
    picture = (project / "tour/api/picture.png").read_bytes()
    assert picture.startswith(b"\x89PNG")
    assert hashlib.sha256(picture).hexdigest() in {f["sha256"] for f in job["files"]}
    assert f"picture.png: {job['files'][0]['url']}" in done.stdout


def test_the_wheel_make_builds_installs_into_another_projects_environment(tmp_path: Path) -> None:
    """docs/dagster.md's install block in a copy of the clone: ``make wheel`` as written;
    the project ``../studio`` is a fresh venv that sees this environment's packages (a
    ``.pth`` file) and gets the wheel with ``--no-deps --ignore-installed``, so nothing is
    downloaded and this environment's editable install is left alone."""
    clone = tmp_path / "comfy-assets"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md", "Makefile"):
        shutil.copy(REPO / name, clone / name)
    for name in ("comfy_assets", "fake_comfy"):
        shutil.copytree(REPO / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    studio = tmp_path / "studio" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(studio)], check=True, timeout=120)
    (site,) = (studio / "lib").glob("python3*/site-packages")
    (ours,) = (VENV / "lib").glob("python3*/site-packages")
    (site / "this_environment.pth").write_text(f"{ours}\n")
    block = readme_block("make wheel").replace(
        "-m pip install ", "-m pip install --quiet --no-deps --ignore-installed "
    )

    done = run_block(block, clone, timeout_s=300)

    assert done.returncode == 0, done.stdout
    assert (clone / "dist" / "comfy_assets-0.1.0-py3-none-any.whl").is_file()
    assert "usage: comfy-assets [-h] COMMAND ..." in done.stdout
    found = subprocess.run(
        [
            str(studio / "bin" / "python"),
            "-c",
            "import comfy_assets.farm.component as c, importlib.metadata as m; print(c.__file__); "
            "print([e.value for e in m.entry_points(group='dagster_dg_cli.registry_modules')])",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.splitlines()
    assert found[0] == str(site / "comfy_assets" / "farm" / "component.py")  # the wheel's copy
    assert "comfy_assets" in found[1]  # how dg finds comfy_assets.RenderFarm
