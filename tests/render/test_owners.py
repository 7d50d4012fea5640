"""Owners and their heartbeats: a claim is taken from a gone owner at once and never from
a live one, whatever host names and pids say; the database's clock decides."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.owners import OwnerHeartbeat
from comfy_assets.render.run import make_pool, run_batch, run_one
from comfy_assets.store import OWNER_DEAD_S, Store, Via
from fake_comfy import FakeComfy
from tests.render.test_catch_up import post_as_a_killed_run
from tests.store.test_store import make_jobs
from tests.support import (
    executed,
    fake_servers,
    fast_batch,
    fast_config,
    gone_owner,
    posted,
    write_jobs,
)


def test_a_live_owner_with_a_dead_pid_of_this_host_keeps_its_claims(store, workflow_dir):
    # Two containers sharing a host name: this pid is gone here, but its owner beats.
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("p", [job])
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(ended.stdout)
    holder = f"{socket.gethostname()}:{pid}:aaaaaaaa"
    store.register_owner(holder, pid=pid)
    assert store.claim(job.id, holder) == "claimed"
    assert store.claim(job.id, "other:3:bbbbbbbb") == "held"
    assert store.owner_gone(holder) is None
    assert store.get(job.id).claimed_by == holder


def test_the_claim_of_a_silent_owner_is_taken_over_at_once_and_it_never_comes_back(
    store, workflow_dir
):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("p", [job])
    holder = gone_owner(store, silent_s=OWNER_DEAD_S + 1)
    assert store.claim(job.id, holder, lease_s=3600.0) == "claimed"
    assert store.owner_gone(holder).startswith("no heartbeat for ")
    status, rec = store.claim_job(job.id, "taker:2:cccccccc")
    assert status == "claimed"
    assert rec.taken_over.startswith(
        f"claim taken over from {holder} (its holder is gone: no heartbeat for "
    )
    assert store.events(job_id=job.id)[-1].detail == rec.taken_over
    assert store.beat_owner(holder) is False
    assert store.owner_gone(holder) == "found gone by another process"


def test_a_silent_owner_nobody_found_gone_lives_on_when_it_beats_again(store):
    holder = gone_owner(store, silent_s=OWNER_DEAD_S + 1)
    assert store.owner_gone(holder) is not None
    assert store.beat_owner(holder) is True
    assert store.owner_gone(holder) is None


def test_a_worker_claim_belongs_to_its_owner(store, workflow_dir):
    # A worker claims each delivery as OWNER#N: its owner's heartbeat is what counts.
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("p", [job])
    worker = "w:2:dddddddd"
    store.register_owner(worker)
    assert store.claim(job.id, f"{worker}#1") == "claimed"
    assert store.claim(job.id, "other:2:eeeeeeee") == "held"
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE comfy_owners SET beat_at = beat_at - 60"))
    assert store.claim(job.id, "other:2:eeeeeeee") == "claimed"


def test_a_released_owner_is_gone_and_its_leftover_claims_are_free(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("p", [job])
    holder = "ended:2:ffffffff"
    store.register_owner(holder)
    assert store.claim(job.id, holder) == "claimed"
    store.release_owner(holder)
    assert store.owner_gone(holder) == "released at its end"
    assert store.claim(job.id, "next:2:12345678") == "claimed"


def test_owners_lists_run_ids_and_ages_by_the_database_clock(store):
    store.register_owner("a:2:00000001", run_id="run-1")
    gone_owner(store, "b:2:00000002", silent_s=30.0)
    by_owner = {o.owner: o for o in store.owners()}
    assert by_owner["a:2:00000001"].run_id == "run-1"
    assert by_owner["a:2:00000001"].gone is False
    assert by_owner["b:2:00000002"].gone is True
    assert by_owner["b:2:00000002"].beat_age_s >= 30.0
    assert [o.owner for o in store.owners(run_ids=["run-1"])] == ["a:2:00000001"]
    assert store.mark_owner_gone("a:2:00000001") is None  # alive: unchanged
    assert store.mark_owner_gone("b:2:00000002").startswith("no heartbeat for ")
    assert store.beat_owner("b:2:00000002") is False


def test_the_heartbeat_registers_beats_and_releases(store):
    heartbeat = OwnerHeartbeat(store, "hb:2:abcdef01", beat_s=0.05)
    heartbeat.start()
    assert store.owner_gone("hb:2:abcdef01") is None
    assert heartbeat.stale() is None
    heartbeat.stop()
    assert store.owner_gone("hb:2:abcdef01") == "released at its end"


def test_a_heartbeat_found_gone_calls_on_gone_and_stops(store):
    told: list[str] = []
    said = threading.Event()

    def on_gone(reason: str) -> None:
        told.append(reason)
        said.set()

    heartbeat = OwnerHeartbeat(store, "hb:2:abcdef02", beat_s=0.05, on_gone=on_gone)
    heartbeat.start()
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE comfy_owners SET gone_at = 1.0"))
    assert said.wait(30)
    heartbeat.stop()
    assert told[0].startswith("this process (owner hb:2:abcdef02) was found gone by another")
    assert heartbeat.stale() == told[0]
    assert store.owner_gone("hb:2:abcdef02") == "found gone by another process"


@pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed")
def test_a_host_clock_a_minute_ahead_reads_the_database_clock(pg_url):
    # faketime sets this process's clock 60 s ahead: store.now() is the database's all
    # the same, so its leases neither run out early nor late.
    script = (
        "import time; from comfy_assets.store import Store; "
        f"s = Store('/nonexistent-store', {pg_url!r}); "
        "print(round(time.time() - s.now()))"
    )
    out = subprocess.run(
        ["faketime", "-f", "+60s", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert int(out.stdout.strip()) == 60


def test_a_postgresql_store_beats_and_takes_over_by_its_own_clock(pg_url, tmp_path, workflow_dir):
    store = Store(tmp_path / "store", pg_url)
    try:
        (job,) = make_jobs(workflow_dir, 1)
        store.register_jobs("p", [job])
        holder = gone_owner(store, silent_s=OWNER_DEAD_S + 1)
        assert store.claim(job.id, holder) == "claimed"
        live = "live:2:87654321"
        store.register_owner(live)
        assert store.beat_owner(live) is True
        status, rec = store.claim_job(job.id, live)
        assert status == "claimed" and rec.taken_over is not None
        assert store.claim(job.id, holder) == "held"
        assert store.beat_owner(holder) is False
    finally:
        store.close()


async def test_nothing_is_posted_while_the_heartbeat_does_not_reach_the_store(tmp_path):
    # Cut off from the database (its beats failing), a process must not post: others may
    # be taking its jobs. Here the heartbeat's last beat is long past and none lands.
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    (job,) = jf.jobs
    store = Store(tmp_path / "store", retry_s=0.2)
    owner = "cut:2:0000000a"
    heartbeat = OwnerHeartbeat(store, owner)
    store.register_owner(owner)
    heartbeat._last_ok -= 60.0  # no beat for a minute, and its thread is not started
    async with fake_servers(fake) as servers:
        async with make_pool(servers, store, fast_config(), owner) as pool:
            ending = await run_one(
                job,
                partition="p",
                pool=pool,
                store=store,
                config=fast_config(attempts=2),
                owner=owner,
                heartbeat=heartbeat,
            )
    assert posted(fake, job.prompt_id) == 0
    assert (ending.how, ending.state) == ("dead_lettered", "failed_fatal")
    reason = store.get(job.id).reason
    assert "not posted: this process's heartbeat has not reached the store for" in reason


def one_job_of_a_gone_owner(tmp_path: Path) -> tuple[FakeComfy, JobFile, Store, str]:
    """A fake, a job file of one job registered in a new store, and a gone owner."""
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    store = Store(tmp_path / "store")
    store.register_jobs("p", jf.jobs)
    return FakeComfy(prompt_seconds=0.005), jf, store, gone_owner(store)


async def test_a_job_taken_over_from_a_server_this_pool_lacks_says_it_may_render_twice(tmp_path):
    # A worker of another host died with the prompt on its own server: this pool has no
    # address for it, so nothing can be caught up there, and the job's events say so.
    fake, jf, store, owner = one_job_of_a_gone_owner(tmp_path)
    (job,) = jf.jobs
    assert store.claim(job.id, owner, lease_s=3600.0) == "claimed"
    store.transition(job.id, "submitted", owner=owner, via=Via(server="gpu9", attempt=1))
    store.transition(job.id, "rendering", owner=owner, via=Via(server="gpu9", attempt=1), number=4)
    async with fake_servers(fake) as servers:
        config = fast_config()
        summary = await run_batch(jf, partition="p", servers=servers, store=store, config=config)
    assert summary.done == 1
    assert posted(fake, job.prompt_id) == 1
    details = [e.detail or "" for e in store.events(job_id=job.id)]
    said = "catch-up on gpu9 not possible: not a server of this pool; posting anew: the job may render twice"
    assert any(said in d for d in details), details


def test_a_server_lease_of_a_gone_owner_is_free_to_take_and_of_a_live_one_is_not(store):
    live, gone = "live:2:11111111", gone_owner(store, "dead:2:22222222")
    store.register_owner(live)
    assert store.acquire_server("gpu0", live, 3600.0)
    assert store.acquire_server("gpu1", gone, 3600.0)
    leases = store.server_leases()
    assert (leases["gpu0"].holder_gone, leases["gpu1"].holder_gone) == (False, True)
    assert not store.acquire_server("gpu0", "taker:2:33333333", 30.0)
    assert store.acquire_server("gpu1", "taker:2:33333333", 30.0)
    assert store.server_leases()["gpu1"].owner == "taker:2:33333333"


async def test_a_run_takes_the_server_and_the_job_of_an_owner_killed_with_its_host(tmp_path):
    # Killed mid-prompt: its claim and its server lease both run for an hour; both are
    # taken at once, and its prompt is caught up, not posted again.
    fake, jf, store, owner = one_job_of_a_gone_owner(tmp_path)
    (job,) = jf.jobs
    async with fake_servers(fake) as servers:
        assert store.acquire_server("gpu0", owner, 3600.0)
        await post_as_a_killed_run(store, job, servers[0].url, "gpu0")  # as ``owner``
        summary = await asyncio.wait_for(fast_batch(jf, servers, store), 120)
    assert summary.done == 1
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)


def test_a_sqlite_store_keeps_this_hosts_clock_through_heartbeats(tmp_path: Path) -> None:
    # SQLite reads the time to the millisecond: a measured offset would be that error, and
    # an event timed by the store could then come before one timed a moment earlier.
    store = Store(tmp_path / "store")
    store.register_owner("o")
    for _ in range(5):
        assert store.beat_owner("o")
    assert store.clock.offset_s == 0.0
    store.close()
