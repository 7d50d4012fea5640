"""The GPU pool: shortest queue wins, unreachable servers are skipped, one prompt of ours
per server even across processes, leases expire, model affinity."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.pool.pool import Pool
from comfy_assets.pool.slot import new_client_id
from comfy_assets.store import Store, StoreDiskFull
from comfy_assets.store.schema import pool_waiters_table
from fake_comfy import FakeComfy
from tests.support import (
    ROOT,
    batch_over_fakes,
    fake_servers,
    fast_batch,
    fast_config,
    free_port,
    outcomes,
    run_argv,
    running,
    start_fake_process,
    wait_until,
    write_jobs,
)


def ran_on(fake: FakeComfy, prompt_ids: set[str]) -> int:
    return sum(1 for r in fake.stats["runs"] if r["prompt_id"] in prompt_ids)


async def test_the_busiest_server_is_avoided(tmp_path):
    busy = FakeComfy(busy=3, prompt_seconds=0.2)
    idle = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    await batch_over_fakes(jf, Store(tmp_path / "s"), busy, idle)
    ours = {j.prompt_id for j in jf.jobs}
    assert (ran_on(busy, ours), ran_on(idle, ours)) == (0, 1)


async def test_an_unreachable_server_is_reported_and_skipped(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 4))
    async with fake_servers(fake) as (up,):
        servers = [
            ServerSpec("gpu0", f"http://127.0.0.1:{free_port()}"),
            ServerSpec("gpu1", up.url),
        ]
        summary = await fast_batch(jf, servers, Store(tmp_path / "s"))
    assert summary.done == 4
    assert ran_on(fake, {j.prompt_id for j in jf.jobs}) == 4
    assert "gpu0" in summary.unreachable and "ServerUnreachable" in summary.unreachable["gpu0"]


async def test_a_server_whose_socket_drops_and_refuses_is_unreachable_until_it_answers_again(
    tmp_path,
):
    # Nothing probes a server while our prompt there is followed: its socket tells.
    port = free_port()
    servers = [ServerSpec("gpu0", f"http://127.0.0.1:{port}")]
    fake = start_fake_process(port)
    try:
        async with Pool(servers, Store(tmp_path / "s"), owner="me") as pool:
            await pool.follower("gpu0")
            assert pool.unreachable() == {}
            fake.kill()  # as a GPU host's process dies: the port refuses at once
            fake.wait()
            await wait_until(lambda: "gpu0" in pool.unreachable(), 10, "the socket to be lost")
            assert "connection refused" in pool.unreachable()["gpu0"]
            fake = start_fake_process(port)
            await wait_until(lambda: not pool.unreachable(), 10, "the socket to be open again")
    finally:
        fake.kill()
        fake.wait()


async def test_with_every_server_down_the_pool_waits_and_resumes(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    port = free_port()
    jf = load_job_file(write_jobs(tmp_path / "jobs", 2))
    store = Store(tmp_path / "s")
    lines: list[str] = []
    task = asyncio.create_task(
        fast_batch(
            jf, [ServerSpec("gpu0", f"http://127.0.0.1:{port}")], store, on_line=lines.append
        )
    )
    # The batch is waiting: nothing can have run, and the jobs are still pending.
    await wait_until(lambda: store.counts("p").get("pending", 0) == 2, 10, "2 jobs pending")
    assert not task.done()
    async with fake.serve(port=port):
        summary = await asyncio.wait_for(task, 30)
    assert summary.done == 2
    assert ran_on(fake, {j.prompt_id for j in jf.jobs}) == 2


def _run_process(
    jobs: Path, store: Path, servers: list[str], *options: str, **popen: Any
) -> subprocess.Popen:
    """``comfy-assets run`` of ``jobs`` as its own process over ``servers`` (``name=url``
    each) with ``options``, polling every 50 ms, its output piped."""
    argv = [sys.executable, "-m", "comfy_assets.cli"]
    argv += run_argv(jobs, store, servers, "--poll-s", "0.05", *options)
    return subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def test_two_processes_sharing_two_servers_never_put_two_prompts_on_one(tmp_path):
    fakes = [FakeComfy(prompt_seconds=0.01), FakeComfy(prompt_seconds=0.01)]
    store = tmp_path / "store"
    Store(store)
    files = [write_jobs(tmp_path / f"jobs{i}", 8, name=f"file{i}.jsonl") for i in range(2)]
    with fakes[0].serve_in_thread(port=0) as a, fakes[1].serve_in_thread(port=0) as b:
        procs = [
            _run_process(f, store, [f"gpu0={a}", f"gpu1={b}"], "--base-delay-s", "0.01")
            for f in files
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for fake in fakes:
        runs = sorted(fake.stats["runs"], key=lambda r: r["posted"])
        assert runs, "both servers must work"
        for before, after in zip(runs, runs[1:], strict=False):
            # Ours only reaches a server once the previous prompt has left it.
            assert after["posted"] >= before["end"], (before, after)
    assert sum(len(f.stats["runs"]) for f in fakes) == 16


def _hold_lease_then_hang(db: str, ready) -> None:
    store = Store(Path(db))
    assert store.acquire_server("gpu0", "doomed-process", 1.0)
    ready.set()
    signal.pause()


async def test_a_killed_holder_loses_its_server_lease_after_the_lease_time(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    store = Store(tmp_path / "s")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_lease_then_hang, args=(str(tmp_path / "s"), ready))
    proc.start()
    assert ready.wait(30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert store.server_leases()["gpu0"].owner == "doomed-process"
    async with fake_servers(fake) as servers:
        async with Pool(servers, store, owner="next", busy_poll_s=0.02) as pool:
            slot = await asyncio.wait_for(pool.acquire(), 30)
            assert slot.name == "gpu0"
            assert store.server_leases()["gpu0"].owner == "next"
            slot.release()


async def test_affinity_keeps_a_model_on_the_server_that_last_ran_it(tmp_path):
    fakes = [FakeComfy(), FakeComfy()]
    store = Store(tmp_path / "s")
    async with fake_servers(*fakes) as servers:
        async with Pool(servers, store, owner="me") as pool:
            first = await pool.acquire(models=("sdxl.safetensors",))
            assert first.name == "gpu0"  # equal queues: configuration order
            other = await pool.acquire(models=("flux.safetensors",))
            assert other.name == "gpu1"
            first.release()
            other.release()
            # Both free with equal queues: each model goes back where it ran last.
            again = await pool.acquire(models=("flux.safetensors",))
            assert again.name == "gpu1"
            again.release()
            again = await pool.acquire(models=("sdxl.safetensors",))
            assert again.name == "gpu0"
            again.release()


def test_two_runs_sharing_one_server_take_turns(tmp_path):
    # Without turns, the first run hands the server to its own next job every time and
    # the second run waits until the first has nothing left. The fake is held while the
    # second run starts, so the first can't finish before the second waits.
    #
    # What the order depends on, and what this test pins down: a run that frees the server
    # leaves it to the others for 3 * busy_poll_s when the store holds a waiter's mark,
    # which the waiting run renews every busy_poll_s (0.05 s) and which lives 0.2 s. On a
    # busy machine the second run may not renew it in time, and the first then sees
    # nobody waiting at every one of its releases. So once the second run has shown that
    # it marks itself (the store says so), a mark that does not expire stands in for it:
    # the first run yields at each release whatever the machine's load, and the second
    # needs only one of those seven windows to take the server. The first runs at the
    # lowest CPU priority, so on a busy machine it is the one kept waiting, not the second.
    fake = FakeComfy(prompt_seconds=0.01)
    store = tmp_path / "store"
    Store(store)
    files = [
        write_jobs(tmp_path / f"jobs{i}", n, name=f"run{i}.jsonl") for i, n in [(0, 8), (1, 4)]
    ]
    ids = [{j.prompt_id for j in load_job_file(f).jobs} for f in files]

    def start(path: Path, nice: int = 0) -> subprocess.Popen:
        return _run_process(path, store, [f"gpu0={url}"], preexec_fn=lambda: os.nice(nice))

    def waiting(pid: int) -> bool:
        """The run of process ``pid`` waits for a server (its pool's mark in the store)."""
        t = pool_waiters_table.c
        with Store(store) as s, s.engine.connect() as conn:
            owners = conn.execute(sa.select(t.owner).where(t.expires_at > time.time())).scalars()
            return any(owner.split(":")[1] == str(pid) for owner in owners)

    with fake.serve_in_thread(port=0) as url:
        fake.pause()
        first = start(files[0], nice=19)
        poll_until(lambda: any(ids[0] & set(fake.stats["prompts"])), "the first run's POST")
        second = start(files[1])
        poll_until(lambda: waiting(second.pid), "the second run to wait for the server")
        with Store(store) as s:
            s.mark_waiting("test:0:a-waiter-that-stays", 3600.0)
        fake.resume()
        outs = [p.communicate(timeout=120)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    runs = sorted(fake.stats["runs"], key=lambda r: r["start"])
    owners = [0 if r["prompt_id"] in ids[0] else 1 for r in runs]
    assert owners.index(1) < len(owners) - 1 - owners[::-1].index(0), owners


def poll_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Look at ``condition`` every 20 ms (the condition is the signal, not the time)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class CountingStore(Store):
    """The store, counting the server-lease writes the pool makes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acquired = self.released = 0

    def acquire_server(self, *args: object, **kwargs: object) -> bool:
        self.acquired += 1
        return super().acquire_server(*args, **kwargs)  # type: ignore[arg-type]

    def release_server(self, *args: object, **kwargs: object) -> None:
        self.released += 1
        super().release_server(*args, **kwargs)  # type: ignore[arg-type]


async def test_a_server_whose_socket_says_it_is_empty_is_not_probed(tmp_path):
    # Two idle servers, each probe answer good for no time at all: /queue is asked once
    # per server, while its socket is not open yet; after that the `status` messages on
    # the socket say the server is empty, and an empty server needs no probe.
    fakes = [FakeComfy(), FakeComfy()]
    async with fake_servers(*fakes) as servers:
        async with Pool(servers, Store(tmp_path / "s"), owner="me", probe_ttl_s=0.0) as pool:
            (await pool.acquire()).release()
            followers = [await pool.follower(s.name) for s in servers]
            await wait_until(
                lambda: all(f.queue_remaining() == 0 for f in followers), 5.0, "status"
            )
            for _ in range(5):
                (await pool.acquire()).release()
    assert [f.stats["requests"].get("GET /queue", 0) for f in fakes] == [1, 1]


async def test_a_server_our_prompt_leaves_goes_to_our_next_prompt_without_a_new_lease(tmp_path):
    # One server, six jobs, two consumers: the lease is taken once and given back once;
    # in between the server passes from each prompt to the next inside this process.
    fake = FakeComfy(prompt_seconds=0.01)
    store = CountingStore(tmp_path / "s")
    jf = load_job_file(write_jobs(tmp_path / "jobs", 6))
    summary = await batch_over_fakes(jf, store, fake)
    runs = sorted(fake.stats["runs"], key=lambda r: r["start"])
    assert summary.done == 6
    assert len(runs) == 6
    assert all(a["end"] <= b["start"] for a, b in zip(runs, runs[1:], strict=False))
    assert (store.acquired, store.released) == (1, 1)
    assert store.server_leases()["gpu0"].owner is None


async def test_a_prompt_of_ours_that_nobody_follows_is_removed_after_a_grace(tmp_path, caplog):
    # A dead run's prompt (ours by its client_id) hangs on the only server: the pool
    # leaves it a grace for a catch-up to adopt it, then removes it and goes on.
    fake = FakeComfy(script=["hang"], prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 2))
    store = Store(tmp_path / "store")
    orphan = str(uuid.uuid4())
    async with fake_servers(fake) as servers:
        async with httpx.AsyncClient(base_url=servers[0].url) as http:
            body = {
                "prompt": jf.jobs[0].workflow,
                "prompt_id": orphan,
                "client_id": new_client_id(),
            }
            assert (await http.post("/prompt", json=body)).status_code == 200
        await wait_until(lambda: running(fake, orphan), 5.0, "the orphan to run")
        with caplog.at_level(logging.WARNING, logger="comfy_assets.pool"):
            summary = await asyncio.wait_for(
                fast_batch(jf, servers, store, config=fast_config(server_lease_s=0.5)),
                20.0,
            )
    assert outcomes(fake, orphan) == ["interrupted"]
    assert summary.done == 2
    assert any(
        f"server gpu0: removed prompts of ours that nobody followed: {orphan}" in r.message
        for r in caplog.records
    )


class _FullDiskStore:
    """A store whose writes of server leases find the disk full; its reads answer."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def acquire_server(self, server, owner, lease_s, prompt_id=None):
        raise StoreDiskFull("acquire_server", "store.db", OSError(28, "No space left"))


async def test_a_full_disk_under_the_server_leases_is_raised_at_once_however_many_servers(
    tmp_path,
):
    fakes = [FakeComfy(), FakeComfy(), FakeComfy()]
    store = _FullDiskStore(Store(tmp_path / "s"))
    async with fake_servers(*fakes) as servers:
        # An hour of store failures would be waited out: a full disk is not.
        async with Pool(servers, store, owner="me", store_timeout_s=3600) as pool:
            with pytest.raises(StoreDiskFull, match="writing acquire_server"):
                await asyncio.wait_for(pool.acquire(), 60)


def test_the_comfyui_client_imports_nothing_of_ours_but_itself() -> None:
    # comfy/ is the ComfyUI side only: the pool (pool/) uses it, never the other way.
    import ast

    import comfy_assets.comfy

    folder = Path(comfy_assets.comfy.__file__).parent
    outside = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith("comfy_assets.") and not name.startswith("comfy_assets.comfy"):
                    outside.append(f"{path.name}: {name}")
    assert len(list(folder.glob("*.py"))) > 10
    assert outside == []
