"""``comfy-assets status``: per partition its jobs by state and time left, per server what
it renders now, and with ``--partition`` each job not done with one reason naming what
it waits for, from what running batches write to the store."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from comfy_assets.cli.main import main
from comfy_assets.cli.status import REASONS, gather, lines
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render import publish, steering
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store, Via, metadata
from fake_comfy import FakeComfy
from tests.pool.test_models_pool import model_jobs
from tests.support import (
    fake_servers,
    fast_batch,
    fast_config,
    free_port,
    job_id,
    start_fake_process,
    wait_until,
    write_jobs,
)

pytestmark = pytest.mark.timeout(60)

# What docs/steering.md says each of --json's partitions has, a batch running it or not.
PARTITION_KEYS = {"partition", "states", "estimate_s", "waiting", "owner"}


async def status_during(
    tmp_path: Path,
    fakes: list[FakeComfy],
    jf: JobFile,
    until: Callable[[Store], bool],
    what: str,
    config: BatchConfig | None = None,
) -> dict[str, Any]:
    """``status``'s report (``gather``) of partition "p", taken once ``until(store)`` holds
    while a batch of ``jf`` runs on ``fakes`` (store ``tmp_path/s``); the batch is then
    cancelled."""
    store = Store(tmp_path / "s")
    async with fake_servers(*fakes) as servers:
        task = asyncio.create_task(
            run_batch(
                jf, partition="p", servers=servers, store=store, config=config or fast_config()
            )
        )
        try:
            await wait_until(lambda: until(store), 30.0, what)
            report = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), "p")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert report is not None
    return report


async def test_status_names_what_each_server_renders_and_why_each_job_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    fakes = [FakeComfy(models=["a.safetensors"], prompt_seconds=0.3) for _ in range(2)]
    jf = model_jobs(tmp_path / "jobs", ["a.safetensors"] * 12)
    for job in jf.jobs:
        job.workflow["3"]["inputs"]["steps"] = 50

    def sampling(store: Store) -> bool:
        rows = [r for r in store.live() if r.kind == "server"]
        return any("KSampler, step" in str(r.detail.get("progress")) for r in rows)

    report = await status_during(tmp_path, fakes, jf, sampling, "a sampler's step on a server")
    (part,) = report["partitions"]
    assert part["partition"] == "p" and sum(part["states"].values()) == 12
    rendering = [s for s in report["servers"] if s["state"] == "rendering"]
    assert rendering and all(s["partition"] == "p" for s in rendering)
    assert any(re.search(r"node 5/7 KSampler, step \d+/50", s["progress"]) for s in rendering)
    reasons = {j["reason"] for j in report["jobs"]}
    assert reasons <= set(REASONS)
    assert "waiting for a server" in reasons and "rendering" in reasons
    waiting = next(j for j in report["jobs"] if j["reason"] == "waiting for a server")
    assert "gpu0, gpu1 can run it" in waiting["detail"]
    text = lines(report)
    assert text[0].startswith("partition p: ")
    assert any(line.startswith("server gpu0: ") for line in text)


async def test_a_job_in_backoff_says_until_when_and_after_which_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    fake = FakeComfy(script=["500"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    config = fast_config(base_delay_s=60.0, max_delay_s=60.0)

    def in_backoff(store: Store) -> bool:
        parts = [r for r in store.live() if r.kind == "partition"]
        return any(r.detail.get("held") for r in parts)

    report = await status_during(tmp_path, [fake], jf, in_backoff, "a job in backoff", config)
    (job,) = report["jobs"]
    assert job["reason"] == "in backoff"
    assert re.match(r"until \d\d:\d\d:\d\d \(\d+ s from now\), after: .*500", job["detail"])


async def test_a_job_requeued_after_the_running_batch_dead_lettered_it_waits_for_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    # Job 0's colour is over EmptyImage's max: POST /prompt answers 400, a dead letter at
    # once; the other six render slowly, so the batch is still running when it is requeued.
    jf = load_job_file(
        write_jobs(tmp_path / "jobs", 7, extra=[{"set": {"1.color": 1 << 30}}] + [{}] * 6)
    )
    bad = jf.jobs[0].id
    store = Store(tmp_path / "s")
    async with fake_servers(FakeComfy(prompt_seconds=0.2)) as servers:
        task = asyncio.create_task(fast_batch(jf, servers, store))
        try:

            def dead(s: Store) -> bool:
                rec = s.get(bad)  # None until the batch registers its jobs
                return rec is not None and rec.state == "failed_fatal"

            await wait_until(lambda: dead(store), 30.0, "a dead letter")
            assert store.requeue(bad)

            def let_go(s: Store) -> bool:
                parts = [r for r in s.live() if r.kind == "partition"]
                return any(bad in (r.detail.get("let_go") or {}) for r in parts)

            await wait_until(lambda: let_go(store), 30.0, "the batch's row naming it")
            report = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), "p")
            summary = await task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert report is not None
    (job,) = [j for j in report["jobs"] if j["job_id"] == bad]
    assert job["state"] == "pending"
    assert job["reason"] == "not in a running batch"
    assert job["detail"] == (
        "the running batch of partition p dead-lettered it, and it was requeued since: that "
        "batch does not take it up again; the next run of the partition renders it"
    )
    # True to the end: that run rendered the other six and left it pending.
    assert summary.done == 6
    assert store.get(bad).state == "pending"


async def test_a_prompt_posted_behind_another_clients_reads_posted_not_posting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    fake = FakeComfy(busy=3, prompt_seconds=0.5)  # another client's 3 prompts run first
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))

    def posted(store: Store) -> bool:
        rows = [r for r in store.live() if r.kind == "server"]
        return any(r.detail.get("progress") == publish.POSTED_SILENT for r in rows)

    report = await status_during(tmp_path, [fake], jf, posted, "our prompt posted, queued")
    (job,) = report["jobs"]
    assert job["reason"] == "rendering"
    assert job["detail"].endswith(", posted, nothing heard of it since")


async def test_a_server_that_dies_under_our_prompt_reads_unreachable_not_rendering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    port = free_port()
    fake = start_fake_process(port, "--prompt-seconds", "5")
    store = Store(tmp_path / "s")
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    server = ServerSpec("gpu0", f"http://127.0.0.1:{port}")

    def row_state(want: str) -> Callable[[], bool]:
        def seen() -> bool:
            rows = [r for r in store.live() if r.kind == "server" and r.subject == "gpu0"]
            return any(r.detail.get("state") == want for r in rows)

        return seen

    task = asyncio.create_task(fast_batch(jf, [server], store))
    try:
        await wait_until(row_state("rendering"), 30.0, "the prompt to render")
        fake.kill()  # its host dies: the port refuses at once
        fake.wait()
        await wait_until(row_state("unreachable"), 30.0, "the server to read unreachable")
        report = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), "p")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fake.kill()
        fake.wait()
    assert report is not None
    (entry,) = report["servers"]
    assert entry["state"] == "unreachable" and "connection refused" in entry["reason"]
    assert "server gpu0: not used: unreachable (" in "\n".join(lines(report))
    (job,) = report["jobs"]
    assert job["reason"] == "waiting for a server"
    assert job["detail"].startswith("its prompt went to gpu0, unreachable now (")


async def test_a_job_whose_last_post_went_to_a_dead_server_waits_for_that_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Posted to gpu0 by a run that died; gpu0 is down. The job is asked for there
    # (catch-up) before it is posted to gpu1, which is free: status names gpu0.
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    (job,) = jf.jobs
    store = Store(tmp_path / "s")
    store.register_jobs("p", jf.jobs)
    store.claim_job(job.id, "host:1:gone", 60.0)
    store.transition(
        job.id, "submitted", via=Via(server="gpu0", attempt=1), prompt_id=job.prompt_id
    )
    store.release_claim(job.id, "host:1:gone")

    def catching_up() -> bool:
        parts = [r for r in store.live() if r.kind == "partition" and r.subject == "p"]
        return any(h.get("reason") == "catch-up" for r in parts for h in r.detail["held"].values())

    async with fake_servers(FakeComfy()) as (live,):
        gpu1 = ServerSpec("gpu1", live.url)
        dead = ServerSpec("gpu0", f"http://127.0.0.1:{free_port()}")
        config = fast_config(catch_up_s=60.0, probe_timeout_s=0.2)
        task = asyncio.create_task(
            run_batch(jf, partition="p", servers=[dead, gpu1], store=store, config=config)
        )
        try:
            await wait_until(catching_up, 30.0, "the catch-up on gpu0")
            report = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), "p")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert report is not None
    (entry,) = report["jobs"]
    assert entry["reason"] == "waiting for a server"
    assert re.fullmatch(
        r"its prompt went to gpu0, which does not answer: asked there again until "
        r"\d\d:\d\d:\d\d \(\d+ s from now\), then posted anew \(it may render twice\)",
        entry["detail"],
    ), entry["detail"]


def test_a_partition_nobody_runs_says_so_and_json_is_one_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jf = load_job_file(write_jobs(tmp_path / "jobs", 2))
    Store(tmp_path / "s").register_jobs("p", jf.jobs)
    assert main(["status", "--store", str(tmp_path / "s"), "--partition", "p", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [j["reason"] for j in report["jobs"]] == ["not in a running batch"] * 2
    # The keys docs/steering.md lists, as when a batch runs it: unknown ones null.
    (part,) = report["partitions"]
    assert set(part) == PARTITION_KEYS
    assert {s: n for s, n in part["states"].items() if n} == {"pending": 2}
    assert (part["estimate_s"], part["owner"]) == (None, None)
    assert part["waiting"] == {"not in a running batch": 2}
    assert main(["status", "--store", str(tmp_path / "s"), "--partition", "q"]) == 1
    assert main(["status", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "partition p: 2 pending; 0/2 done, 2 left (2 not in a running batch)"


def test_a_big_partition_lists_some_of_its_plain_pending_jobs_and_counts_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A million pending jobs nobody claims all wait alike: status counts them in SQL and
    # lists PLAIN_LISTED of them, so it answers in bounded time (bench/million_reads.py).
    monkeypatch.setattr("comfy_assets.store.live.PLAIN_LISTED", 2)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 5))
    store = Store(tmp_path / "s")
    store.register_jobs("p", jf.jobs)
    assert store.claim(jf.jobs[4].id, "gone-owner") == "claimed"  # listed whatever the cap
    report = gather(store, "p")
    assert report is not None
    listed = {j["job_id"] for j in report["jobs"]}
    assert len(listed) == 3 and jf.jobs[4].id in listed
    assert report["jobs_not_listed"] == {
        "count": 2,
        "reason": "not in a running batch",
        "detail": "no running batch holds partition p (a run, or a worker's queue, brings it)",
    }
    (part,) = report["partitions"]
    assert part["waiting"] == {"not in a running batch": 5}
    assert main(["status", "--store", str(tmp_path / "s"), "--partition", "p"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "5 jobs not done: 5 not in a running batch" in out
    assert out[-1] == (
        "not in a running batch (2 more jobs, not listed): no running batch holds partition p "
        "(a run, or a worker's queue, brings it)"
    )


def test_each_reason_names_what_the_job_waits_for(tmp_path: Path) -> None:
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    store = Store(tmp_path / "s")
    store.register_jobs("p", jf.jobs)
    first, second, third = (j.id for j in jf.jobs)
    # What a running batch writes (render/publish.py): the second job continues from the
    # first; the third's only able server is quarantined.
    store.publish_live(
        "owner-1",
        {
            ("partition", "p"): {
                "total": 3,
                "done": 0,
                "remaining": 3,
                "estimate_s": 200.0,
                "waiting": {"waiting for a server": 2, "for their upstream shot": 1},
                "held": {second: {"reason": "upstream", "upstream": [first]}},
                "groups": [
                    {"servers": ["gpu0", "gpu1"], "holding": [], "jobs": [first]},
                    {"servers": ["gpu1"], "holding": [], "jobs": [third]},
                ],
            },
            ("server", "gpu0"): {"state": "free"},
            ("server", "gpu1"): {"state": "quarantined", "reason": "quarantined until 12:00"},
            ("server", "gpu2"): {"state": "trial", "reason": "on trial, its job failed there"},
        },
    )
    report = gather(store, "p")
    assert report is not None
    assert set(report["partitions"][0]) == PARTITION_KEYS
    reasons = {j["job_id"]: (j["reason"], j["detail"]) for j in report["jobs"]}
    assert reasons[first] == (
        "waiting for a server",
        "gpu0, gpu1 can run it; gpu0 free; gpu1 quarantined until 12:00",
    )
    assert reasons[second] == ("waiting for its upstream job", f"{first} (pending)")
    assert reasons[third] == ("every server that can run it is quarantined", "gpu1")
    text = lines(report)
    assert text[0] == (
        "partition p: 3 pending; 0/3 done, 3 left, about 3 min to go (1 waiting for a "
        "server, 1 waiting for its upstream job, 1 every server that can run it is quarantined)"
    )
    assert "server gpu1: not used: quarantined until 12:00" in text
    assert "server gpu2: not used: on trial, its job failed there" in text


async def test_a_workflow_without_models_waits_for_a_server_not_for_one_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # image.json: EmptyImage, ImageInvert, SaveImage: no model file at all.
    monkeypatch.setattr(steering, "EVERY_S", 0.02)
    fakes = [FakeComfy(prompt_seconds=0.3) for _ in range(2)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 12))

    def both_rendering(store: Store) -> bool:
        rows = [r for r in store.live() if r.kind == "server"]
        return len([r for r in rows if r.detail.get("state") == "rendering"]) == 2

    report = await status_during(tmp_path, fakes, jf, both_rendering, "both servers rendering")
    waiting = [j for j in report["jobs"] if j["reason"].startswith("waiting for a server")]
    assert waiting
    assert {j["reason"] for j in waiting} == {"waiting for a server"}
    assert all(j["detail"].startswith("gpu0, gpu1 can run it; ") for j in waiting)
    assert "holding its model" not in lines(report)[0]


def _claimed(store: Store, job_id: str, *moves: tuple[str, float]) -> None:
    """Claim ``job_id`` for owner-1 and move it through ``moves`` ((state, epoch s))
    on the server each names after a colon (``"submitted:gpu0"``)."""
    store.claim(job_id, "owner-1")
    prev = "pending"
    for move, at in moves:
        state, _, server = move.partition(":")
        fields = {"number": 1} if state == "rendering" else {}
        store.transition(
            job_id,
            state,
            owner="owner-1",
            via=Via(server=server, attempt=1),
            from_state=prev,
            now=at,
            **fields,
        )
        prev = state


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store on each backend (status reads it in one snapshot: on PostgreSQL a
    REPEATABLE READ transaction)."""
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else None
    store = Store(tmp_path / "s", url)
    if url is not None:
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"TRUNCATE {', '.join(t.name for t in metadata.sorted_tables)}"))
    yield store
    store.close()


def test_one_status_output_agrees_with_itself_while_jobs_move(
    tmp_path: Path, any_store: Store
) -> None:
    jf = load_job_file(write_jobs(tmp_path / "jobs", 6))
    store = any_store
    store.register_jobs("p", jf.jobs)
    store.register_owner("owner-1")
    a, b, c, d, e, f = (j.id for j in jf.jobs)
    t = store.now()
    # What the batch wrote 2 s ago: gpu0 free (a's prompt had ended), gpu1 rendering c,
    # gpu2 rendering d; and its counts then (6 left).
    store.publish_live(
        "owner-1",
        {
            ("partition", "p"): {
                "total": 6,
                "done": 0,
                "remaining": 6,
                "estimate_s": 600.0,
                "waiting": {"rendering": 2, "waiting for a server": 4},
                "held": {},
                "groups": [{"servers": ["gpu0", "gpu1", "gpu2"], "holding": [], "jobs": [e, f]}],
            },
            ("server", "gpu0"): {"state": "free"},
            ("server", "gpu1"): {
                "state": "rendering",
                "job": c,
                "partition": "p",
                "since": t - 4,
                "progress": "node 2/4 ImageInvert",
            },
            ("server", "gpu2"): {
                "state": "rendering",
                "job": d,
                "partition": "p",
                "since": t - 4,
                "progress": "node 4/4 SaveImage",
            },
        },
        now=t - 2,
    )
    # Since: a still downloads its outputs; b was posted on gpu0 a second ago; d ended.
    _claimed(store, a, ("submitted:gpu0", t - 6), ("rendering:gpu0", t - 6))
    _claimed(store, b, ("submitted:gpu0", t - 1))
    _claimed(store, c, ("submitted:gpu1", t - 4), ("rendering:gpu1", t - 4))
    _claimed(store, d, ("submitted:gpu2", t - 4), ("rendering:gpu2", t - 4))
    store.mark_done(d, "owner-1", files=[], now=t - 1)
    report = gather(store, "p")
    assert report is not None
    (part,) = report["partitions"]
    assert set(part) == PARTITION_KEYS and part["owner"] == "owner-1"
    states = part["states"]
    left = sum(n for s, n in states.items() if s not in ("succeeded", "degraded", "failed_fatal"))
    assert left == 5 and sum(part["waiting"].values()) == left
    assert part["waiting"] == {"rendering": 2, "finishing": 1, "waiting for a server": 2}
    reasons = {j["job_id"]: (j["reason"], j["detail"]) for j in report["jobs"]}
    assert reasons[a] == (
        "finishing",
        "its prompt left gpu0; its outputs are being downloaded and its result recorded",
    )
    assert reasons[b][0] == "rendering" and reasons[b][1].startswith("on gpu0 since ")
    assert reasons[c][0] == "rendering"
    assert reasons[c][1].startswith("on gpu1 since ")
    assert reasons[c][1].endswith(", node 2/4 ImageInvert")
    assert d not in reasons
    servers = {s["server"]: s for s in report["servers"]}
    assert (servers["gpu0"]["state"], servers["gpu0"]["job"]) == ("rendering", b)
    assert (servers["gpu1"]["state"], servers["gpu1"]["job"]) == ("rendering", c)
    assert servers["gpu2"]["state"] == "free"  # d, which it rendered, has ended
    text = lines(report)
    assert text[0].endswith(
        ", 5 left, about 10 min to go (2 rendering, 1 finishing, 2 waiting for a server)"
    )
    assert f"server gpu0: renders job {b} of p since " in text[1]
    assert text[3] == "server gpu2: free"
    assert text[4] == "5 jobs not done: 2 rendering, 1 finishing, 2 waiting for a server"
    # e and f wait for the same servers: their cause is said once, their ids under it.
    shared = reasons[e][1]
    assert reasons[f][1] == shared and shared.startswith("gpu0, gpu1, gpu2 can run it; ")
    assert text.count(f"waiting for a server (2 jobs): {shared}") == 1
    assert sum(shared in line for line in text) == 1
    at = text.index(f"waiting for a server (2 jobs): {shared}")
    assert text[at + 1 : at + 3] == [f"  job {e}", f"  job {f}"]
    assert f"job {a}: finishing: {reasons[a][1]}" in text  # a cause of its own: one line


def test_a_quarantined_or_on_trial_server_reads_so_with_no_run_going(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.register_jobs("p", load_job_file(write_jobs(tmp_path / "jobs", 1)).jobs)
    for name in ("s1", "s2", "s3"):  # servers a run used, and let go at its end
        assert store.acquire_server(name, "owner-1", 30.0)
        store.release_server(name, "owner-1")
    store.server_failed("s1", job_id(1), "0" * 64, "cuda", "CUDA error", infrastructure=True)
    # s2's quarantine began long ago: its cool-down is over, its next job decides.
    store.server_failed(
        "s2", job_id(2), "0" * 64, "cuda", "CUDA error", infrastructure=True, now=time.time() - 1e6
    )
    report = gather(store)
    assert report is not None
    servers = {s["server"]: s for s in report["servers"]}
    assert servers["s1"]["state"] == "quarantined"
    assert servers["s2"]["state"] == "trial"
    assert servers["s3"]["state"] == "idle"
    text = lines(report)
    s1 = next(line for line in text if line.startswith("server s1: "))
    assert re.fullmatch(r"server s1: not used: quarantined until [-\d]{10} [:\d]{8} \S+: .+", s1)
    assert "server s2: on trial (its cool-down is over: its next job decides)" in text
    assert "server s3: not used: no running batch uses it" in text


async def test_a_worker_says_what_its_servers_render_and_when_one_dies(tmp_path: Path) -> None:
    from comfy_assets.service.sources import MemorySource
    from comfy_assets.service.worker import Worker

    port = free_port()
    fake = start_fake_process(port, "--prompt-seconds", "5")
    store = Store(tmp_path / "s")
    jobs = write_jobs(tmp_path / "jobs", 1)
    (job,) = load_job_file(jobs).jobs
    source = MemorySource("images")
    source.put(jobs.read_text().splitlines()[0])
    server = ServerSpec("gpu0", f"http://127.0.0.1:{port}")
    worker = Worker(
        source,
        servers=[server],
        store=store,
        config=fast_config(attempts=1),
        workflows_dir=jobs.parent,
        status_every_s=0.02,
        grace_s=0.0,  # its job's server is dead: cancelled at the stop, not waited for
    )

    def row_state(want: str) -> Callable[[], bool]:
        def seen() -> bool:
            rows = [r for r in store.live() if r.kind == "server" and r.subject == "gpu0"]
            return any(r.detail.get("state") == want for r in rows)

        return seen

    task = asyncio.create_task(worker.run())
    try:
        await wait_until(row_state("rendering"), 30.0, "the worker's prompt to render")
        rendering = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), None)
        fake.kill()  # its host dies: the port refuses at once
        fake.wait()
        await wait_until(row_state("unreachable"), 30.0, "the server to read unreachable")
        dead = await asyncio.to_thread(gather, Store.existing(tmp_path / "s"), None)
    finally:
        worker.request_stop()
        source.end()
        await asyncio.gather(task, return_exceptions=True)
        fake.kill()
        fake.wait()
    assert rendering is not None and dead is not None
    (entry,) = rendering["servers"]
    assert entry["state"] == "rendering" and entry["job"] == job.id
    assert entry["owner"] == worker.owner
    (entry,) = dead["servers"]
    assert entry["state"] == "unreachable" and "connection refused" in entry["reason"]
    assert "server gpu0: not used: unreachable (" in "\n".join(lines(dead))
    # Its rows leave with it.
    assert [r for r in store.live() if r.owner == worker.owner] == []
