"""A worker on another folder (another host, as far as files go) renders a job file with
input pictures enqueued elsewhere: the pictures travel in the messages, every job is
posted once, and each output is the inverse of its own picture. The machine's RabbitMQ,
the commands as a user runs them, a fake ComfyUI."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service import broker
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.process_support import stop
from tests.render.test_inputs_render import image_jobs, output_of, picture, pixels_of
from tests.service.test_worker_rabbitmq import URL, queue, ready_count  # noqa: F401 (a fixture)
from tests.support import ROOT, fake_servers, wait_until
from tests.upload_support import inverted_as_comfyui_saves

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


# The queue fixture and the ready count of the worker's RabbitMQ tests.
def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "comfy_assets.cli", *args]


def environment() -> dict[str, str]:
    """Ours, with this checkout first on the path whatever the command's folder."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


async def fake_stats(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url) as http:
        answer = await http.get("/fake/stats")
    answer.raise_for_status()
    return answer.json()


async def test_a_worker_without_the_pictures_renders_each_enqueued_job_once_from_its_own(
    tmp_path: Path,
    queue: str,  # noqa: F811 (the fixture imported above)
) -> None:
    studio = tmp_path / "studio"
    names = ["a/key.png", "b/key.png", "c.png"]  # two share a base name, not their bytes
    sources = [picture(studio / n, seed) for seed, n in enumerate(names, start=40)]
    path = image_jobs(studio, names, salt=queue)
    jobs = load_job_file(path).jobs

    enqueue = await asyncio.create_subprocess_exec(
        *command("enqueue", "--rabbitmq", URL, "--queue", queue, "--jobs", "jobs.jsonl"),
        cwd=studio,
        env=environment(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(enqueue.communicate(), 60)
    assert enqueue.returncode == 0, err.decode()
    assert out.decode() == f"enqueued 3 jobs to {queue}\n"
    shutil.rmtree(studio)  # the job file, its workflow and its pictures: gone

    host = tmp_path / "host"  # the worker's folder and its --workflows-dir: empty
    host.mkdir()
    store_dir = tmp_path / "store"
    Store(store_dir).close()
    fake = FakeComfy(prompt_seconds=0.005)
    async with fake_servers(fake) as specs:
        argv = command("worker", "--rabbitmq", URL, "--queue", queue, "--server")
        argv += [f"gpu0={specs[0].url}", "--store", str(store_dir), "--workflows-dir", "."]
        argv += ["--attempts", "1", "--poll-s", "0.05"]
        log = tmp_path / "worker.log"
        with log.open("wb") as written:  # a file, not a pipe: nobody has to read it meanwhile
            worker = await asyncio.create_subprocess_exec(
                *argv, cwd=host, env=environment(), stdout=written, stderr=written
            )
        store = Store(store_dir)
        try:

            def all_done() -> bool:
                records = [store.get(job.id) for job in jobs]
                return all(r is not None and r.state == "succeeded" for r in records)

            await wait_until(all_done, 120, "the worker to render the 3 jobs")
            worker.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(worker.wait(), 60)
        finally:
            await stop(worker)
        assert code == 0, log.read_text()
        stats = await fake_stats(specs[0].url)

    for job, source in zip(jobs, sources, strict=True):
        assert stats["prompts"][job.prompt_id]["posted"] == 1, job.id
        assert stats["prompts"][job.prompt_id]["executed"] == 1, job.id
        partition = store.get(job.id).partition
        out = pixels_of(output_of(store, partition, job.id))
        assert np.array_equal(out, inverted_as_comfyui_saves(source))
    assert len(stats["prompts"]) == 3 and stats["uploads"] == 3
    assert list(host.iterdir()) == []  # nothing written beside the worker
    assert await ready_count(queue) == 0
    assert await ready_count(broker.dead_queue_name(queue)) == 0
    store.close()
