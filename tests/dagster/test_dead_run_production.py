"""The production profile end to end: a render run killed with its code server, as when
their host loses power, is failed by dead_runs_sensor, retried, and does not hold back
the next version of its job file.

Dagster's storage on PostgreSQL (a fresh database, ``dagster_home/production/
dagster.yaml`` as DAGSTER_HOME), the result store in another, ``dagster-daemon run`` and
a code server (``dagster code-server start``, as docs/production.md runs it), two fakes
in this process with 1 s prompts. The job file sensor launches the run; mid-batch a new
version of the file is dropped (its run queues behind the running one), then the code
server and every process under it (the run worker and its step) get SIGKILL at once,
and the code server is started again (as systemd's ``Restart=always`` does). Deselect
with ``-m 'not slow'`` (about two minutes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRecord,
    RunsFilter,
)

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.ports import free_port
from tests.store.test_concurrent_postgres import dagster_pg_url, production_home, wait_until
from tests.support import ROOT, write_jobs

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(420)]

__all__ = ["dagster_pg_url"]  # a fixture of this module too

BIN = Path(sys.executable).parent
PARTITION = "deadrun"
FIRST_JOBS = 40  # 20 s on two servers: still rendering once the new version is queued
SECOND_JOBS = 44  # the first version's jobs and 4 more


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGSTOP ``proc`` and everything under it (so nothing starts or reacts), then
    SIGKILL them all: a host losing power. Returns the pids killed."""
    pids = [proc.pid]
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(3):  # children forked before the stop are stopped in the next pass
        for pid in descendants(proc.pid):
            if pid not in pids:
                pids.append(pid)
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return pids


@contextmanager
def process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``args`` running with its output in ``log``; it and its children killed at the end."""
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def check_run(instance: DagsterInstance, run_id: str) -> DagsterRun:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run


def render_runs(instance: DagsterInstance) -> list[RunRecord]:
    return list(instance.get_run_records(RunsFilter(job_name="render_job")))


def test_a_run_killed_with_its_code_server_is_failed_retried_and_lets_the_next_version_run(
    tmp_path, dagster_pg_url, pg_url
):
    home, dagster_env = production_home(tmp_path, dagster_pg_url)
    port = free_port()
    (tmp_path / "workspace.yaml").write_text(
        "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
        f"      port: {port}\n      location_name: comfy_assets\n"
    )
    jobs_dir = tmp_path / "jobs"
    job_path = write_jobs(jobs_dir, FIRST_JOBS, name=f"{PARTITION}.jsonl", salt="dead-run")
    store_dir = tmp_path / "shared" / "store"
    # prompt_seconds is per node: 4 nodes, 1 s a prompt.
    fakes = [FakeComfy(prompt_seconds=0.25), FakeComfy(prompt_seconds=0.25)]
    names = ["deadrun0", "deadrun1"]  # the pg_url database is shared with other tests

    with (
        fakes[0].serve_in_thread(port=0) as url0,
        fakes[1].serve_in_thread(port=0) as url1,
        pytest.MonkeyPatch.context() as mp,
    ):
        env = {
            **os.environ,
            **dagster_env,
            "PYTHONPATH": str(ROOT),
            "COMFY_ASSETS_SERVERS": f"{names[0]}={url0},{names[1]}={url1}",
            "COMFY_ASSETS_STORE": str(store_dir),
            "COMFY_ASSETS_DB_URL": pg_url,
            "COMFY_ASSETS_JOB_DIRS": str(jobs_dir),
            "COMFY_ASSETS_SENSOR_INTERVAL_S": "2",
        }
        for name, value in dagster_env.items():
            mp.setenv(name, value)
        instance = DagsterInstance.from_config(str(home))
        code_server = [
            str(BIN / "dagster"),
            "code-server",
            "start",
            "-m",
            "comfy_assets.definitions",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ]
        daemon = [str(BIN / "dagster-daemon"), "run", "-w", str(tmp_path / "workspace.yaml")]
        logs = tmp_path / "logs"
        logs.mkdir()
        try:
            with (
                Store(store_dir, pg_url) as store,
                process(code_server, env, logs / "code_server.log") as first_server,
                process(daemon, env, logs / "daemon.log") as daemon_proc,
            ):

                def log_tail() -> str:
                    return "\n".join(
                        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                        for p in sorted(logs.iterdir())
                    )

                def rendered(n: int) -> bool:
                    return store.counts(PARTITION).get("succeeded", 0) >= n

                try:
                    wait_until(lambda: rendered(3), 150, "3 jobs rendered", [daemon_proc])
                except AssertionError as e:
                    raise AssertionError(f"{e}\n{log_tail()}") from e
                [doomed] = render_runs(instance)
                doomed_id = doomed.dagster_run.run_id
                # A new version of the file (written aside, then renamed): its run waits in
                # the queue behind the running one (one run per dagster/partition).
                write_jobs(tmp_path / "v2", SECOND_JOBS, name=f"{PARTITION}.jsonl", salt="dead-run")
                os.replace(tmp_path / "v2" / f"{PARTITION}.jsonl", job_path)

                def queued_behind() -> bool:
                    return any(
                        r.dagster_run.status == DagsterRunStatus.QUEUED
                        for r in render_runs(instance)
                    )

                wait_until(queued_behind, 60, "the new version's run to be queued", [daemon_proc])
                doomed = check_run(instance, doomed_id)
                assert doomed.status == DagsterRunStatus.STARTED
                done_at_kill = store.counts(PARTITION)["succeeded"]
                killed_at = time.time()
                killed = kill_tree(first_server)
                assert len(killed) >= 3, "the code server, its run worker and its step"
                assert done_at_kill < FIRST_JOBS, "killed mid-batch"

                # The code server back, as its supervisor brings it.
                with process(code_server, env, logs / "code_server_again.log"):

                    def settled() -> bool:
                        newer = [
                            r for r in render_runs(instance) if r.dagster_run.run_id != doomed_id
                        ]
                        return len(newer) >= 2 and all(r.dagster_run.is_finished for r in newer)

                    try:
                        wait_until(settled, 240, "the retry and the new version to end")
                    except AssertionError as e:
                        raise AssertionError(f"{e}\n{log_tail()}") from e
                stats = [fake.stats for fake in fakes]
                counts = store.counts(PARTITION)
        finally:
            runs = render_runs(instance)
            messages = {
                r.dagster_run.run_id: [
                    e.dagster_event.message
                    for e in instance.all_logs(
                        r.dagster_run.run_id, of_type=DagsterEventType.RUN_FAILURE
                    )
                    if e.dagster_event is not None
                ]
                for r in runs
            }
            instance.dispose()

    by_id = {r.dagster_run.run_id: r for r in runs}
    doomed_run = by_id[doomed_id].dagster_run
    # The dead run is failed by the sensor, which names its silent owner.
    assert doomed_run.status == DagsterRunStatus.FAILURE
    [message] = messages[doomed_id]
    assert message.startswith("dead_runs_sensor: marked failed: its batch's owner ")
    assert "no heartbeat in the result store" in message
    # Run retries launched it again (dagster/retry_number 1) and the retry succeeded.
    [retry] = [r.dagster_run for r in runs if r.dagster_run.parent_run_id == doomed_id]
    assert retry.tags.get("dagster/retry_number") == "1"
    assert retry.status == DagsterRunStatus.SUCCESS
    # The new version's run, requested while the dead run held the partition, ran too.
    [newer] = [r.dagster_run for r in runs if r.dagster_run.run_id not in (doomed_id, retry.run_id)]
    assert newer.tags.get("dagster/partition") == PARTITION
    assert newer.status == DagsterRunStatus.SUCCESS

    # Every job of the file's current version rendered, each prompt executed exactly once
    # across the dead run, the retry and the new version's run.
    prompts = {job.prompt_id for job in load_job_file(job_path).jobs}
    assert counts["succeeded"] == SECOND_JOBS
    executed: dict[str, int] = {}
    for s in stats:
        for pid, entry in s["prompts"].items():
            executed[pid] = executed.get(pid, 0) + entry["executed"]
    assert executed == dict.fromkeys(prompts, 1)
    # Never two of ours at once on a server.
    for name, s in zip(names, stats, strict=True):
        on_server = sorted(s["runs"], key=lambda r: r["posted"])
        for before, after in zip(on_server, on_server[1:], strict=False):
            assert after["posted"] >= before["end"], (name, before, after)

    def after_kill(at: float | None) -> str:
        return "?" if at is None else f"{at - killed_at:.1f} s"

    print(
        f"\nSIGKILL at {done_at_kill}/{FIRST_JOBS} jobs; after it: dead run FAILURE "
        f"{after_kill(by_id[doomed_id].end_time)}, the new version's run started "
        f"{after_kill(by_id[newer.run_id].start_time)} and ended "
        f"{after_kill(by_id[newer.run_id].end_time)}, the retry started "
        f"{after_kill(by_id[retry.run_id].start_time)} and ended "
        f"{after_kill(by_id[retry.run_id].end_time)}; {json.dumps(counts)}"
    )
