"""A PostgreSQL store that loses its connections: a blip is lived through, an outage
stops the run cleanly (prompts removed, a clear error), never a traceback; `run` and a
worker started while the database is down wait for it, and a worker takes no message
while it is away, then goes on."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import Worker
from comfy_assets.store import Store, StoreUnavailable, metadata, schema
from comfy_assets.store import store as store_module
from fake_comfy import FakeComfy
from tests.process_support import FAST, command, ended_cleanly, start, stop, via
from tests.support import (
    executed,
    fake_servers,
    fast_batch,
    fast_config,
    running,
    wait_until,
    write_jobs,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_store(pg_url: str, tmp_path: Path) -> Store:
    store = Store(tmp_path / "store", pg_url, retry_s=10.0)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {', '.join(t.name for t in metadata.sorted_tables)}"))
    return store


def cut_every_connection(url: str) -> int:
    """Terminate every session on the store's database (a failover, say); returns how many."""
    database = sa.make_url(url).database
    admin = sa.create_engine(sa.make_url(url).set(database="postgres"))
    try:
        with admin.begin() as conn:
            return len(
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": database},
                ).all()
            )
    finally:
        admin.dispose()


async def test_a_database_blip_during_a_run_costs_nothing(pg_store, pg_url, tmp_path):
    fake = FakeComfy(prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 12))
    async with fake_servers(fake) as servers:
        batch = asyncio.create_task(fast_batch(jf, servers, pg_store))
        await wait_until(lambda: running(fake, jf.jobs[3].prompt_id), 20.0, "job 4 to render")
        assert await asyncio.to_thread(cut_every_connection, pg_url) > 0
        summary = await asyncio.wait_for(batch, 60.0)
    assert summary.done == 12
    assert all(executed(fake, job.prompt_id) == 1 for job in jf.jobs)


def test_a_pooled_connection_lost_while_the_database_stayed_up_is_replaced_without_an_outage(
    pg_store, pg_url, caplog, monkeypatch
):
    # Every pooled connection is handed out unchecked, as one in steady use is.
    monkeypatch.setattr(schema, "PING_IDLE_S", 3600.0)
    caplog.set_level(logging.INFO, logger="comfy_assets.store")
    before = pg_store.counts("p")
    assert cut_every_connection(pg_url) > 0  # the database is up; our connection is not
    assert pg_store.counts("p") == before
    said = [r.getMessage() for r in caplog.records if r.name == "comfy_assets.store"]
    assert not [line for line in said if "unreachable" in line or "reachable again" in line], said


async def test_a_pooled_connection_lost_under_a_call_on_the_event_loop_is_replaced_too(
    pg_store, pg_url, caplog, monkeypatch
):
    # The pool's lease keeper calls the store on the loop's thread, where no retry waits.
    monkeypatch.setattr(schema, "PING_IDLE_S", 3600.0)
    caplog.set_level(logging.INFO, logger="comfy_assets.store")
    assert pg_store.server_health() == {}
    assert cut_every_connection(pg_url) > 0
    assert pg_store.server_health() == {}
    said = [r.getMessage() for r in caplog.records if r.name == "comfy_assets.store"]
    assert not [line for line in said if "unreachable" in line or "reachable again" in line], said


def test_a_session_killed_while_the_store_opens_is_replaced_without_an_outage(
    pg_store, pg_url, tmp_path, caplog, monkeypatch
):
    # The connection that made the tables is handed out unchecked to the next step of
    # the opening, and its session is killed in between (a failover, an admin's cut).
    monkeypatch.setattr(schema, "PING_IDLE_S", 3600.0)
    claim = store_module.claim_database

    def killed_first(*args: object) -> None:
        assert cut_every_connection(pg_url) > 0
        monkeypatch.setattr(store_module, "claim_database", claim)
        claim(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "claim_database", killed_first)
    caplog.set_level(logging.INFO, logger="comfy_assets.store")
    opened = Store(tmp_path / "again", pg_url)
    assert opened.counts("p") == pg_store.counts("p")
    opened.close()
    said = [r.getMessage() for r in caplog.records if r.name == "comfy_assets.store"]
    assert not [line for line in said if "unreachable" in line or "reachable again" in line], said


async def test_a_database_that_stays_away_stops_the_run_and_removes_its_prompts(pg_store, tmp_path):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    pg_store.retry_s = 0.5
    async with fake_servers(fake) as servers:
        batch = asyncio.create_task(fast_batch(jf, servers, pg_store))

        # Two consumers claim two jobs: whichever posts first gets the script's `hang`.
        def hung() -> bool:
            return any(r["outcome"] is None for r in fake.stats["runs"])

        await wait_until(hung, 20.0, "the hung prompt")
        # The database goes away for good: every new connection is refused.
        pg_store.engine.dispose()
        pg_store.engine = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:9/gone")
        with pytest.raises(StoreUnavailable) as info:
            await asyncio.wait_for(batch, 60.0)
        await fake.wait_idle(10.0)
    assert "the store's database is unreachable" in str(info.value)
    assert [r["outcome"] for r in fake.stats["runs"]] == ["interrupted"]


class GoneAtRendering(Store):
    """The store, its database gone at the job's `rendering` write: right after the
    POST, before anything can record the prompt's fate."""

    def transition(self, job_id: str, to: str, *args: object, **kwargs: object) -> None:
        if to == "rendering":
            raise StoreUnavailable("transition", 0.0, OSError("connection refused"))
        super().transition(job_id, to, *args, **kwargs)  # type: ignore[arg-type]


async def test_a_store_gone_at_the_rendering_write_stops_the_run_and_removes_the_prompt(
    pg_store, pg_url, tmp_path
):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    store = GoneAtRendering(tmp_path / "store", pg_url)
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        with pytest.raises(StoreUnavailable):
            await fast_batch(jf, servers, store, on_line=lines.append)
        await fake.wait_idle(10.0)  # the hung prompt is not left running
    store.close()
    assert [r["outcome"] for r in fake.stats["runs"]] in ([], ["interrupted"])
    assert [line for line in lines if "the store failed" in line] == [
        f"job {jf.jobs[0].id}: the store failed (the store's database is unreachable "
        "(transition failed: OSError: connection refused)); prompt interrupted and removed "
        "from gpu0"
    ]


# -- an outage behind a proxy the test cuts: the server others share is never restarted --


@pytest.mark.parametrize(
    ("what", "done_line"),
    [("run", "summary: 6 done, 0 dead-lettered"), ("worker", "6 acked (6 done,")],
)
async def test_run_or_worker_started_while_the_database_is_down_waits_for_it_then_finishes(
    pg_store, pg_url, db_proxy, tmp_path, what, done_line
):
    fake = FakeComfy(prompt_seconds=0.01)
    jobs = write_jobs(tmp_path / "jobs", 6)
    log = tmp_path / f"{what}.log"
    db_proxy.cut()
    async with fake_servers(fake) as servers:
        proc = await start(
            command(
                what,
                "--jobs",
                jobs,
                "--server",
                f"gpu0={servers[0].url}",
                "--store",
                tmp_path / "store",
                "--db-url",
                via(db_proxy, pg_url),
                *FAST,
            ),
            log,
        )
        try:
            await wait_until(
                lambda: "store: the database is unreachable (opening the store" in log.read_text(),
                60,
                f"{what} to say it waits for the database",
            )
            db_proxy.restore()
            code = await asyncio.wait_for(proc.wait(), 120)
        finally:
            await stop(proc)
    text = ended_cleanly(log, code)
    assert text.count("store: the database is unreachable") == 1, text
    assert "store: the database is reachable again" in text
    assert done_line in text, text
    assert all(executed(fake, job.prompt_id) == 1 for job in load_job_file(jobs).jobs)


async def test_a_worker_takes_no_message_while_the_database_is_away_and_goes_on_when_it_is_back(
    pg_store, pg_url, db_proxy, tmp_path, caplog
):
    caplog.set_level(logging.INFO)
    fakes = [FakeComfy(prompt_seconds=0.01) for _ in range(3)]
    jobs = write_jobs(tmp_path / "jobs", 4)
    lines = jobs.read_text().splitlines()
    store = Store(tmp_path / "store", via(db_proxy, pg_url), retry_s=60.0)
    source = MemorySource("images")
    async with fake_servers(*fakes) as servers:
        worker = Worker(
            source,
            servers=servers,
            store=store,
            config=fast_config(),
            workflows_dir=jobs.parent,
            status_every_s=3600.0,  # its status rows written at its start only: not in the way
        )
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.consuming.wait(), 30)
        db_proxy.cut()  # between messages: the worker is idle, its next store call fails
        source.put(lines[0])
        await wait_until(lambda: store.outage.away, 30, "the worker to meet the outage")
        for line in lines[1:]:
            source.put(line)
        # Three servers, so room for three messages; while the database stays away
        # (a second here) the worker takes none of them.
        await asyncio.sleep(1.0)
        assert len(worker._handlers) == 1
        assert all(fake.stats["prompts"] == {} for fake in fakes)
        db_proxy.restore()
        await wait_until(lambda: worker.counts["acked"] == 4, 60, "every message to be acked")
        assert not task.done()  # it went on
        worker.request_stop("test over")
        await asyncio.wait_for(task, 30)
    store.close()
    for job in load_job_file(jobs).jobs:
        assert sum(executed(fake, job.prompt_id) for fake in fakes) == 1, job.id
    assert source.requeued == []
    outage_lines = [
        r.getMessage() for r in caplog.records if "database is unreachable" in r.message
    ]
    assert len(outage_lines) == 1, outage_lines
    assert outage_lines[0].endswith("the worker takes no new message until it is back")


async def test_a_worker_whose_database_stays_away_past_its_budget_stops_and_requeues_its_message(
    pg_store, pg_url, db_proxy, tmp_path
):
    fake = FakeComfy(prompt_seconds=0.01)
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = Store(tmp_path / "store", via(db_proxy, pg_url), retry_s=1.0)
    source = MemorySource("images")
    async with fake_servers(fake) as servers:
        worker = Worker(
            source, servers=servers, store=store, config=fast_config(), workflows_dir=jobs.parent
        )
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.consuming.wait(), 30)
        db_proxy.cut()  # and never restored
        for line in jobs.read_text().splitlines():
            source.put(line)
        with pytest.raises(StoreUnavailable, match="the store's database is unreachable"):
            await asyncio.wait_for(task, 60)
    store.close()
    assert fake.stats["prompts"] == {}
    assert source.acked == []
    # One server: the messages it held, two at most; none when the outage was seen (by
    # its status rows' write, say) before it took the first.
    assert len(source.requeued) <= 2 and source.dead == []
    assert worker.stop_reason.startswith("error: the store's database is unreachable (")
