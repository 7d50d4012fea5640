"""The batch's line of jobs (render/queue.py) on the event loop batches run on
(comfy/event_loop.py: uvloop where installed): jobs waiting out a delay are listed with
the loop time they are back, whatever the delay."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from comfy_assets.comfy import event_loop
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.pool.plan import Plan
from comfy_assets.render.queue import Item, JobQueue

JOB_IDS = ("6f1c2a52-8d0e-4a53-9a51-0c0f6b1d2e01", "6f1c2a52-8d0e-4a53-9a51-0c0f6b1d2e02")


def test_jobs_back_in_under_a_millisecond_or_later_are_listed_with_when(workflow_dir: Path):
    # uvloop turns a delay that rounds to 0 ms into a call "soon", whose handle has no
    # when(); a job retried after a tiny jittered backoff waits so, and a batch's
    # progress line lists the jobs waiting out a delay (Steering.look).
    path = workflow_dir / "jobs.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "workflow": "image.json"}) + "\n" for i in JOB_IDS)
    )
    soon_job, later_job = load_job_file(path).jobs

    async def look() -> tuple[float, list[tuple[str, float]], int]:
        queue = JobQueue(Plan(["gpu0"], lambda _server, _needs: True))
        start = asyncio.get_running_loop().time()
        queue.push_later(Item(soon_job), 0.0004)
        queue.push_later(Item(later_job), 30.0)
        listed = [(item.job.id, when) for item, when in queue.later()]
        waiting = queue.waiting
        queue.cancel_all()
        return start, listed, waiting

    start, listed, waiting = event_loop.run(look())
    assert waiting == 2
    assert [job_id for job_id, _ in listed] == list(JOB_IDS)
    soon_when, later_when = (when for _, when in listed)
    assert start <= soon_when <= start + 1.0
    assert start + 30.0 <= later_when <= start + 31.0
