"""A fleet of three workers on RabbitMQ and PostgreSQL lives through database outages of
5 s, one between messages and one under load: every job renders once, no worker exits.

The outage is a TCP proxy in front of the database that the test cuts (connections
reset, new ones refused) and restores: the machine's PostgreSQL, shared with others, is
never restarted, and the outage starts and ends when the test says.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service import broker
from comfy_assets.service.worker import job_messages
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.process_support import FAST, start, stop, via, worker_command
from tests.service.test_store_outage import pg_store  # noqa: F401 (a fixture)
from tests.service.test_worker_rabbitmq import URL, queue, ready_count  # noqa: F401 (a fixture)
from tests.support import executed, fake_servers, outcomes, wait_until, write_jobs

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

OUTAGE_S = 5.0


async def succeeded(store: Store, partition: str) -> int:
    """Jobs of ``partition`` done in the store (read on a thread: the fakes share our loop)."""
    counts = await asyncio.to_thread(store.counts, partition)
    return counts.get("succeeded", 0)


@pytest.mark.timeout(300)
async def test_three_workers_ride_out_a_database_restart_between_messages_and_under_load(
    tmp_path: Path,
    queue: str,  # noqa: F811
    pg_url: str,
    pg_store: Store,  # noqa: F811
    db_proxy,
) -> None:
    fakes = [FakeComfy(prompt_seconds=0.02) for _ in range(3)]
    files = {
        name: write_jobs(tmp_path / "jobs", count, name=f"{name}.jsonl")
        for name, count in (("idle", 12), ("blip", 12), ("load", 30))
    }
    check = Store(tmp_path / "check", pg_url)  # straight to the database, not the proxy
    logs = [tmp_path / f"worker{i}.log" for i in range(3)]
    async with fake_servers(*fakes) as servers:
        args = worker_command(
            URL,
            queue,
            servers,
            tmp_path / "store",
            "--db-url",
            via(db_proxy, pg_url),
            "--lease-s",
            "60",
            *FAST,
        )
        procs = [await start(args, log) for log in logs]
        try:
            for log in logs:
                await wait_until(lambda log=log: "taking jobs of" in log.read_text(), 60, "start")

            await broker.enqueue(URL, queue, job_messages(files["idle"]))
            await wait_until_done(check, "idle", 12)

            # Between messages: the workers are idle when the database goes.
            db_proxy.cut()
            cut_at = asyncio.get_running_loop().time()
            await broker.enqueue(URL, queue, job_messages(files["blip"]))
            await wait_until(
                lambda: any(
                    "store: the database is unreachable" in log.read_text() for log in logs
                ),
                30,
                "a worker to meet the outage",
            )
            await asyncio.sleep(max(0.0, cut_at + OUTAGE_S - asyncio.get_running_loop().time()))
            db_proxy.restore()
            await wait_until_done(check, "blip", 12)

            # Under load: prompts running, downloads and done records under way.
            await broker.enqueue(URL, queue, job_messages(files["load"]))
            await wait_until(
                lambda: sum(len(f.stats["runs"]) for f in fakes) >= 24 + 6, 60, "some load"
            )
            db_proxy.cut()
            await asyncio.sleep(OUTAGE_S)
            db_proxy.restore()
            await wait_until_done(check, "load", 30)

            assert [p.returncode for p in procs] == [None, None, None], texts(logs)
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            codes = [await asyncio.wait_for(p.wait(), 60) for p in procs]
        finally:
            for proc in procs:
                await stop(proc)
    check.close()
    text = texts(logs)
    assert codes == [0, 0, 0], text
    assert "Traceback" not in text
    for log in logs:
        # Said once per outage at most (a worker that made no store call during one
        # never met it), not once per call or per message.
        assert log.read_text().count("store: the database is unreachable") <= 2, log.read_text()
    assert "store: the database is reachable again" in text
    for path in files.values():
        for job in load_job_file(path).jobs:
            runs = [o for f in fakes for o in outcomes(f, job.prompt_id)]
            assert runs == ["success"], (job.id, runs)
            assert sum(executed(f, job.prompt_id) for f in fakes) == 1, job.id
    assert await ready_count(queue) == 0


async def wait_until_done(store: Store, partition: str, count: int) -> None:
    deadline = asyncio.get_running_loop().time() + 120
    while (done := await succeeded(store, partition)) < count:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{partition}: {done} of {count} jobs done after 120 s")
        await asyncio.sleep(0.05)


def texts(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs)
