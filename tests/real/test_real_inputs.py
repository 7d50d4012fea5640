"""Jobs that start from pictures on a real ComfyUI v0.8.0 (only when ``COMFYUI_URL`` is
set): input pictures uploaded and inverted, each job once, again only for the picture
that changed; a storyboard whose shots continue from the shot before, and its film.

Every run makes its own pictures (random pixels), colours, file name prefixes and job
ids, so neither ComfyUI's cache nor an earlier run's history or files answer for it. The
runs leave their small files in the server's input and output folders.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.film.make import make_film
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from tests.render.test_inputs_render import last_frame, output_of, picture, pixels_of
from tests.support import WORKFLOWS, fast_batch, fast_config
from tests.upload_support import inverted_as_comfyui_saves

pytestmark = [pytest.mark.real_comfyui, pytest.mark.timeout(600)]

URL = os.environ.get("COMFYUI_URL", "")
SHOTS = 4
FRAMES = 12


@pytest.fixture
def real_url() -> str:
    if not URL:
        pytest.skip("COMFYUI_URL is not set")
    return URL


async def render(path: Path, store: Store, url: str, partition: str) -> Any:
    lines: list[str] = []
    summary = await fast_batch(
        load_job_file(path),
        [ServerSpec("real", url)],
        store,
        partition=partition,
        config=fast_config(poll_s=0.2, timeout_s=240.0),
        on_line=lines.append,
    )
    return summary, lines


def submitted(store: Store, partition: str) -> dict[str, int]:
    """Job id → how many ``submitted`` events our store has for it."""
    counts: dict[str, int] = {}
    for event in store.events(partition=partition):
        if event.to_state == "submitted":
            counts[event.job_id] = counts.get(event.job_id, 0) + 1
    return counts


async def history(url: str, jobs: list[Job]) -> dict[str, Any]:
    """The server's /history entries of the jobs' prompt_ids (an entry holds the prompt's
    queue number and the times of its messages: a prompt posted again changes it)."""
    entries: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for job in jobs:
            answer = await http.get(f"/history/{job.prompt_id}")
            answer.raise_for_status()
            entries.update(answer.json())
    return entries


def picture_jobs(folder: Path, names: list[str], token: str) -> Path:
    """A job file inverting each picture of ``names`` (relative to it) under a SaveImage
    prefix of this run; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOWS / "invert_picture.json", folder / "invert_picture.json")
    lines = [
        json.dumps(
            {
                "id": str(uuid.uuid4()),
                "workflow": "invert_picture.json",
                "inputs": {"1.image": name},
                "set": {"3.filename_prefix": f"ca_inputs_{token}"},
            }
        )
        for name in names
    ]
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_each_job_inverts_its_own_picture_once_and_a_changed_one_alone_again(
    real_url: str, tmp_path: Path
) -> None:
    token = uuid.uuid4().hex[:8]
    seeds = random.Random(token)
    folder = tmp_path / "jobs"
    names = ["a/key.png", "b/key.png", "c.png"]  # two share a base name, not their bytes
    sources = [picture(folder / n, seeds.randrange(1 << 32), (32, 32)) for n in names]
    assert not np.array_equal(sources[0], sources[1])
    path = picture_jobs(folder, names, token)
    store = Store(tmp_path / "store")

    summary, lines = await render(path, store, real_url, "p")
    assert summary.done == 3, lines
    jobs = load_job_file(path).jobs
    assert len({j.inputs[0].upload_name for j in jobs}) == 3
    assert submitted(store, "p") == {j.id: 1 for j in jobs}
    first_history = await history(real_url, jobs)
    assert sorted(first_history) == sorted(j.prompt_id for j in jobs)
    for job, source in zip(jobs, sources, strict=True):
        assert np.array_equal(
            pixels_of(output_of(store, "p", job.id)), inverted_as_comfyui_saves(source)
        )

    again, lines = await render(path, store, real_url, "p")
    assert again.done == 3, lines
    assert submitted(store, "p") == {j.id: 1 for j in jobs}  # nothing posted
    assert await history(real_url, jobs) == first_history

    # New bytes for one of the two key.png: that job alone renders again, from them.
    changed = picture(folder / "b/key.png", seeds.randrange(1 << 32), (32, 32))
    third, lines = await render(path, store, real_url, "p")
    assert third.done == 3, lines
    new_jobs = load_job_file(path).jobs
    moved = [new for new, old in zip(new_jobs, jobs, strict=True) if new != old]
    assert [j.id for j in moved] == [jobs[1].id]
    assert moved[0].prompt_id != jobs[1].prompt_id
    assert submitted(store, "p") == {jobs[0].id: 1, jobs[1].id: 2, jobs[2].id: 1}
    after = await history(real_url, [*jobs, moved[0]])
    assert {k: v for k, v in after.items() if k != moved[0].prompt_id} == first_history
    assert moved[0].prompt_id in after
    assert np.array_equal(
        pixels_of(output_of(store, "p", moved[0].id)), inverted_as_comfyui_saves(changed)
    )
    for job, source in ((jobs[0], sources[0]), (jobs[2], sources[2])):
        assert np.array_equal(
            pixels_of(output_of(store, "p", job.id)), inverted_as_comfyui_saves(source)
        )


def storyboard(folder: Path, token: str) -> Path:
    """``SHOTS`` shots of ``FRAMES`` frames at 32x32 (libx264 wants an even size): shot 1
    a clip of a colour of this run, each later shot the inverse of the last frame of the
    shot before, held (data/workflows/continue_shot.json); returns the job file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("video_shot.json", "continue_shot.json"):
        shutil.copy(WORKFLOWS / name, folder / name)
    ids = [str(uuid.uuid4()) for _ in range(SHOTS)]
    prefix = f"video/ca_board_{token}"
    lines = []
    for shot, job_id in enumerate(ids, start=1):
        job: dict[str, Any] = {"id": job_id, "shot": shot, "duration_s": FRAMES / 24}
        if shot == 1:
            size = {"1.width": 32, "1.height": 32, "1.batch_size": FRAMES}
            # Each channel far from grey, so that a frame and its inverse differ.
            rng = random.Random(token)
            channels = [rng.choice([rng.randrange(48), 255 - rng.randrange(48)]) for _ in "rgb"]
            colour = channels[0] << 16 | channels[1] << 8 | channels[2]
            job |= {
                "workflow": "video_shot.json",
                "set": {**size, "1.color": colour, "3.filename_prefix": prefix},
            }
        else:
            node = "3" if shot == 2 else "7"
            job |= {
                "workflow": "continue_shot.json",
                "inputs": {"1.file": {"job": ids[shot - 2], "node": node}},
                "set": {"5.amount": FRAMES, "7.filename_prefix": prefix},
            }
        lines.append(json.dumps(job))
    path = folder / "board.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


async def test_a_chained_storyboard_renders_in_order_each_shot_from_the_one_before(
    real_url: str, tmp_path: Path
) -> None:
    path = storyboard(tmp_path / "jobs", uuid.uuid4().hex[:8])
    store = Store(tmp_path / "store")
    summary, lines = await render(path, store, real_url, "board")
    assert summary.done == SHOTS, lines
    jobs = load_job_file(path).jobs
    assert submitted(store, "board") == {j.id: 1 for j in jobs}
    assert sorted(await history(real_url, jobs)) == sorted(j.prompt_id for j in jobs)
    for before, after in zip(jobs, jobs[1:], strict=False):
        # Submitted only once the shot it continues from had succeeded...
        done_at = [e.time for e in store.events(job_id=before.id) if e.to_state == "succeeded"]
        submitted_at = [e.time for e in store.events(job_id=after.id) if e.to_state == "submitted"]
        assert max(done_at) <= min(submitted_at)
        # ... and from that shot's video: the inverse of its last frame (H.264 is lossy).
        previous = last_frame(output_of(store, "board", before.id, ".mp4")).astype(int)
        this = last_frame(output_of(store, "board", after.id, ".mp4")).astype(int)
        assert np.abs((255 - previous) - this).mean() < 8
        assert np.abs(previous - this).mean() > 32  # not a copy of the shot before
    film = make_film(store, "board", load_job_file(path), tmp_path / "film.mp4")
    assert film.concat.path.is_file() and film.concat.clips == SHOTS
