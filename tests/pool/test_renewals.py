"""Leases and claims that can't be renewed stop the attempt loudly; a pool with no server
reachable gives up after --unreachable-timeout-s."""

from __future__ import annotations

import asyncio
import logging
import time

import sqlalchemy as sa

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.run import run_batch
from comfy_assets.store import Store
from comfy_assets.store.schema import jobs_table, server_leases_table
from fake_comfy import FakeComfy
from tests.support import (
    fake_servers,
    fast_batch,
    fast_config,
    one_job,
    outcomes,
    running,
    wait_until,
    write_jobs,
)

WAIT_S = 20.0


def held_elsewhere(
    store: Store, table: sa.Table, row: sa.ColumnElement, holder: str, owner: str, expiry: str
) -> None:
    """``owner`` written into the ``holder`` column of ``table``'s ``row`` and an hour from now
    into its ``expiry`` column: a row another process holds now."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(table).where(row).values({holder: owner, expiry: time.time() + 3600})
        )


def take_server(store: Store, server: str, owner: str) -> None:
    """Another process takes ``server``'s lease (as after our lease lapsed)."""
    row = server_leases_table.c.server == server
    held_elsewhere(store, server_leases_table, row, "owner", owner, "expires_at")


def take_claim(store: Store, job_id: str, owner: str) -> None:
    """Another worker takes the job's claim (as after our claim lapsed)."""
    row = jobs_table.c.job_id == job_id
    held_elsewhere(store, jobs_table, row, "claimed_by", owner, "claim_expires_at")


async def render_while(tmp_path, fakes, config, during) -> tuple:
    """Run one job on ``fakes`` (the first hangs it), calling ``during(store, job)`` once
    the prompt runs on the first; returns (summary, store, job, lines)."""
    jf, job, store = one_job(tmp_path)
    lines: list[str] = []
    async with fake_servers(*fakes) as servers:
        batch = asyncio.create_task(
            run_batch(
                jf, partition="p", servers=servers, store=store, config=config, on_line=lines.append
            )
        )

        def rendering() -> bool:
            record = store.get(job.id)
            return running(fakes[0], job.prompt_id) and record.state == "rendering"

        await wait_until(rendering, WAIT_S, "the hung prompt, recorded as rendering")
        during(store, job)
        summary = await asyncio.wait_for(batch, WAIT_S)
        await fakes[0].wait_idle(WAIT_S)
    return summary, store, job, lines


async def test_a_server_lease_taken_by_another_process_interrupts_our_prompt_there(
    tmp_path, caplog
):
    hung, other = FakeComfy(script=["hang"]), FakeComfy()
    config = fast_config(server_lease_s=0.3, timeout_s=60.0)
    with caplog.at_level(logging.ERROR, logger="comfy_assets.pool"):
        summary, store, job, lines = await render_while(
            tmp_path, [hung, other], config, lambda s, j: take_server(s, "gpu0", "elsewhere")
        )
    # Our prompt was interrupted on gpu0 at once, not left to run under another's lease.
    assert outcomes(hung, job.prompt_id) == ["interrupted"]
    assert outcomes(other, job.prompt_id) == ["success"]
    assert summary.done == 1
    retried = [e for e in store.events(job.id) if e.to_state == "failed_retryable"]
    assert len(retried) == 1
    assert "server lease lost (gpu0: server lease taken by another process)" in retried[0].detail
    assert "interrupted and removed from gpu0" in retried[0].detail
    assert any(
        "server gpu0: server lease taken by another process" in r.message for r in caplog.records
    )
    assert store.server_leases()["gpu0"].owner == "elsewhere"  # not released by us


async def test_a_server_lease_the_store_cannot_renew_is_given_up_before_it_lapses(
    tmp_path, monkeypatch, caplog
):
    hung, other = FakeComfy(script=["hang"]), FakeComfy()
    config = fast_config(server_lease_s=0.6, timeout_s=60.0)

    def fail_renewals(store: Store, job) -> None:
        def renew_server(*args: object, **kwargs: object) -> bool:
            raise sa.exc.OperationalError("UPDATE comfy_server_leases", {}, Exception("down"))

        monkeypatch.setattr(store, "renew_server", renew_server)

    with caplog.at_level(logging.WARNING, logger="comfy_assets.pool"):
        summary, store, job, lines = await render_while(
            tmp_path, [hung, other], config, fail_renewals
        )
    assert outcomes(hung, job.prompt_id) == ["interrupted"]
    assert outcomes(other, job.prompt_id) == ["success"]
    (retried,) = [e for e in store.events(job.id) if e.to_state == "failed_retryable"]
    assert "server lease not renewed (OperationalError" in retried.detail
    messages = [r.message for r in caplog.records]
    assert any("server lease not renewed" in m and "trying again" in m for m in messages)


async def test_a_claim_taken_by_another_worker_stops_our_attempt_and_leaves_the_job(
    tmp_path, caplog
):
    hung = FakeComfy(script=["hang"])
    config = fast_config(lease_s=0.3, timeout_s=60.0)
    with caplog.at_level(logging.ERROR, logger="comfy_assets.render.batch"):
        summary, store, job, lines = await render_while(
            tmp_path, [hung], config, lambda s, j: take_claim(s, j.id, "other-worker")
        )
    assert outcomes(hung, job.prompt_id) == ["interrupted"]
    assert summary.done == 0
    record = store.get(job.id)
    assert (record.state, record.claimed_by) == ("rendering", "other-worker")  # theirs now
    (note,) = [e for e in store.events(job.id) if e.from_state == e.to_state == "rendering"]
    assert note.detail.startswith("claim taken by another worker during attempt 1")
    assert "interrupted and removed from gpu0" in note.detail
    assert any(f"job {job.id}: claim taken by another worker" in r.message for r in caplog.records)
    assert any("left to its holder" in line for line in lines)


async def test_with_no_server_reachable_for_the_timeout_the_batch_stops_and_jobs_stay_pending(
    tmp_path,
):
    jf = load_job_file(write_jobs(tmp_path / "jobs", 3))
    store = Store(tmp_path / "store")
    lines: list[str] = []
    dead = [ServerSpec("gpu0", "http://127.0.0.1:9"), ServerSpec("gpu1", "http://127.0.0.1:9")]
    summary = await asyncio.wait_for(
        fast_batch(
            jf, dead, store, config=fast_config(unreachable_timeout_s=0.3), on_line=lines.append
        ),
        WAIT_S,
    )
    assert summary.no_server
    assert summary.stopped.startswith("stopped: no server reachable for ")
    assert "gpu0 unreachable: " in summary.stopped and "gpu1 unreachable: " in summary.stopped
    assert [(j.state, j.claimed_by, j.attempts) for j in store.jobs("p")] == [
        ("pending", None, 0)
    ] * 3
    assert summary.stopped in lines
