"""The worker against the machine's RabbitMQ and fake ComfyUI servers: exactly once with
duplicate messages, prefetch, dead letters with their reason, a worker killed mid-job,
and a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aio_pika
import pytest
import sqlalchemy.exc

from comfy_assets.comfy import client as client_module
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service import broker
from comfy_assets.service.sources import RabbitSource
from comfy_assets.service.worker import Worker, job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.api_support import AMQP, fresh_queue
from tests.process_support import start, stop
from tests.support import (
    ROOT,
    executed,
    fake_servers,
    fast_config,
    outcomes,
    posted,
    running,
    wait_until,
    write_jobs,
)

pytestmark = pytest.mark.rabbitmq

URL = AMQP


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    """A fresh queue name; the queue and its ``.dead`` are deleted at the end."""
    async with fresh_queue("test-worker") as name:
        yield name


async def ready_count(queue_name: str) -> int:
    """Messages ready in ``queue_name`` (unacknowledged ones of open channels excluded)."""
    async with await aio_pika.connect(URL) as connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue_name, passive=True)
        return declared.declaration_result.message_count or 0


async def drain(queue_name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Take (and ack) every message of ``queue_name``."""
    messages = []
    async with await aio_pika.connect(URL) as connection:
        channel = await connection.channel()
        q = await channel.declare_queue(queue_name, passive=True)
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            messages.append(message)
    return messages


def make_worker(
    queue_name: str, specs: list[ServerSpec], store: Store, folder: Path, **kw
) -> Worker:
    config = kw.pop("config", None) or fast_config(attempts=1)
    return Worker(
        RabbitSource(URL, queue_name),
        servers=specs,
        store=store,
        config=config,
        workflows_dir=folder,
        **kw,
    )


@asynccontextmanager
async def running_worker(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker`` in the background; stop it (grace as configured) at the end."""
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.consuming.wait(), 30)
        yield task
    finally:
        if not task.done():
            worker.request_stop("test over")
        await asyncio.wait_for(task, 60)


def worker_args(queue_name: str, url: str, store: Path, folder: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "comfy_assets.cli",
        "worker",
        "--rabbitmq",
        URL,
        "--queue",
        queue_name,
        "--server",
        f"gpu0={url}",
        "--store",
        str(store),
        "--workflows-dir",
        str(folder),
        "--attempts",
        "1",
        "--poll-s",
        "0.05",
        *extra,
    ]


async def test_enqueue_publishes_each_job_persistent_to_a_quorum_queue(tmp_path, queue):
    jobs = write_jobs(tmp_path / "jobs", 3)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "comfy_assets.cli",
        "enqueue",
        "--rabbitmq",
        URL,
        "--queue",
        queue,
        "--jobs",
        str(jobs),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == f"enqueued 3 jobs to {queue}\n"
    messages = await drain(queue)
    loaded = load_job_file(jobs).jobs
    assert [json.loads(m.body)["workflow"] for m in messages] == [j.workflow for j in loaded]
    assert [m.message_id for m in messages] == [j.id for j in loaded]
    assert {m.content_type for m in messages} == {"application/json"}
    assert {m.delivery_mode for m in messages} == {aio_pika.DeliveryMode.PERSISTENT}
    # Declared quorum (and durable): declaring either as a classic queue is refused.
    for name in (queue, broker.dead_queue_name(queue)):
        async with await aio_pika.connect(URL) as connection:
            channel = await connection.channel()
            with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed):
                await channel.declare_queue(
                    name, durable=True, arguments={"x-queue-type": "classic"}
                )


async def test_every_job_of_a_file_enqueued_twice_runs_once_and_every_message_is_acked(
    tmp_path, queue
):
    n = 6
    jobs = write_jobs(tmp_path / "jobs", n)
    for _ in range(2):
        assert await broker.enqueue(URL, queue, job_messages(jobs)) == n
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    store = Store(tmp_path / "store")
    async with fake_servers(*fakes) as specs:
        worker = make_worker(queue, specs, store, jobs.parent)
        async with running_worker(worker):
            await wait_until(lambda: worker.counts["acked"] == 2 * n, 60, f"{2 * n} acks")
    for job in load_job_file(jobs).jobs:
        assert sum(executed(f, job.prompt_id) for f in fakes) == 1, job.id
        assert sum(posted(f, job.prompt_id) for f in fakes) == 1, job.id
    assert worker.counts["acked"] == 2 * n
    assert worker.counts["done"] + worker.counts["done_before"] == 2 * n
    # The worker's connection is closed: anything unacked would be ready again.
    assert await ready_count(queue) == 0
    assert await ready_count(broker.dead_queue_name(queue)) == 0


async def test_prefetch_keeps_a_one_server_worker_from_holding_a_third_message(tmp_path, queue):
    # Two messages per server: one renders, the next waits in line for the server; a
    # third goes to another worker, even while the first hangs.
    jobs = write_jobs(tmp_path / "jobs", 3)
    first, second, third = load_job_file(jobs).jobs
    await broker.enqueue(URL, queue, job_messages(jobs))
    fake_a = FakeComfy(script=["hang"], prompt_seconds=0.005)
    fake_b = FakeComfy(prompt_seconds=0.005)
    store = Store(tmp_path / "store")
    async with fake_servers(fake_a, fake_b) as (spec_a, spec_b):
        worker_a = make_worker(queue, [spec_a], store, jobs.parent, grace_s=0.0)
        async with running_worker(worker_a):
            held = [first, second]
            await wait_until(
                lambda: any(running(fake_a, j.prompt_id) for j in held), 30, "A to run a job"
            )
            # A holds a job hanging and the other in line for its server: B gets job 3.
            worker_b = make_worker(queue, [spec_b], store, jobs.parent)
            async with running_worker(worker_b):
                await wait_until(lambda: worker_b.counts["acked"] == 1, 30, "B to finish job 3")
            assert sum(running(fake_a, j.prompt_id) for j in held) == 1
        # A stopped with no grace: jobs 1 and 2 requeued (its interruption: the SIGTERM test).
    assert (posted(fake_b, third.prompt_id), executed(fake_b, third.prompt_id)) == (1, 1)
    assert sum(posted(fake_a, j.prompt_id) for j in held) == 1
    assert posted(fake_a, third.prompt_id) == 0
    assert posted(fake_b, first.prompt_id) == posted(fake_b, second.prompt_id) == 0
    assert worker_a.counts["requeued"] == 2 and worker_a.counts["acked"] == 0
    assert await ready_count(queue) == 2


async def test_a_dead_letter_carries_its_reason_and_a_duplicate_is_not_published_again(
    tmp_path, queue
):
    jobs = write_jobs(tmp_path / "jobs", 1)
    job = load_job_file(jobs).jobs[0]
    line = jobs.read_text().splitlines()[0].encode()
    await broker.enqueue(URL, queue, [(job.id, line), (job.id, line), ("bad-1", b"{not json")])
    fake = FakeComfy(script=["error"], prompt_seconds=0.005)
    store = Store(tmp_path / "store")
    async with fake_servers(fake) as specs:
        worker = make_worker(queue, specs, store, jobs.parent)
        async with running_worker(worker):
            await wait_until(lambda: worker.counts["acked"] == 3, 30, "3 acks")
    dead = await drain(broker.dead_queue_name(queue))
    assert [m.message_id for m in dead] == [job.id, "bad-1"]
    reason = store.get(job.id).reason
    assert "IndexError" in reason
    assert dead[0].headers[broker.REASON_HEADER] == reason
    assert dead[0].body == line
    assert dead[0].delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert (
        dead[1]
        .headers[broker.REASON_HEADER]
        .startswith(f"invalid job: {queue} message bad-1:1: json: not JSON")
    )
    assert dead[1].body == b"{not json"
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert (worker.counts["dead_lettered"], worker.counts["dead_before"]) == (1, 1)
    assert await ready_count(queue) == 0


async def one_job_enqueued(tmp_path: Path, queue: str) -> tuple[Path, Job, Path]:
    """One job of ``tmp_path/jobs`` enqueued on ``queue``, and a store at ``tmp_path/store``
    whose schema is made before processes share it; returns the job file's path, the job and
    the store's folder."""
    jobs = write_jobs(tmp_path / "jobs", 1)
    job = load_job_file(jobs).jobs[0]
    await broker.enqueue(URL, queue, job_messages(jobs))
    store_dir = tmp_path / "store"
    Store(store_dir)
    return jobs, job, store_dir


async def test_a_worker_killed_mid_job_is_finished_by_another_without_a_second_execution(
    tmp_path, queue
):
    # `silent` + a 60 s poll: worker A never learns that the prompt finished, so killing it
    # right after the fake's own record says success leaves the message unacked.
    jobs, job, store_dir = await one_job_enqueued(tmp_path, queue)
    fake = FakeComfy(script=["silent"], prompt_seconds=0.005)
    async with fake_servers(fake) as specs:
        args = worker_args(
            queue,
            specs[0].url,
            store_dir,
            jobs.parent,
            "--lease-s",
            "1",
            "--server-lease-s",
            "1",
            "--poll-s",
            "60",
        )
        proc = await start(args, tmp_path / "a.log")
        try:
            await wait_until(lambda: outcomes(fake, job.prompt_id) == ["success"], 60, "the render")
        finally:
            proc.kill()  # SIGKILL
            await asyncio.wait_for(proc.wait(), 30)
        store = Store(store_dir)
        # Killed within moments of its POST: the rendering move may not be written yet
        # (render/rendering.py), but the claim and the prompt_id the catch-up needs are.
        record = store.get(job.id)
        log = (tmp_path / "a.log").read_text()
        assert record.state in ("submitted", "rendering"), log
        assert record.prompt_id == job.prompt_id, log
        worker_b = make_worker(queue, specs, store, jobs.parent)
        async with running_worker(worker_b):
            await wait_until(lambda: worker_b.counts["acked"] == 1, 60, "B to ack the redelivery")
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert worker_b.counts["done"] == 1
    assert store.get(job.id).state == "succeeded"
    assert len(store.files(job.id)) == 2
    assert await ready_count(queue) == 0


@asynccontextmanager
async def sigterm_once_it_renders(
    queue: str,
    url: str,
    enqueued: tuple[Path, Job, Path],
    fake: FakeComfy,
    log: Path,
    grace_s: str,
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A worker process on ``queue`` for the job ``one_job_enqueued`` put there
    (``enqueued``), over the fake at ``url``, ``--grace-s grace_s``, its output in
    ``log``: sent SIGTERM once the job's prompt runs, killed on the way out if it still
    runs."""
    jobs, job, store_dir = enqueued
    proc = await start(worker_args(queue, url, store_dir, jobs.parent, "--grace-s", grace_s), log)
    try:
        await wait_until(lambda: running(fake, job.prompt_id), 60, "the prompt to run")
        proc.send_signal(signal.SIGTERM)
        yield proc
    finally:
        await stop(proc)


async def test_sigterm_interrupts_the_running_prompt_requeues_and_exits_0_then_it_runs_once(
    tmp_path, queue
):
    enqueued = await one_job_enqueued(tmp_path, queue)
    jobs, job, store_dir = enqueued
    fake = FakeComfy(script=["hang"], prompt_seconds=0.005)
    log = tmp_path / "a.log"
    async with fake_servers(fake) as specs:
        async with sigterm_once_it_renders(queue, specs[0].url, enqueued, fake, log, "0.2") as proc:
            code = await asyncio.wait_for(proc.wait(), 60)
        text = log.read_text()
        assert code == 0, text
        assert outcomes(fake, job.prompt_id) == ["interrupted"]
        assert "SIGTERM: stopping" in text and "message requeued" in text
        assert await ready_count(queue) == 1
        store = Store(store_dir)
        assert store.get(job.id).claimed_by is None
        worker_b = make_worker(queue, specs, store, jobs.parent)
        async with running_worker(worker_b):
            await wait_until(lambda: worker_b.counts["acked"] == 1, 60, "B to run the job")
    assert outcomes(fake, job.prompt_id) == ["interrupted", "success"]
    assert store.get(job.id).state == "succeeded"
    assert await ready_count(queue) == 0


async def test_a_second_sigterm_is_logged_and_the_running_job_still_gets_its_grace(tmp_path, queue):
    enqueued = await one_job_enqueued(tmp_path, queue)
    _, job, store_dir = enqueued
    fake = FakeComfy(script=["slow"], prompt_seconds=0.1)  # 10 x 0.1 s a node
    log = tmp_path / "a.log"
    async with fake_servers(fake) as specs:
        async with sigterm_once_it_renders(queue, specs[0].url, enqueued, fake, log, "120") as proc:
            await wait_until(lambda: "SIGTERM: stopping" in log.read_text(), 30, "the first signal")
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 60)
    text = log.read_text()
    assert code == 0, text
    assert "SIGTERM: second signal received; still waiting up to" in text
    assert outcomes(fake, job.prompt_id) == ["success"]
    assert Store(store_dir).get(job.id).state == "succeeded"
    assert await ready_count(queue) == 0


async def test_a_lost_connection_stops_the_worker_with_an_error(tmp_path, queue):
    store = Store(tmp_path / "store")
    async with fake_servers(FakeComfy()) as specs:
        worker = make_worker(queue, specs, store, tmp_path)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.consuming.wait(), 30)
        # As if the broker went away: the connection closes under the worker.
        await worker.source._connection.close()
        with pytest.raises(broker.BrokerError, match="RabbitMQ connection lost"):
            await asyncio.wait_for(task, 30)
    assert worker.stop_reason.startswith("error: RabbitMQ connection lost")


async def test_a_message_whose_handling_raises_is_dead_lettered_and_the_worker_serves_on(
    tmp_path, queue, monkeypatch
):
    # Our code raising for one job, by hand (the parser refuses the inputs that did so):
    # registering the first job's row, encoding the second one's prompt.
    jobs = write_jobs(tmp_path / "jobs", 3)
    row_fails, prompt_fails, good = load_job_file(jobs).jobs
    lines = jobs.read_text().splitlines()
    register, dumps = Store.register_jobs, client_module.json_dumps
    register_claimed = Store.register_claimed

    def register_jobs(self, partition, batch, *args, **kwargs):
        if any(j.id == row_fails.id for j in batch):
            raise sqlalchemy.exc.DataError("INSERT ...", {}, ValueError("cannot contain NUL"))
        return register(self, partition, batch, *args, **kwargs)

    def register_new(self, partition, job, *args, **kwargs):  # a worker's registration
        if job.id == row_fails.id:
            raise sqlalchemy.exc.DataError("INSERT ...", {}, ValueError("cannot contain NUL"))
        return register_claimed(self, partition, job, *args, **kwargs)

    def json_dumps(value):
        text = dumps(value)
        return text + "\ud800" if value.get("prompt_id") == prompt_fails.prompt_id else text

    monkeypatch.setattr(Store, "register_jobs", register_jobs)
    monkeypatch.setattr(Store, "register_claimed", register_new)
    monkeypatch.setattr(client_module, "json_dumps", json_dumps)
    fake = FakeComfy(prompt_seconds=0.005)
    store = Store(tmp_path / "store")
    async with fake_servers(fake) as specs:
        # One message at a time, in order: the good one comes after both bad ones.
        worker = make_worker(queue, specs, store, jobs.parent, config=fast_config(attempts=4))
        worker.jobs_per_server = 1
        async with running_worker(worker) as task:
            await broker.enqueue(
                URL,
                queue,
                [
                    (j.id, line.encode())
                    for j, line in zip((row_fails, prompt_fails, good), lines, strict=True)
                ],
            )
            await wait_until(lambda: worker.counts["acked"] == 3, 30, "3 acks")
            assert not task.done()  # still serving
    dead = await drain(broker.dead_queue_name(queue))
    assert [m.message_id for m in dead] == [row_fails.id, prompt_fails.id]
    reasons = [m.headers[broker.REASON_HEADER] for m in dead]
    assert reasons[0].startswith("our error while handling this job: DataError: ")
    assert reasons[1].startswith("our error while handling this job: UnicodeEncodeError: ")
    assert store.get(prompt_fails.id).reason == reasons[1]
    assert store.get(prompt_fails.id).attempts == 1  # dead at once, never tried again
    assert store.get(good.id).state == "succeeded"
    assert prompt_fails.prompt_id not in fake.stats["prompts"]
    assert (worker.counts["dead_lettered"], worker.counts["done"]) == (2, 1)
    assert worker.counts["requeued"] == 0
    assert await ready_count(queue) == 0
