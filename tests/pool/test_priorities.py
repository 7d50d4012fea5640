"""Priorities across runs sharing servers and a store: a rush file with ``--priority 10``
started while a big file renders has every prompt posted before the big file posts more
than 2 more; the header's ``"priority"`` and ``dagster/priority`` give a batch its
priority; waiter marks carry it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import JobFileError, load_job_file
from comfy_assets.render.steering import run_priority
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, write_jobs

pytestmark = pytest.mark.timeout(180)

FAST = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--no-jitter", "--poll-s", "0.05"]


def run_cmd(jobs: Path, urls: list[str], store: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    for i, url in enumerate(urls):
        cmd += ["--server", f"gpu{i}={url}"]
    return cmd + ["--store", str(store), *FAST, *extra]


def posts(fakes: list[FakeComfy]) -> list[tuple[float, str]]:
    """Every POST /prompt of every fake, (time, prompt_id), in time order."""
    return sorted((p["time"], p["prompt_id"]) for f in fakes for p in f.stats["posts"])


def rush_against_big(tmp_path: Path, *rush_extra: str) -> int:
    """Start a 60-job file on two servers, then a 10-job one with ``rush_extra``; the
    big file's prompts posted after the rush's first and up to its last."""
    fakes = [FakeComfy(prompt_seconds=0.1) for _ in range(2)]
    big = write_jobs(tmp_path / "big", 60, name="big.jsonl")
    rush = write_jobs(tmp_path / "rush", 10, name="rush.jsonl")
    rush_ids = {j.prompt_id for j in load_job_file(rush).jobs}
    store = tmp_path / "store"
    Store(store).close()  # made once, before both processes open it
    with ExitStack() as stack:
        urls = [stack.enter_context(f.serve_in_thread(port=0)) for f in fakes]
        big_proc = subprocess.Popen(
            run_cmd(big, urls, store), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            # Poll the fakes' own records (another process posts): both servers busy.
            while len(posts(fakes)) < 4:
                assert big_proc.poll() is None, big_proc.stderr.read().decode()
                time.sleep(0.05)  # no event crosses the process boundary: look again
            rush_run = subprocess.run(
                run_cmd(rush, urls, store, *rush_extra),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert rush_run.returncode == 0, rush_run.stderr
        finally:
            big_proc.wait(120)
        assert big_proc.returncode == 0
    seen = posts(fakes)
    rush_times = [t for t, pid in seen if pid in rush_ids]
    assert len(rush_times) == 10
    first, last = rush_times[0], rush_times[-1]
    return sum(1 for t, pid in seen if pid not in rush_ids and first < t < last)


def test_a_rush_file_with_priority_10_is_posted_before_the_big_file_posts_3_more(tmp_path):
    assert rush_against_big(tmp_path, "--priority", "10") <= 2


def test_the_header_priority_is_read_and_checked(tmp_path: Path) -> None:
    path = write_jobs(tmp_path / "jobs", 1)
    lines = path.read_text()
    path.write_text(json.dumps({"header": {"priority": 7}}) + "\n" + lines)
    assert load_job_file(path).header.priority == 7
    path.write_text(json.dumps({"header": {"priority": "high"}}) + "\n" + lines)
    with pytest.raises(JobFileError, match=r":1: header.priority: expected an integer"):
        load_job_file(path)


def test_the_dagster_priority_tag_gives_the_batch_its_priority() -> None:
    assert run_priority({"dagster/priority": "10"}) == 10
    assert run_priority({"dagster/priority": "-3"}) == -3
    assert run_priority({"dagster/priority": "urgent"}) is None
    assert run_priority({}) is None


def test_waiter_marks_carry_the_priority(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.mark_waiting("rush", 60.0, ["gpu0"], priority=10)
    store.mark_waiting("big", 60.0, ["gpu0"], priority=0)
    assert store.others_waiting("big", "gpu0", priority=1)  # the rush outranks the big file
    assert not store.others_waiting("rush", "gpu0", priority=11)  # nobody outranks the rush
    assert store.others_waiting("rush", "gpu0", priority=0)  # the big one waits, lower
    assert store.others_waiting("rush", "gpu0")


def test_enqueue_priority_travels_in_the_message_and_is_checked(tmp_path: Path) -> None:
    from comfy_assets.service.messages import file_messages, parse_message

    job_file = load_job_file(write_jobs(tmp_path / "jobs", 2))
    (_, body), _ = file_messages(job_file, "p", priority=10)
    queued = parse_message(body, workflows_dir=tmp_path, source="m")
    assert (queued.priority, queued.partition) == (10, "p")
    (_, plain), _ = file_messages(job_file, "p")
    assert parse_message(plain, workflows_dir=tmp_path, source="m").priority == 0
    bad = json.loads(body)
    bad["priority"] = True
    with pytest.raises(JobFileError, match="priority: expected an integer from .*, got true"):
        parse_message(json.dumps(bad).encode(), workflows_dir=tmp_path, source="m")
    bad["priority"] = 5_000_000  # an integer, out of range: the message says the range
    with pytest.raises(
        JobFileError, match="priority: expected an integer from -1000000 to 1000000, got 5000000"
    ):
        parse_message(json.dumps(bad).encode(), workflows_dir=tmp_path, source="m")


def test_a_long_lived_pool_has_the_highest_priority_of_the_jobs_it_runs(tmp_path: Path) -> None:
    from comfy_assets.comfy.servers import ServerSpec
    from comfy_assets.pool.pool import Pool

    pool = Pool([ServerSpec("gpu0", "http://127.0.0.1:9")], Store(tmp_path), owner="o")
    with pool.prioritized(5):
        with pool.prioritized(0):
            assert pool.priority == 5
        with pool.prioritized(9):
            assert pool.priority == 9
        assert pool.priority == 5
    assert pool.priority == 0


async def test_a_higher_priority_run_whose_jobs_another_run_holds_does_not_stall_it(
    tmp_path: Path,
) -> None:
    # The same file twice on one server that a third process holds for now: the
    # priority-0 run claims every job and waits for the server; the priority-10 run
    # finds every job held. Were it to wait for the server too, its mark would keep the
    # server from the holder of the jobs (it outranks it), and neither would ever post.
    import asyncio

    from comfy_assets.render.run import run_batch
    from tests.support import executed, fake_servers, fast_config, wait_until

    fake = FakeComfy()
    jobs = load_job_file(write_jobs(tmp_path / "jobs", 3))  # as many as it claims ahead
    store = Store(tmp_path / "store")
    assert store.acquire_server("gpu0", "a third process", 600.0)
    lines: dict[int, list[str]] = {0: [], 10: []}
    async with fake_servers(fake) as servers:

        def batch(priority: int) -> asyncio.Task:
            return asyncio.create_task(
                run_batch(
                    jobs,
                    partition="jobs",
                    servers=servers,
                    store=Store(tmp_path / "store"),  # a process of its own
                    config=fast_config(),
                    priority=priority,
                    on_line=lines[priority].append,
                )
            )

        low = batch(0)
        await wait_until(
            lambda: all(store.get(j.id) and store.get(j.id).claimed_by for j in jobs.jobs),
            30,
            "the first run's claims",
        )
        high = batch(10)
        await wait_until(
            lambda: sum("waiting (taken over" in line for line in lines[10]) == 3,
            30,
            "the second run to find every job held",
        )
        store.release_server("gpu0", "a third process")
        # A stall never ends: the bound only turns it into a failure.
        summaries = await asyncio.wait_for(asyncio.gather(low, high), 60)
    assert summaries[0].counts["succeeded"] == 3
    assert sum("already done, nothing posted" in line for line in lines[10]) == 3
    assert all(executed(fake, j.prompt_id) == 1 for j in jobs.jobs)
