"""The production profile on PostgreSQL: it loads, and two runs share the fake servers.

Dagster's storage and the result store are two databases of the same server, as in
``dagster_home/production/dagster.yaml`` (the ``pg_url`` database holds the result store,
a second database made here holds Dagster's runs, event logs and sensor state).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter, job, op
from dagster._core.launcher import DefaultRunLauncher
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster._core.storage.local_compute_log_manager import LocalComputeLogManager
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, write_jobs

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

PROFILE = ROOT / "dagster_home" / "production" / "dagster.yaml"
DAGSTER = Path(sys.executable).parent / "dagster"


@pytest.fixture(scope="module")
def dagster_pg_url(pg_url: str) -> Iterator[str]:
    """A second fresh database on the ``pg_url`` server, for Dagster's own storage, as the
    profile wants its URL: ``postgresql+psycopg2://`` (Dagster's event log fails on
    psycopg 3, SQLAlchemy 2.1's default for ``postgresql://``). Dropped at the end."""
    server = sa.make_url(pg_url)
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    name = f"{server.database}_dagster_{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        url = server.set(drivername="postgresql+psycopg2", database=name)
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def production_home(tmp_path: Path, dagster_pg_url: str) -> tuple[Path, dict[str, str]]:
    """A DAGSTER_HOME holding the production profile, and the environment it reads."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PROFILE, home / "dagster.yaml")
    shared = tmp_path / "shared"
    env = {
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": dagster_pg_url,
        "DAGSTER_STORAGE_DIR": str(shared / "dagster_storage"),
        "DAGSTER_COMPUTE_LOGS_DIR": str(shared / "compute_logs"),
    }
    return home, env


@op
def say_hello() -> str:
    return "hello"


@job
def hello_job() -> None:
    say_hello()


def test_the_production_profile_loads_on_postgresql_with_its_queue_limits_and_retries(
    tmp_path, dagster_pg_url, pg_url, monkeypatch
):
    home, env = production_home(tmp_path, dagster_pg_url)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    instance = DagsterInstance.from_config(str(home))
    try:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        assert isinstance(instance.run_launcher, DefaultRunLauncher)

        coordinator = instance.run_coordinator
        assert isinstance(coordinator, QueuedRunCoordinator)
        queue = instance.get_concurrency_config().run_queue_config
        assert queue is not None and queue.max_concurrent_runs >= 1
        limits = {limit["key"]: limit for limit in queue.tag_concurrency_limits}
        assert limits["dagster/partition"]["limit"] == 1
        assert limits["dagster/partition"]["value"] == {"applyLimitPerUniqueValue": True}

        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] > 0
        assert instance.run_retries_enabled
        assert instance.run_retries_max_retries >= 1
        assert instance.get_settings("run_retries")["retry_on_asset_or_op_failure"] is False

        logs = instance.compute_log_manager
        assert isinstance(logs, LocalComputeLogManager)
        assert Path(logs._base_dir) == Path(env["DAGSTER_COMPUTE_LOGS_DIR"])
        assert Path(instance.storage_directory()).parent == Path(env["DAGSTER_STORAGE_DIR"])

        # Every storage answers, the result store beside it in its own database included
        # (sensor state is what breaks when both share one database); a run's events are
        # stored (what breaks with psycopg 3 as Dagster's driver).
        result = hello_job.execute_in_process(instance=instance)
        assert result.success
        stored = instance.get_run_by_id(result.run_id)
        assert stored is not None and stored.status == DagsterRunStatus.SUCCESS
        assert instance.all_logs(result.run_id)
        instance.add_dynamic_partitions("job_files", ["profile-check"])
        assert "profile-check" in instance.get_dynamic_partitions("job_files")
        assert list(instance.all_instigator_state()) == []
        with Store(tmp_path / "store", pg_url) as store:
            assert store.acquire_server("profile-check", "profile-test", 30.0)
            store.release_server("profile-check", "profile-test")
            assert store.server_leases()["profile-check"].owner is None
        assert list(instance.all_instigator_state()) == []
    finally:
        instance.dispose()


def wait_until(condition, timeout_s: float, what: str, procs=()) -> None:
    """Poll ``condition`` (the condition is the signal, not the delay); fail early when a
    process we wait on has already exited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                out = proc.communicate()[0]
                raise AssertionError(f"a run ended before {what}:\n{out[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


JOBS_PER_FILE = 12
KEYS = ("concurrent_alpha", "concurrent_beta")


@dataclass
class ConcurrentRuns:
    """What two ``render_job`` runs, launched at once in two processes, left behind."""

    prompts: dict[str, set[str]]  # partition -> prompt_ids of its jobs
    names: list[str]  # the servers' names, in the order of ``stats``
    stats: list[dict]  # each fake's /fake/stats
    returncodes: list[int]
    outputs: list[str]
    runs: list[tuple[str | None, DagsterRunStatus, float | None, float | None]]
    done_when_both_registered: dict[str, int]  # succeeded jobs per partition at that moment
    store_dir: Path


@pytest.fixture(scope="module")
def concurrent_runs(tmp_path_factory, dagster_pg_url, pg_url) -> ConcurrentRuns:
    """Two ``dagster job execute -j render_job`` processes, one partition each, with the
    production profile as DAGSTER_HOME (Dagster on PostgreSQL), the result store and
    server leases in the ``pg_url`` database, and the same two in-thread fake servers.

    Prompts take 1 s until both batches have registered their jobs in the store, so both
    are provably in flight together (neither has finished then); 20 ms afterwards.
    """
    tmp_path = tmp_path_factory.mktemp("concurrent")
    jobs_dir = tmp_path / "jobs"
    files = {
        key: write_jobs(jobs_dir, JOBS_PER_FILE, name=f"{key}.jsonl", salt=f"test-concurrent-{key}")
        for key in KEYS
    }
    prompts = {key: {job.prompt_id for job in load_job_file(p).jobs} for key, p in files.items()}
    home, env = production_home(tmp_path, dagster_pg_url)
    store_dir = tmp_path / "shared" / "store"
    fakes = [FakeComfy(prompt_seconds=0.25), FakeComfy(prompt_seconds=0.25)]
    # Server names of this test only: the pg_url database is shared with other tests.
    names = [f"concurrent{i}" for i in range(len(fakes))]
    done_then: dict[str, int] = {}

    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        instance = DagsterInstance.from_config(str(home))
        try:
            instance.add_dynamic_partitions("job_files", list(files))
            with (
                fakes[0].serve_in_thread(port=0) as url0,
                fakes[1].serve_in_thread(port=0) as url1,
                Store(store_dir, pg_url) as store,
            ):
                run_env = {
                    **os.environ,
                    "COMFY_ASSETS_SERVERS": f"{names[0]}={url0},{names[1]}={url1}",
                    "COMFY_ASSETS_STORE": str(store_dir),
                    "COMFY_ASSETS_DB_URL": pg_url,
                    "COMFY_ASSETS_JOB_DIRS": str(jobs_dir),
                }
                procs = [
                    subprocess.Popen(
                        [
                            str(DAGSTER),
                            "job",
                            "execute",
                            "-m",
                            "comfy_assets.definitions",
                            "-j",
                            "render_job",
                            "--tags",
                            json.dumps({"dagster/partition": key}),
                        ],
                        cwd=ROOT,
                        env=run_env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                    for key in files
                ]
                try:

                    def both_registered() -> bool:
                        counts = {key: store.counts(key) for key in KEYS}
                        if not all(sum(c.values()) for c in counts.values()):
                            return False
                        done_then.update({k: c.get("succeeded", 0) for k, c in counts.items()})
                        return True

                    wait_until(both_registered, 180, "both batches to register", procs)
                    for fake in fakes:
                        fake.prompt_seconds = 0.005
                    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
                finally:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait()
                stats = [fake.stats for fake in fakes]
            records = instance.get_run_records(RunsFilter(job_name="render_job"))
            runs = [
                (
                    r.dagster_run.tags.get("dagster/partition"),
                    r.dagster_run.status,
                    r.start_time,
                    r.end_time,
                )
                for r in records
            ]
        finally:
            instance.dispose()
    return ConcurrentRuns(
        prompts=prompts,
        names=names,
        stats=stats,
        returncodes=[proc.returncode for proc in procs],
        outputs=outputs,
        runs=runs,
        done_when_both_registered=done_then,
        store_dir=store_dir,
    )


def executed_counts(stats: list[dict]) -> dict[str, int]:
    executed: dict[str, int] = {}
    for s in stats:
        for pid, entry in s["prompts"].items():
            executed[pid] = executed.get(pid, 0) + entry["executed"]
    return executed


def test_two_partitions_run_at_once_in_two_processes_each_job_once_one_prompt_per_server(
    concurrent_runs,
):
    c = concurrent_runs
    assert c.returncodes == [0, 0], "\n\n".join(o[-4000:] for o in c.outputs)

    # Both runs SUCCESS in Dagster's PostgreSQL storage, one per partition, and in
    # progress at the same time.
    assert sorted((key, status) for key, status, _, _ in c.runs) == [
        (key, DagsterRunStatus.SUCCESS) for key in KEYS
    ]
    (_, _, start_a, end_a), (_, _, start_b, end_b) = c.runs
    assert start_a < end_b and start_b < end_a
    # Both batches had registered their jobs before either had finished.
    assert all(c.done_when_both_registered[key] < JOBS_PER_FILE for key in KEYS)

    # Every job executed exactly once, and nothing else was posted.
    every = set().union(*c.prompts.values())
    assert executed_counts(c.stats) == dict.fromkeys(every, 1)

    # No server ever held two of our prompts: each was posted after the previous ended.
    for name, s in zip(c.names, c.stats, strict=True):
        runs_here = sorted(s["runs"], key=lambda r: r["posted"])
        assert runs_here, f"{name} rendered nothing"
        for before, after in zip(runs_here, runs_here[1:], strict=False):
            assert after["posted"] >= before["end"], (name, before, after)

    # The results CSVs are on the shared store folder, a row per job.
    for key in KEYS:
        rows = (c.store_dir / key / "results.csv").read_text().splitlines()
        assert len(rows) == 1 + JOBS_PER_FILE, key
