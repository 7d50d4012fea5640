"""The move to rendering, written a moment after the POST's answer: with the done record
when the prompt ends sooner, on its own while a longer one runs, and a failure of that
write stops the attempt as a failure of any other write would."""

from __future__ import annotations

import asyncio

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import ClaimLost, Store
from fake_comfy import FakeComfy
from tests.support import (
    batch_over_fakes,
    fake_servers,
    fast_batch,
    running,
    wait_until,
    write_jobs,
)


async def test_every_job_of_quick_prompts_records_each_move_in_order(store, tmp_path):
    fake = FakeComfy(prompt_seconds=0.0)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 6))
    summary = await batch_over_fakes(jf, store, fake)
    assert summary.done == 6
    for job in jf.jobs:
        events = store.events(job.id)
        moves = [(e.from_state, e.to_state) for e in events]
        assert moves == [
            (None, "pending"),
            ("pending", "submitted"),
            ("submitted", "rendering"),
            ("rendering", "succeeded"),
        ]
        times = [e.time for e in events]
        assert times == sorted(times)
        number = next(r["number"] for r in fake.stats["runs"] if r["prompt_id"] == job.prompt_id)
        assert store.get(job.id).number == number


async def test_a_long_prompt_shows_rendering_while_it_runs(store, tmp_path):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    (job,) = jf.jobs
    async with fake_servers(fake) as servers:
        batch = asyncio.create_task(fast_batch(jf, servers, store))

        def rendering() -> bool:
            return running(fake, job.prompt_id) and store.get(job.id).state == "rendering"

        await wait_until(rendering, 20.0, "the hung prompt recorded as rendering")
        batch.cancel()
        try:
            await batch
        except asyncio.CancelledError:
            pass
        await fake.wait_idle(10.0)
    rendering_events = [e for e in store.events(job.id) if e.to_state == "rendering"]
    assert len(rendering_events) == 1


class ClaimGoneAtRendering(Store):
    """The store, the job's claim taken by another worker at its rendering write."""

    def transition(self, job_id: str, to: str, *args: object, **kwargs: object) -> None:
        if to == "rendering":
            raise ClaimLost(job_id, "w1", "other-worker")
        super().transition(job_id, to, *args, **kwargs)  # type: ignore[arg-type]


async def test_a_claim_lost_at_the_rendering_write_removes_the_prompt_and_leaves_the_job(
    tmp_path,
):
    fake = FakeComfy(script=["hang"], prompt_seconds=0.01)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 1))
    (job,) = jf.jobs
    store = ClaimGoneAtRendering(tmp_path / "store")
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        summary = await fast_batch(jf, servers, store, on_line=lines.append)
        await fake.wait_idle(10.0)  # the hung prompt is not left running
    assert [r["outcome"] for r in fake.stats["runs"]] == ["interrupted"]
    assert summary.done == 0
    (left,) = [line for line in lines if "left to its holder" in line]
    assert left.startswith(f"job {job.id}: claim lost (")
    assert "prompt interrupted and removed from gpu0" in left
    assert store.get(job.id).state == "submitted"
