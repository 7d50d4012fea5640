"""A dead letter requeued and rendered on other servers than the one it failed on: its
only attempt ended there (the server ran it to an error), so nothing can render twice and
no line says it may."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import (
    batch_over_fakes,
    executed,
    fake_servers,
    fast_batch,
    write_jobs,
)


async def test_a_requeued_dead_letter_renders_elsewhere_without_a_false_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job_file = load_job_file(write_jobs(tmp_path / "jobs", 1))
    [job] = job_file.jobs
    store = Store(tmp_path / "store")
    failing = FakeComfy(script=["error"])
    first = await batch_over_fakes(job_file, store, failing)
    assert [job_id for job_id, _ in first.dead_letters] == [job.id]
    assert store.requeue(job.id)

    other = FakeComfy()
    lines: list[str] = []
    caplog.set_level(logging.INFO)
    async with fake_servers(other) as served:
        # gpu0, where the dead letter was, is not a server of this pool.
        servers = [ServerSpec("gpu1", served[0].url)]
        second = await fast_batch(job_file, servers, store, on_line=lines.append)

    assert second.dead_letters == []
    assert executed(other, job.prompt_id) == 1
    said = lines + [record.getMessage() for record in caplog.records]
    events = [event.detail or "" for event in store.events(job_id=job.id)]
    assert not [line for line in said + events if "may render twice" in line], said + events
