"""Queue messages: self-contained jobs that run anywhere, workflow paths kept inside
--workflows-dir (refused unread otherwise), and a size limit on both sides."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from comfy_assets.cli.main import build_parser
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.messages import job_message, parse_message
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.conftest import IMAGE_WORKFLOW
from tests.service.test_worker import make_worker
from tests.service.test_worker_rabbitmq import URL as AMQP_URL
from tests.service.test_worker_rabbitmq import drain, queue, ready_count  # noqa: F401 (a fixture)
from tests.support import (
    WORKFLOWS,
    executed,
    fake_servers,
    job_id,
    opened_files,
    posted,
    wait_until,
    write_jobs,
)

# -- self-contained -----------------------------------------------------------------------


def test_a_message_carries_everything_and_gives_the_prompt_id_of_its_job_line(tmp_path):
    (tmp_path / "workflows").mkdir()
    shutil.copy(WORKFLOWS / "image.json", tmp_path / "workflows" / "solid.api.json")
    lines = [
        {"header": {"policy": "draft", "duration_tolerance": 0.2}},
        {
            "id": job_id(0, "messages"),
            "workflow": "../workflows/solid.api.json",
            "set": {"1.color": 0.1 + 0.2, "3.filename_prefix": "plan ü 🎬 \u2028 \\x"},
            "shot": 0,
            "duration_s": 2,
            "optional": True,
        },
        {"id": job_id(1, "messages"), "workflow": IMAGE_WORKFLOW, "set": {"1.width": 10**18}},
    ]
    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "shots.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    job_file = load_job_file(path)
    for (message_id, body), job in zip(job_messages(path), job_file.jobs, strict=True):
        assert message_id == job.id
        assert body.isascii()
        # Read in a folder without any workflow: the message needs none.
        queued = parse_message(body, workflows_dir=tmp_path / "empty", source="q")
        assert queued.job.prompt_id == job.prompt_id
        assert queued.job.workflow == job.workflow and queued.job.set == job.set
        assert (queued.job.shot, queued.job.duration_s, queued.job.optional) == (
            job.shot,
            job.duration_s,
            job.optional,
        )
        assert queued.policy == "draft"
    assert json.loads(job_message(job_file.jobs[1]))  # no policy: none in the message
    assert "policy" not in json.loads(job_message(job_file.jobs[1]))


@pytest.mark.parametrize("depth", [65, 100_000])
def test_a_message_nested_too_deeply_is_refused_as_its_jobs_error(depth):
    deep = "[" * depth + "]" * depth
    body = f'{{"id": "X", "workflow": {deep}}}'.encode()
    with pytest.raises(JobFileError) as info:
        parse_message(body, workflows_dir=Path("."), source="q m1")
    assert str(info.value) == (
        "q m1:1: json: not usable JSON: nested more than 64 levels deep (objects and arrays)"
    )


def test_a_message_with_an_unknown_policy_is_refused_with_its_other_errors():
    body = json.dumps({"id": "X", "workflow": IMAGE_WORKFLOW, "policy": "final"}).encode()
    with pytest.raises(JobFileError) as info:
        parse_message(body, workflows_dir=Path("."), source="q m1")
    text = str(info.value)
    assert 'q m1:1: policy: expected "delivery" or "draft", got "final"' in text
    assert "q m1:1: id: not a lowercase hyphenated UUID" in text


async def test_a_header_policy_travels_with_the_message_and_the_worker_follows_it(tmp_path, store):
    jobs = write_jobs(tmp_path / "jobs", 2)
    jobs.write_text(json.dumps({"header": {"policy": "draft"}}) + "\n" + jobs.read_text())
    fake = FakeComfy(script=["error"], prompt_seconds=0.005)  # the first prompt fails for good
    source = MemorySource("draft")
    for message_id, body in job_messages(jobs):
        source.put(body, message_id)
    source.end()
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, tmp_path / "empty")
        await asyncio.wait_for(worker.run(), 60)
    states = sorted(store.get(j.id).state for j in load_job_file(jobs).jobs)
    assert states == ["degraded", "succeeded"]  # draft: a failed shot is degraded, not dead
    assert source.dead == [] and len(source.acked) == 2


# -- workflow paths stay inside --workflows-dir -------------------------------------------


async def test_workflow_paths_leading_out_of_workflows_dir_are_dead_lettered_unopened(
    tmp_path, store
):
    workflows = tmp_path / "workflows"
    workflows.mkdir()
    shutil.copy(WORKFLOWS / "image.json", workflows / "image.json")
    private = tmp_path / "private"
    private.mkdir()
    secret = private / "keys.json"
    secret.write_text(json.dumps(IMAGE_WORKFLOW))  # a valid workflow: it would render
    (workflows / "link.json").symlink_to(secret)
    (workflows / "up").symlink_to(private, target_is_directory=True)
    (workflows / "inside.json").symlink_to(workflows / "image.json")  # a link that stays in
    (workflows / "sub").mkdir()
    outside = ["../private/keys.json", str(secret), "link.json", "up/keys.json", "up/../x.json"]
    inside = ["image.json", "inside.json", "./sub/../image.json"]
    fake = FakeComfy(prompt_seconds=0.005)
    source = MemorySource("paths")
    for i, spec in enumerate([*outside, *inside]):
        source.put({"id": job_id(i, "paths"), "workflow": spec})
    source.end()

    with opened_files() as opened:
        async with fake_servers(fake) as specs:
            worker = make_worker(source, specs, store, workflows)
            await asyncio.wait_for(worker.run(), 60)

    reasons = {json.loads(body)["workflow"]: reason for body, reason in source.dead}
    assert sorted(reasons) == sorted(outside)
    for spec in outside:
        assert f"workflow: {json.dumps(spec)} is outside --workflows-dir (" in reasons[spec]
        assert "not opened" in reasons[spec]
    assert "(an absolute path)" in reasons[str(secret)]
    assert "('..' leads out of it)" in reasons["../private/keys.json"]
    assert "(a link leads out of it)" in reasons["link.json"]
    assert str(secret) not in opened  # never read, through any of the names
    assert str(workflows / "image.json") in opened  # the hook does see what is read
    assert worker.counts["invalid"] == len(outside)
    done = [job_id(i, "paths") for i in range(len(outside), len(outside) + len(inside))]
    assert [store.get(j).state for j in done] == ["succeeded"] * len(inside)
    # The three inside names are one job each of the same workflow: rendered, once each.
    assert sorted(p["posted"] for p in fake.stats["prompts"].values()) == [1, 1, 1]


# -- size limits -----------------------------------------------------------------------------


async def test_a_message_over_max_message_bytes_is_dead_lettered_unparsed_the_others_run(
    tmp_path, store
):
    jobs = write_jobs(tmp_path / "jobs", 3)
    messages = job_messages(jobs)
    limit = max(len(body) for _, body in messages) + 10
    too_big = b"{" + b" " * limit  # not even JSON: parsing it would say so
    fake = FakeComfy(prompt_seconds=0.005)
    source = MemorySource("sizes")
    source.put(messages[0][1], messages[0][0])
    source.put(too_big, "big-1")
    for message_id, body in messages[1:]:
        source.put(body, message_id)
    source.end()
    async with fake_servers(fake) as specs:
        worker = make_worker(source, specs, store, tmp_path / "empty", max_message_bytes=limit)
        await asyncio.wait_for(worker.run(), 60)
    ((body, reason),) = source.dead
    assert body == too_big
    assert reason == (
        f"invalid job: sizes message big-1:1: body: {limit + 1} bytes, over the limit of "
        f"{limit} bytes (--max-message-bytes); not parsed"
    )
    for job in load_job_file(jobs).jobs:
        assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
        assert store.get(job.id).state == "succeeded"
    assert len(source.acked) == 4


def test_enqueue_refuses_a_file_whose_message_would_be_over_the_limit(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs", 2)
    # Port 1: nothing listens, so reaching the broker would fail with exit 1, not 2.
    args = build_parser().parse_args(
        ["enqueue", "--rabbitmq", "amqp://guest:guest@127.0.0.1:1/", "--queue", "q"]
        + ["--jobs", str(jobs), "--max-message-bytes", "100"]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "2 problem(s), nothing enqueued" in err
    assert "jobs.jsonl:1: message: " in err and "jobs.jsonl:2: message: " in err
    assert "over the limit of 100 bytes (--max-message-bytes)" in err


# -- another host, another folder -----------------------------------------------------------


@pytest.mark.rabbitmq
async def test_a_file_enqueued_in_one_folder_renders_in_a_worker_started_in_another(
    tmp_path,
    queue,  # noqa: F811
):
    submit = tmp_path / "submit"
    (submit / "workflows").mkdir(parents=True)
    shutil.copy(WORKFLOWS / "image.json", submit / "workflows" / "solid.api.json")
    n = 6
    lines = [
        json.dumps(
            {
                "id": job_id(i, f"elsewhere-{queue}"),
                "workflow": "../workflows/solid.api.json",
                "set": {"1.color": 100 + i},
            }
        )
        for i in range(n)
    ]
    (submit / "jobs").mkdir()
    (submit / "jobs" / "shots.jsonl").write_text("\n".join(lines) + "\n")
    elsewhere = tmp_path / "elsewhere"  # no workflow here, and no --workflows-dir
    elsewhere.mkdir()
    cli = [sys.executable, "-m", "comfy_assets.cli"]
    env = {**os.environ, "COMFY_ASSETS_RABBITMQ_URL": AMQP_URL}  # no --rabbitmq either

    enqueue = await asyncio.create_subprocess_exec(
        *cli,
        "enqueue",
        "--queue",
        queue,
        "--jobs",
        "jobs/shots.jsonl",
        cwd=submit,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(enqueue.communicate(), 60)
    assert enqueue.returncode == 0, err.decode()
    assert out.decode() == f"enqueued {n} jobs to {queue}\n"

    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    by_run = FakeComfy(prompt_seconds=0.005)
    async with fake_servers(*fakes, by_run) as specs:
        servers = [a for s in specs[:2] for a in ("--server", f"{s.name}={s.url}")]
        with (tmp_path / "worker.log").open("wb") as log:
            worker = await asyncio.create_subprocess_exec(
                *cli,
                "worker",
                "--queue",
                queue,
                *servers,
                "--store",
                "store",
                "--attempts",
                "1",
                "--poll-s",
                "0.05",
                cwd=elsewhere,
                env=env,
                stdout=log,
                stderr=log,
            )

        def rendered() -> int:
            return sum(r["outcome"] is not None for f in fakes for r in f.stats["runs"])

        try:
            await wait_until(lambda: rendered() >= n, 60, f"{n} prompts rendered")
        finally:
            # A graceful stop lets the last downloads finish and acks them.
            worker.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(worker.wait(), 90) == 0, (
                tmp_path / "worker.log"
            ).read_text()

        # `comfy-assets run` on the same file, from its folder, on a server of its own.
        run = await asyncio.create_subprocess_exec(
            *cli,
            "run",
            "--jobs",
            "jobs/shots.jsonl",
            "--server",
            f"gpu9={specs[2].url}",
            "--store",
            "run-store",
            "--poll-s",
            "0.05",
            cwd=submit,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(run.communicate(), 120)
        assert run.returncode == 0, err.decode()

    expected = {job.prompt_id for job in load_job_file(submit / "jobs" / "shots.jsonl").jobs}
    assert len(expected) == n
    for prompt_id in expected:  # every job once, on one of the worker's servers
        assert sum(posted(f, prompt_id) for f in fakes) == 1
        assert sum(executed(f, prompt_id) for f in fakes) == 1
    worker_prompts = {p for f in fakes for p in f.stats["prompts"]}
    assert worker_prompts == expected == set(by_run.stats["prompts"])  # as `run` posts them
    store = Store(elsewhere / "store")
    try:
        assert {store.get(j).state for j in (json.loads(x)["id"] for x in lines)} == {"succeeded"}
    finally:
        store.close()
    assert await ready_count(queue) == 0
    assert await drain(f"{queue}.dead") == []
