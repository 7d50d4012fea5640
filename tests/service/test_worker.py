"""The worker on its in-memory and job-file sources (no RabbitMQ): one outcome per message,
acks only after a done record, dead letters once, graceful stop with a grace period."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest

from comfy_assets.cli.main import build_parser
from comfy_assets.jobs.model import Job, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.run import run_one
from comfy_assets.service import handling
from comfy_assets.service.messages import parse_message
from comfy_assets.service.sources import FileSource, MemoryDelivery, MemorySource
from comfy_assets.service.worker import Worker, job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import (
    executed,
    fake_servers,
    fast_config,
    outcomes,
    posted,
    running,
    wait_until,
    write_jobs,
)


def one_job_line(tmp_path: Path) -> tuple[Path, Job, str]:
    """One job written to ``tmp_path/jobs``; returns the job file's path, its job and its line
    (the message a queue would carry)."""
    jobs = write_jobs(tmp_path / "jobs", 1)
    return jobs, load_job_file(jobs).jobs[0], jobs.read_text().splitlines()[0]


def make_worker(source, specs, store: Store, folder: Path, **kwargs) -> Worker:
    config = kwargs.pop("config", None) or fast_config(attempts=1)
    return Worker(source, servers=specs, store=store, config=config, workflows_dir=folder, **kwargs)


async def test_a_job_delivered_twice_is_executed_once_and_both_messages_are_acked(tmp_path, store):
    jobs = write_jobs(tmp_path / "jobs", 4)
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    source = MemorySource("images")
    for _ in range(2):
        for line in jobs.read_text().splitlines():
            source.put(line)
    source.end()
    async with fake_servers(*fakes) as specs:
        worker = make_worker(source, specs, store, jobs.parent)
        await asyncio.wait_for(worker.run(), 60)
    for job in load_job_file(jobs).jobs:
        assert sum(executed(f, job.prompt_id) for f in fakes) == 1, job.id
        assert sum(posted(f, job.prompt_id) for f in fakes) == 1, job.id
        assert store.get(job.id).state == "succeeded"
    assert len(source.acked) == 8
    assert source.dead == [] and source.requeued == []
    # Each job is done once; its other delivery finds it done, waited for its claim or not.
    assert worker.counts["done"] == 4 and worker.counts["done_before"] == 4


async def test_two_deliveries_of_one_job_taken_at_once_run_it_once(tmp_path, store):
    # Two servers, so both copies are taken together: the second waits for the first's
    # claim instead of running too.
    jobs, job, line = one_job_line(tmp_path)
    fakes = [FakeComfy(prompt_seconds=0.02), FakeComfy(prompt_seconds=0.02)]
    source = MemorySource("images")
    source.put(line)
    source.put(line)
    source.end()
    async with fake_servers(*fakes) as specs:
        worker = make_worker(source, specs, store, jobs.parent)
        await asyncio.wait_for(worker.run(), 60)
    assert sum(executed(f, job.prompt_id) for f in fakes) == 1
    assert sum(posted(f, job.prompt_id) for f in fakes) == 1
    assert source.acked == [line.encode(), line.encode()]
    assert worker.counts["done"] == 1 and worker.counts["done_before"] == 1
    assert store.get(job.id).state == "succeeded"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{not json", "json: not JSON"),
        (b"\xff\xfe", "body: not UTF-8"),
        (
            json.dumps({"id": "NOT-A-UUID", "workflow": "image.json"}).encode(),
            "id: not a lowercase hyphenated UUID",
        ),
        (
            json.dumps(
                {"id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "workflow": "missing.json"}
            ).encode(),
            "workflow file not found",
        ),
        (
            json.dumps(
                {"id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427", "workflow": "image.json", "sett": {}}
            ).encode(),
            "did you mean 'set'?",
        ),
    ],
)
async def test_a_message_that_is_not_a_valid_job_is_dead_lettered_with_the_validation_error(
    tmp_path, store, workflow_dir, body, expected
):
    fake = FakeComfy()
    source = MemorySource("images")
    source.put(body, message_id="m-1")
    source.end()
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, workflow_dir)
        await asyncio.wait_for(worker.run(), 30)
    assert len(source.dead) == 1
    dead_body, reason = source.dead[0]
    assert dead_body == body
    assert reason.startswith("invalid job: images message m-1:1: ")
    assert expected in reason
    assert source.acked == [body]
    assert fake.stats["prompts"] == {}
    assert worker.counts["invalid"] == 1


async def test_a_dead_letter_is_published_once_and_its_duplicate_is_only_acked(tmp_path, store):
    jobs, job, line = one_job_line(tmp_path)
    fake = FakeComfy(script=["error"], prompt_seconds=0.005)
    source = MemorySource("images")
    source.put(line)
    source.put(line)
    source.end()
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, jobs.parent)
        await asyncio.wait_for(worker.run(), 30)
    record = store.get(job.id)
    assert record.state == "failed_fatal"
    assert source.dead == [(line.encode(), record.reason)]
    assert "IndexError" in record.reason
    assert len(source.acked) == 2
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    assert (worker.counts["dead_lettered"], worker.counts["dead_before"]) == (1, 1)


async def test_after_the_grace_a_running_prompt_is_interrupted_and_its_message_requeued(
    tmp_path, store
):
    jobs, job, line = one_job_line(tmp_path)
    fake = FakeComfy(script=["hang"], prompt_seconds=0.005)
    source = MemorySource("images")
    source.put(line)
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, jobs.parent, grace_s=0.0)
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: running(fake, job.prompt_id), 30, "the prompt to run")
        worker.request_stop("test")
        await asyncio.wait_for(task, 30)
        await fake.wait_idle(10)
    assert outcomes(fake, job.prompt_id) == ["interrupted"]
    assert source.requeued == [line.encode()] and source.acked == []
    record = store.get(job.id)
    assert not record.done and record.claimed_by is None
    assert worker.counts["requeued"] == 1


async def test_a_job_done_as_the_grace_runs_out_is_acked_not_requeued(
    tmp_path, store, monkeypatch, caplog
):
    jobs, job, line = one_job_line(tmp_path)
    fake = FakeComfy(prompt_seconds=0.005)
    source = MemorySource("images")
    source.put(line)
    finished = asyncio.Event()

    async def done_then_still_busy(*args, **kwargs):
        # The run wrote its done record and is cancelled before it returns (the grace
        # ran out between the two).
        await run_one(*args, **kwargs)
        finished.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(handling, "run_one", done_then_still_busy)
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, jobs.parent, grace_s=0.0)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(finished.wait(), 30)
        with caplog.at_level(logging.INFO):
            worker.request_stop("test")
            await asyncio.wait_for(task, 30)
    assert executed(fake, job.prompt_id) == 1
    assert source.acked == [line.encode()] and source.requeued == []
    assert worker.counts["done"] == 1 and worker.counts["requeued"] == 0
    assert f"job {job.id}: succeeded as the grace ran out; message acked" in caplog.text


async def test_a_job_that_ends_within_the_grace_is_acked_and_a_message_after_the_stop_goes_back(
    tmp_path, store, caplog
):
    jobs = write_jobs(tmp_path / "jobs", 2)
    first, second = load_job_file(jobs).jobs
    lines = jobs.read_text().splitlines()
    # `slow` at 0.05 s a node: long enough to be running when we ask to stop.
    fake = FakeComfy(script=["slow"], prompt_seconds=0.05)
    source = MemorySource("images")
    source.put(lines[0])
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, jobs.parent, grace_s=60.0)
        task = asyncio.create_task(worker.run())
        await wait_until(lambda: running(fake, first.prompt_id), 30, "the first prompt to run")
        with caplog.at_level(logging.INFO, logger="comfy_assets.service.worker"):
            worker.request_stop("SIGTERM")
            # Arrives after the stop request, while a free slot waits for a message:
            # handed back, never run.
            source.put(lines[1])
            worker.request_stop("SIGTERM")
            await asyncio.wait_for(task, 60)
    assert outcomes(fake, first.prompt_id) == ["success"]
    assert source.acked == [lines[0].encode()]
    assert source.requeued == [lines[1].encode()]
    assert posted(fake, second.prompt_id) == 0
    assert store.get(first.id).state == "succeeded"
    assert "SIGTERM: second signal received; still waiting up to" in caplog.text
    assert "s for running jobs" in caplog.text


async def test_the_health_file_exists_while_the_worker_runs_and_is_removed_after(tmp_path, store):
    health = tmp_path / "alive"
    source = MemorySource("images")
    async with fake_servers(FakeComfy()) as specs:
        worker = make_worker(source, specs, store, tmp_path, health_file=health, heartbeat_s=0.05)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.consuming.wait(), 30)
        assert health.exists()
        os.utime(health, (0, 0))  # as if it were stale: the heartbeat must touch it again
        await wait_until(lambda: health.stat().st_mtime > 0, 30, "the health file renewed")
        worker.request_stop("test")
        await asyncio.wait_for(task, 30)
    assert not health.exists()


class _BrokenAck(MemoryDelivery):
    async def ack(self) -> None:
        raise OSError("ack failed")


class _BrokenSource(MemorySource):
    async def next(self):
        delivery = await super().next()
        if delivery is None:
            return None
        return _BrokenAck(self, delivery.body, delivery.message_id, 1)


async def test_a_failure_to_answer_a_message_stops_the_worker_and_is_raised(tmp_path, store):
    jobs = write_jobs(tmp_path / "jobs", 2)
    lines = jobs.read_text().splitlines()
    fake = FakeComfy(prompt_seconds=0.005)
    source = _BrokenSource("images")
    source.put(lines[0])
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, jobs.parent)
        task = asyncio.create_task(worker.run())
        with pytest.raises(OSError, match="ack failed"):
            await asyncio.wait_for(task, 30)
    assert worker.stop_reason == "error: ack failed"
    assert worker.counts["acked"] == 0


async def test_a_job_file_source_runs_each_job_once_and_a_second_pass_posts_nothing(
    tmp_path, store
):
    jobs = write_jobs(tmp_path / "jobs", 3)
    job_file = load_job_file(jobs)
    fake = FakeComfy(prompt_seconds=0.005)
    async with fake_servers(fake) as specs:
        for _ in range(2):
            source = FileSource(job_file)
            worker = make_worker(source, specs, store, tmp_path)
            await asyncio.wait_for(worker.run(), 60)
            # Two jobs per server in hand: their acks may come in either order.
            assert sorted(source.acked) == sorted(j.id for j in job_file.jobs)
    assert worker.counts["done_before"] == 3
    for job in job_file.jobs:
        assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
        assert store.get(job.id).partition == "jobs"


def test_parse_message_resolves_workflows_against_the_given_folder_or_takes_them_inline(
    workflow_dir,
):
    inline = json.loads((workflow_dir / "image.json").read_text())
    job_id = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    by_path = parse_message(
        json.dumps({"id": job_id, "workflow": "image.json"}).encode(),
        workflows_dir=workflow_dir,
        source="q",
    )
    by_value = parse_message(
        json.dumps({"id": job_id, "workflow": inline}).encode(), workflows_dir=Path("/"), source="q"
    )
    assert by_path.job.prompt_id == by_value.job.prompt_id
    with pytest.raises(JobFileError, match="workflow file not found"):
        parse_message(
            json.dumps({"id": job_id, "workflow": "image.json"}).encode(),
            workflows_dir=workflow_dir / "elsewhere",
            source="q",
        )


def test_job_messages_are_one_per_job_without_header_or_blanks_each_self_contained(tmp_path):
    jobs = write_jobs(tmp_path / "jobs", 2)
    lines = jobs.read_text().splitlines()
    jobs.write_text(
        json.dumps({"header": {"policy": "draft"}})
        + "\n\n"
        + lines[0]
        + "\n   \n"
        + lines[1]
        + "\n"
    )
    loaded = load_job_file(jobs).jobs
    messages = job_messages(jobs)
    assert [job_id for job_id, _ in messages] == [j.id for j in loaded]
    for (_, body), job in zip(messages, loaded, strict=True):
        obj = json.loads(body)
        assert obj["workflow"] == job.workflow and obj["set"] == job.set
        assert obj["policy"] == "draft"
        # Read with a folder that has no workflow at all: the message needs none.
        queued = parse_message(body, workflows_dir=tmp_path / "empty", source="q")
        assert queued.job.prompt_id == job.prompt_id and queued.policy == "draft"


def test_enqueue_rejects_an_invalid_file_whole_listing_every_error(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs", 2)
    lines = jobs.read_text().splitlines()
    jobs.write_text(
        "\n".join([lines[0], "{not json", lines[1].replace('"id": "', '"id": "X')]) + "\n"
    )
    # Port 1: nothing listens, so reaching the broker would fail with exit 1, not 2.
    args = build_parser().parse_args(
        [
            "enqueue",
            "--rabbitmq",
            "amqp://guest:guest@127.0.0.1:1/",
            "--queue",
            "q",
            "--jobs",
            str(jobs),
        ]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "2 problem(s), nothing enqueued" in err
    assert "jobs.jsonl:2: json:" in err and "jobs.jsonl:3: id:" in err


def test_the_worker_command_rejects_an_invalid_job_file_with_exit_2(tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("{not json\n")
    args = build_parser().parse_args(
        [
            "worker",
            "--jobs",
            str(jobs),
            "--server",
            "gpu0=http://127.0.0.1:1",
            "--store",
            str(tmp_path / "s"),
        ]
    )
    assert args.func(args) == 2
    assert "jobs.jsonl:1: json:" in capsys.readouterr().err


async def test_the_results_table_written_while_a_job_runs_is_written_again_when_it_ends(
    tmp_path, store
):
    jobs = write_jobs(tmp_path / "jobs", 1)
    job = load_job_file(jobs).jobs[0]
    fake = FakeComfy(prompt_seconds=0.005)
    source = MemorySource("images")
    for _, body in job_messages(jobs):
        source.put(body)
    source.end()
    table = store.root / "jobs" / "results.csv"
    async with fake_servers(fake) as specs:
        fake.pause()  # the prompt waits in the queue until the table was written
        worker = make_worker(source, specs, store, jobs.parent, results_every_s=0.01)
        running = asyncio.create_task(worker.run())
        await wait_until(table.is_file, 30, "results.csv written while the job waits")
        assert ",succeeded," not in table.read_text()
        fake.resume()
        await asyncio.wait_for(running, 60)
    assert store.get(job.id).state == "succeeded"
    assert ",succeeded," in table.read_text()
