"""A job file registered and run a chunk at a time (``render/feed.py``): killed with
SIGKILL mid-way and run again, no prompt is posted twice and every job is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.feed import AHEAD, CHUNK, FIRST_CHUNK
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, write_jobs

# Past several chunks: 64 jobs, then 1,000 at a time while fewer than 2,000 fed wait.
JOBS = 4000
# Prompts executed before the first run is killed: by then 3,064 jobs are registered
# (fed), the rest are not.
KILLED_AFTER = 900

# Thousands of jobs through a subprocess, twice, on a shared machine.
pytestmark = pytest.mark.timeout(900)


def run_args(jobs: Path, urls: list[str], store: Path) -> list[str]:
    servers = [a for i, url in enumerate(urls) for a in ("--server", f"gpu{i}={url}")]
    return [
        sys.executable,
        "-m",
        "comfy_assets.cli",
        "run",
        "--jobs",
        str(jobs),
        "--store",
        str(store),
        *servers,
        # Claims and server leases of the killed run expire within a second.
        "--lease-s",
        "1",
        "--server-lease-s",
        "1",
        "--poll-s",
        "0.2",
    ]


def executed_at_least(fakes: list[FakeComfy], count: int, timeout_s: float) -> None:
    """Return once the fakes executed ``count`` prompts: the fakes' records are the signal
    (read every 0.2 s: each read copies them, and the fakes share this process)."""
    deadline = time.monotonic() + timeout_s
    while sum(len(f.stats["runs"]) for f in fakes) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {count} prompts")
        time.sleep(0.2)


def test_a_big_file_killed_mid_way_and_run_again_posts_no_prompt_twice(tmp_path):
    assert FIRST_CHUNK + CHUNK + AHEAD < JOBS  # the rest waits for room
    assert KILLED_AFTER < FIRST_CHUNK + CHUNK
    fakes = [FakeComfy(prompt_seconds=0.0) for _ in range(4)]
    jobs = write_jobs(tmp_path / "jobs", JOBS)
    prompt_ids = {job.id: job.prompt_id for job in load_job_file(jobs).jobs}
    store_dir = tmp_path / "store"

    with ExitStack() as stack:
        urls = [stack.enter_context(f.serve_in_thread(port=0)) for f in fakes]
        first = subprocess.Popen(
            run_args(jobs, urls, store_dir),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            executed_at_least(fakes, KILLED_AFTER, 600)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
        store = Store(store_dir)
        registered = len(store.jobs(jobs.stem))
        done_before = store.counts(jobs.stem)["succeeded"]
        store.close()
        second = subprocess.run(
            run_args(jobs, urls, store_dir),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    # Killed mid-way: part of the file was registered (a chunk at a time) and done.
    assert KILLED_AFTER - 100 <= done_before < JOBS
    assert registered < JOBS
    assert f"summary: {JOBS} done, 0 dead-lettered" in second.stdout
    posts: dict[str, int] = {}
    for fake in fakes:
        for prompt_id, counts in fake.stats["prompts"].items():
            posts[prompt_id] = posts.get(prompt_id, 0) + counts["posted"]
    assert sorted(posts) == sorted(prompt_ids.values())
    twice = {p: n for p, n in posts.items() if n != 1}
    assert twice == {}
    store = Store(store_dir)
    records = store.jobs(jobs.stem)
    assert len(records) == JOBS
    assert {r.job_id: r.prompt_id for r in records} == prompt_ids
    assert {r.state for r in records} == {"succeeded"}


def test_a_file_with_a_job_of_another_partition_past_the_first_chunk_posts_nothing(
    tmp_path, capsys
):
    # The job registered elsewhere is in the file's second chunk: the check before the
    # first registration finds it, as the registration of the whole file did before.
    jobs = write_jobs(tmp_path / "jobs", FIRST_CHUNK + 10)
    last = load_job_file(jobs).jobs[-1]
    store = Store(tmp_path / "store")
    store.register_jobs("other", [last])
    store.close()
    fake = FakeComfy(prompt_seconds=0.0)
    with fake.serve_in_thread(port=0) as url:
        code = main(
            [
                "run",
                "--jobs",
                str(jobs),
                "--server",
                f"gpu0={url}",
                "--store",
                str(tmp_path / "store"),
            ]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert f"job ids already in another partition: {last.id} (in 'other')" in err
    assert fake.stats["prompts"] == {}
    store = Store(tmp_path / "store")
    assert store.jobs("jobs") == []
