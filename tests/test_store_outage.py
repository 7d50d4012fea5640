"""A PostgreSQL store that loses its connections: a blip is lived through, an outage
stops the run cleanly (prompts removed, a clear error), never a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store, StoreUnavailable, metadata
from fake_comfy import FakeComfy
from tests.support import executed, fake_servers, fast_config, running, wait_until, write_jobs

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
        batch = asyncio.create_task(
            run_batch(jf, partition="p", servers=servers, store=pg_store, config=fast_config())
        )
        await wait_until(lambda: running(fake, jf.jobs[3].prompt_id), 20.0, "job 4 to render")
        assert await asyncio.to_thread(cut_every_connection, pg_url) > 0
        summary = await asyncio.wait_for(batch, 60.0)
    assert summary.done == 12
    assert all(executed(fake, job.prompt_id) == 1 for job in jf.jobs)


async def test_a_database_that_stays_away_stops_the_run_and_removes_its_prompts(pg_store, tmp_path):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    pg_store.retry_s = 0.5
    async with fake_servers(fake) as servers:
        batch = asyncio.create_task(
            run_batch(jf, partition="p", servers=servers, store=pg_store, config=fast_config())
        )

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
            await run_batch(
                jf,
                partition="p",
                servers=servers,
                store=store,
                config=fast_config(),
                on_line=lines.append,
            )
        await fake.wait_idle(10.0)  # the hung prompt is not left running
    store.close()
    assert [r["outcome"] for r in fake.stats["runs"]] in ([], ["interrupted"])
    assert [line for line in lines if "the store failed" in line] == [
        f"job {jf.jobs[0].id}: the store failed (the store's database is unreachable "
        "(transition failed: OSError: connection refused)); prompt interrupted and removed "
        "from gpu0"
    ]
