"""SIGTERM at any moment of a worker's life, its start-up included, is a graceful stop:
one line, exit 0, and every job done or its message back in the queue. A --health-file
whose folder does not exist is refused before anything starts."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.service import broker
from comfy_assets.service.worker import job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.process_support import FAST, ended_cleanly, start, stop, worker_command
from tests.service.test_worker_rabbitmq import URL, queue, ready_count  # noqa: F401 (a fixture)
from tests.support import fake_servers, write_jobs


# Seconds after the start: in the imports (0.2, 1), opening the store or RabbitMQ, or
# taking jobs, depending on how busy the machine is (2, 4). Each delay is the moment
# under test, not a wait for something to happen.
@pytest.mark.rabbitmq
@pytest.mark.parametrize("delay_s", [0.2, 1.0, 2.0, 4.0])
async def test_a_worker_sigtermed_soon_after_its_start_stops_with_one_line_and_exit_0(
    delay_s: float,
    tmp_path: Path,
    queue: str,  # noqa: F811
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    await broker.enqueue(URL, queue, job_messages(jobs))
    store = tmp_path / "store"
    log = tmp_path / "worker.log"
    async with fake_servers(FakeComfy(prompt_seconds=0.1)) as servers:  # 0.4 s a job
        args = worker_command(
            URL,
            queue,
            servers,
            store,
            "--grace-s",
            "0.5",
            *FAST,
        )
        proc = await start(args, log)
        try:
            await asyncio.sleep(delay_s)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 60)
        finally:
            await stop(proc)
    text = ended_cleanly(log, code)
    assert text.count("SIGTERM: stopping") == 1, text
    # Nothing lost: each job is done, or its message is back in the queue.
    done = Store(store).counts("jobs")["succeeded"] if (store / "store.db").exists() else 0
    assert done + await ready_count(queue) == 3, text


def test_a_health_file_whose_folder_is_missing_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    health = tmp_path / "run" / "worker" / "alive"
    argv = ["worker", "--jobs", str(jobs), "--server", "gpu0=http://127.0.0.1:9"]
    argv += ["--store", str(tmp_path / "store"), "--health-file", str(health)]

    assert main(argv) == 2

    err = capsys.readouterr().err
    assert err == (
        f"error: --health-file {health}: folder {health.parent} does not exist (create it, "
        "or mount the volume the liveness probe reads there)\n"
    )
    assert not (tmp_path / "store").exists()
    assert not health.parent.exists()
