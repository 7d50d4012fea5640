"""A full disk, the store's or the outputs' (a 2 MiB tmpfs): `run` and the worker stop
with one error line naming what could not be written where, exit 1, no traceback; the
messages a worker held go back to the queue; after space is freed, the next run or
worker finishes every job, each rendered once."""

from __future__ import annotations

import asyncio
import csv
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service import broker
from comfy_assets.service.worker import job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.process_support import (
    FAST,
    SmallDisk,
    command,
    ended_cleanly,
    start,
    stop,
    worker_command,
)
from tests.service.test_store_outage import pg_store  # noqa: F401 (a fixture)
from tests.service.test_worker_rabbitmq import URL, make_worker, queue, ready_count  # noqa: F401
from tests.support import ROOT, fake_servers, outcomes, wait_until, write_jobs

JOBS = 30


def place_store(disk: SmallDisk, elsewhere: Path, full: str) -> Path:
    """The store folder for a test whose ``full`` part ("store", "outputs" or "both")
    lies on ``disk``; the rest on the ordinary disk under ``elsewhere``. The SQLite file
    is reached through a link when it lives apart from the outputs (SQLite keeps its
    -wal and -shm beside the file the link points at)."""
    root = (disk.path if full in ("outputs", "both") else elsewhere) / "store"
    root.mkdir(parents=True)
    if full == "store":
        (root / "store.db").symlink_to(disk.path / "store.db")
    elif full == "outputs":
        (elsewhere / "db").mkdir()
        (root / "store.db").symlink_to(elsewhere / "db" / "store.db")
    return root


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# Free bytes left on the disk before the first run: room for a few jobs, not 30.
LEAVE = {"store": 256 * 1024, "outputs": 64 * 1024, "both": 256 * 1024}


@pytest.mark.parametrize(
    ("full", "servers"), [("store", 1), ("store", 3), ("outputs", 1), ("both", 1), ("both", 3)]
)
def test_run_on_a_full_disk_says_what_it_could_not_write_in_one_line_and_the_rerun_finishes(
    full: str, servers: int, small_disk: SmallDisk, tmp_path: Path
) -> None:
    jobs = write_jobs(tmp_path / "jobs", JOBS)
    store = place_store(small_disk, tmp_path, full)
    small_disk.fill(leave=LEAVE[full])
    fakes = [FakeComfy(prompt_seconds=0.005) for _ in range(servers)]
    with ExitStack() as stack:
        urls = [stack.enter_context(fake.serve_in_thread(port=0)) for fake in fakes]
        pool = [a for i, url in enumerate(urls) for a in ("--server", f"gpu{i}={url}")]
        args = command("run", "--jobs", jobs, *pool, "--store", store, *FAST)
        # A run that loops on the full disk instead of stopping fails here.
        first = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
        small_disk.free()
        second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)

    said = first.stdout + first.stderr
    assert first.returncode == 1, said
    assert "Traceback" not in said
    [line] = errors(first.stderr)
    assert "no space left on device" in line
    if full == "store":
        assert f"for the store's database {store / 'store.db'} (writing " in line
    elif full == "outputs":
        assert f"writing the output file {store / 'jobs'}/" in line
    else:
        assert str(small_disk.path) in line

    assert second.returncode == 0, second.stdout + second.stderr
    assert f"summary: {JOBS} done, 0 dead-lettered" in second.stdout
    table = rows(store / "jobs" / "results.csv")
    assert [r["state"] for r in table] == ["succeeded"] * JOBS
    for job in load_job_file(jobs).jobs:
        successes = sum(outcomes(fake, job.prompt_id).count("success") for fake in fakes)
        assert successes == 1, job.id


@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_a_worker_on_a_full_disk_stops_with_one_line_and_requeues_what_it_held(
    database: str,
    small_disk: SmallDisk,
    tmp_path: Path,
    queue: str,  # noqa: F811
    pg_url: str,
    pg_store: Store,  # noqa: F811
) -> None:
    jobs = write_jobs(tmp_path / "jobs", JOBS)
    await broker.enqueue(URL, queue, job_messages(jobs))
    # SQLite: the store and the outputs on the full disk; PostgreSQL: the outputs.
    store = small_disk.path / "store"
    db_url = ["--db-url", pg_url] if database == "postgresql" else []
    small_disk.fill(leave=LEAVE["both" if database == "sqlite" else "outputs"])
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    log = tmp_path / "worker.log"
    async with fake_servers(*fakes) as servers:
        args = worker_command(
            URL,
            queue,
            servers,
            store,
            *db_url,
            "--grace-s",
            "5",
            *FAST,
        )
        proc = await start(args, log)
        try:
            code = await asyncio.wait_for(proc.wait(), 120)
        finally:
            await stop(proc)
        text = ended_cleanly(log, code, 1)
        [line] = errors(text)
        assert line.startswith("error: no space left on device"), line
        assert str(small_disk.path) in line
        # Every job is done (its message acked) or its message is back in the queue.
        reopened = Store(store, pg_url if database == "postgresql" else None)
        done = (await asyncio.to_thread(reopened.counts, "jobs"))["succeeded"]
        assert done < JOBS
        assert await ready_count(queue) == JOBS - done, text

        small_disk.free()
        worker = make_worker(queue, servers, reopened, jobs.parent)
        task = asyncio.create_task(worker.run())
        await wait_until(
            lambda: worker.counts["acked"] == JOBS - done or task.done(), 120, "the rest"
        )
        worker.request_stop("test over")
        await asyncio.wait_for(task, 60)
    assert (await asyncio.to_thread(reopened.counts, "jobs"))["succeeded"] == JOBS
    reopened.close()
    for job in load_job_file(jobs).jobs:
        runs = [o for f in fakes for o in outcomes(f, job.prompt_id)]
        assert runs.count("success") == 1, (job.id, runs)
    assert await ready_count(queue) == 0
