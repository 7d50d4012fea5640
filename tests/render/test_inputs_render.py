"""Jobs that start from pictures: input files uploaded to the server each job runs on,
shots chained from earlier shots, and takes; seen from the fake's records, the files on
our disk and the results table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from comfy_assets.farm.metadata import jobs_frame
from comfy_assets.film.gate import GateBlocked
from comfy_assets.film.make import make_film
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.results import write_results
from comfy_assets.render.summary import BatchSummary
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import (
    WORKFLOWS,
    batch_over_fakes,
    executed,
    fast_config,
    job_id,
    posted,
)

STORYBOARD_SHOTS = 4


def picture(path: Path, seed: int, size: tuple[int, int] = (32, 24)) -> np.ndarray:
    """Write a PNG of random pixels at ``path``; returns its pixels (H x W x 3, uint8)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").save(path)
    return pixels


def pixels_of(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def uploads(fake: FakeComfy) -> int:
    """How many files the fake took with POST /upload/image."""
    return int(fake.stats["uploads"])


def image_jobs(folder: Path, pictures: list[str], salt: str = "img") -> Path:
    """A job file inverting each picture (paths relative to it); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOWS / "invert_picture.json", folder / "invert_picture.json")
    lines = [
        json.dumps(
            {"id": job_id(i, salt), "workflow": "invert_picture.json", "inputs": {"1.image": p}}
        )
        for i, p in enumerate(pictures)
    ]
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


async def render(path: Path, store: Store, *fakes: FakeComfy, partition: str = "p", **config):
    return await batch_over_fakes(
        load_job_file(path), store, *fakes, partition=partition, config=fast_config(**config)
    )


async def render_one_picture(
    tmp_path: Path, seed: int, fake: FakeComfy
) -> tuple[BatchSummary, Job, Store]:
    """One job inverting a picture of random pixels (``seed``) of ``tmp_path/jobs``, rendered
    over ``fake`` into a store at ``tmp_path/store``; returns the summary, the job and the
    store."""
    folder = tmp_path / "jobs"
    picture(folder / "one.png", seed)
    path = image_jobs(folder, ["one.png"])
    store = Store(tmp_path / "store")
    summary = await render(path, store, fake)
    return summary, load_job_file(path).jobs[0], store


def output_of(store: Store, partition: str, job: str, suffix: str = ".png") -> Path:
    files = [f for f in store.files(job) if str(f.path).endswith(suffix)]
    assert len(files) == 1, files
    return store.job_dir(partition, job) / str(files[0].path)


async def test_each_job_renders_its_own_picture_even_when_two_share_a_base_name(tmp_path):
    folder = tmp_path / "jobs"
    names = ["a/key.png", "b/key.png", "c.png"]
    sources = [picture(folder / n, seed) for seed, n in enumerate(names)]
    path = image_jobs(folder, names)
    store = Store(tmp_path / "store")
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    summary = await render(path, store, *fakes)
    assert summary.done == 3
    job_file = load_job_file(path)
    for job, source in zip(job_file.jobs, sources, strict=True):
        assert sum(posted(f, job.prompt_id) for f in fakes) == 1
        assert sum(executed(f, job.prompt_id) for f in fakes) == 1
        out = pixels_of(output_of(store, "p", job.id))
        # ComfyUI's ImageInvert: 1 - x in float32, saved as clip(255 x) truncated.
        expected = np.clip(255.0 * (1.0 - source.astype(np.float32) / 255.0), 0, 255)
        assert np.array_equal(out, expected.astype(np.uint8))

    again = await render(path, store, *fakes)
    assert again.done == 3
    assert sum(sum(posted(f, j.prompt_id) for f in fakes) for j in job_file.jobs) == 3

    # New bytes for one picture: only that job renders again, from its new picture.
    changed = picture(folder / "b/key.png", 99)
    third = await render(path, store, *fakes)
    assert third.done == 3
    new_file = load_job_file(path)
    moved = [j for j, old in zip(new_file.jobs, job_file.jobs, strict=True) if j != old]
    assert [j.id for j in moved] == [job_file.jobs[1].id]
    assert sum(posted(f, moved[0].prompt_id) for f in fakes) == 1
    out = pixels_of(output_of(store, "p", moved[0].id))
    expected = np.clip(255.0 * (1.0 - changed.astype(np.float32) / 255.0), 0, 255)
    assert np.array_equal(out, expected.astype(np.uint8))


async def test_the_same_picture_is_uploaded_once_per_server_not_once_per_job(tmp_path):
    folder = tmp_path / "jobs"
    picture(folder / "shared.png", 7)
    path = image_jobs(folder, ["shared.png"] * 5)
    store = Store(tmp_path / "store")
    fake = FakeComfy(prompt_seconds=0.005)
    summary = await render(path, store, fake)
    assert summary.done == 5
    assert uploads(fake) == 1


async def test_results_table_names_each_input_with_its_sha256_and_take(tmp_path):
    _, job, store = await render_one_picture(tmp_path, 1, FakeComfy(prompt_seconds=0.005))
    _, table = write_results(store, "p", [job.id])
    row = table.rows[0]
    sha = job.inputs[0].sha256
    assert row["inputs"] == f"1.image=one.png@sha256:{sha}"
    assert row["take"] == 1

    # The UI's job table fits a page: the same input with a short sha256, no full id.
    shown = jobs_frame(store.jobs("p"), [job.id])
    assert shown.iloc[0]["inputs"] == f"1.image=one.png@sha256:{sha[:12]}"
    assert shown.iloc[0]["job"] == job.id[:8]


def storyboard(folder: Path, shots: int = STORYBOARD_SHOTS, takes: dict[int, int] | None = None):
    """A storyboard whose shot 1 is a coloured clip and every later shot continues from
    the last frame of the shot before (inverted, held for 12 frames)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("video_shot.json", "continue_shot.json"):
        shutil.copy(WORKFLOWS / name, folder / name)
    lines = []
    for shot in range(1, shots + 1):
        job: dict = {"id": job_id(shot, "board"), "shot": shot, "duration_s": 0.5}
        if shot == 1:
            job |= {
                "workflow": "video_shot.json",
                "set": {"1.batch_size": 12, "1.color": 0x3366CC, "1.width": 32, "1.height": 32},
            }
        else:
            job |= {
                "workflow": "continue_shot.json",
                "inputs": {
                    "1.file": {"job": job_id(shot - 1, "board"), "node": "3" if shot == 2 else "7"}
                },
                "set": {"5.amount": 12},
            }
        if takes and shot in takes:
            job["take"] = takes[shot]
        lines.append(json.dumps(job))
    path = folder / "board.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def last_frame(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return frames[-1]


async def test_a_chained_storyboard_renders_in_order_each_shot_from_the_one_before(tmp_path):
    path = storyboard(tmp_path / "jobs")
    store = Store(tmp_path / "store")
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    summary = await render(path, store, *fakes, partition="board")
    assert summary.done == STORYBOARD_SHOTS
    jobs = load_job_file(path).jobs
    for job in jobs:
        assert sum(posted(f, job.prompt_id) for f in fakes) == 1
    # Each shot was submitted only after the shot it continues from had succeeded.
    for before, after in zip(jobs, jobs[1:], strict=False):
        done_at = [e.time for e in store.events(job_id=before.id) if e.to_state == "succeeded"]
        submitted_at = [e.time for e in store.events(job_id=after.id) if e.to_state == "submitted"]
        assert max(done_at) <= min(submitted_at)
    # Shot 2 holds the inverse of shot 1's last frame (H.264 is lossy: close, not equal).
    first = last_frame(output_of(store, "board", jobs[0].id, ".mp4")).astype(int)
    second = last_frame(output_of(store, "board", jobs[1].id, ".mp4")).astype(int)
    assert np.abs((255 - first) - second).mean() < 8
    film = make_film(store, "board", load_job_file(path), tmp_path / "film.mp4")
    assert film.concat.path.is_file() and film.concat.clips == STORYBOARD_SHOTS


async def test_a_dead_lettered_shot_leaves_the_shots_after_it_not_rendered_naming_it(tmp_path):
    path = storyboard(tmp_path / "jobs")
    store = Store(tmp_path / "store")
    # shot 1 renders; shot 2's prompt fails validation: a dead letter.
    fake = FakeComfy(script=["ok", "invalid"], prompt_seconds=0.005)
    summary = await render(path, store, fake, partition="board")
    jobs = load_job_file(path).jobs
    assert summary.done == 1
    for job in jobs[2:]:
        assert posted(fake, job.prompt_id) == 0
        rec = store.get(job.id)
        assert rec is not None and rec.state == "failed_fatal"
        assert jobs[1].id in (rec.reason or "") or jobs[2].id in (rec.reason or "")
    assert jobs[1].id in (store.get(jobs[2].id).reason or "")
    with pytest.raises(GateBlocked) as refused:
        make_film(store, "board", load_job_file(path), tmp_path / "film.mp4")
    assert not (tmp_path / "film.mp4").exists()
    said = str(refused.value)
    for job in jobs[1:]:
        assert f"shot {job.shot}" in said
    assert jobs[1].id in said  # shots 3 and 4 name the shot they waited for


async def test_a_new_take_renders_that_shot_and_its_dependants_again_and_keeps_both(tmp_path):
    folder = tmp_path / "jobs"
    path = storyboard(folder, shots=3)
    store = Store(tmp_path / "store")
    fake = FakeComfy(prompt_seconds=0.005)
    await render(path, store, fake, partition="board")
    first = load_job_file(path).jobs
    take1_files = {j.id: output_of(store, "board", j.id, ".mp4") for j in first}

    storyboard(folder, shots=3, takes={2: 2})
    summary = await render(path, store, fake, partition="board")
    assert summary.done == 3
    second = load_job_file(path).jobs
    assert second[0].prompt_id == first[0].prompt_id
    assert posted(fake, first[0].prompt_id) == 1  # shot 1 unchanged: not posted again
    for old, new in zip(first[1:], second[1:], strict=True):
        assert new.prompt_id != old.prompt_id  # shot 2's take, and shot 3 continues from it
        assert posted(fake, new.prompt_id) == 1
    # Shot 2's take 1 stays beside its take 2; shot 3 (take 1 from a new input) is replaced.
    assert take1_files[second[1].id].is_file()
    take2 = output_of(store, "board", second[1].id, ".mp4")
    assert take2.relative_to(store.job_dir("board", second[1].id)).parts[0] == "take-2"
    assert take2.name != take1_files[second[1].id].name  # a new render, not a copy
    _, table = write_results(store, "board", [j.id for j in second])
    assert [row.get("take") for row in table.rows] == [1, 2, 1]


async def test_a_picture_no_node_can_load_is_a_dead_letter_naming_the_input(tmp_path):
    folder = tmp_path / "jobs"
    folder.mkdir(parents=True)
    (folder / "notes.png").write_bytes(b"these bytes are no picture")
    path = image_jobs(folder, ["notes.png"])
    store = Store(tmp_path / "store")
    fake = FakeComfy(prompt_seconds=0.005)
    summary = await render(path, store, fake)
    job = load_job_file(path).jobs[0]
    assert summary.dead_lettered == 1
    assert posted(fake, job.prompt_id) == 1  # a permanent failure: not retried
    reason = store.get(job.id).reason or ""
    assert "execution_error in node 1 (LoadImage)" in reason
    assert "input 1.image (notes.png)" in reason


async def test_an_upload_answered_500_is_retried_and_the_job_renders_once(tmp_path, monkeypatch):
    from comfy_assets.comfy.client import ComfyClient
    from comfy_assets.comfy.errors import ServerError

    real_upload = ComfyClient.upload_input
    calls: list[str] = []

    async def flaky(self, data, filename, **kw):
        calls.append(filename)
        if len(calls) == 1:
            raise ServerError(
                "POST /upload/image: 500", status=500, body="Server got itself in trouble"
            )
        return await real_upload(self, data, filename, **kw)

    monkeypatch.setattr(ComfyClient, "upload_input", flaky)
    fake = FakeComfy(prompt_seconds=0.005)
    summary, job, store = await render_one_picture(tmp_path, 3, fake)
    assert summary.done == 1 and len(calls) == 2
    assert posted(fake, job.prompt_id) == 1
    failed = [e for e in store.events(job_id=job.id) if e.to_state == "failed_retryable"]
    assert len(failed) == 1
    assert "POST /upload/image of input 1.image (one.png) 500" in (failed[0].detail or "")


async def test_an_upload_the_server_refuses_is_a_dead_letter_with_nothing_posted(
    tmp_path, monkeypatch
):
    from comfy_assets.comfy.client import ComfyClient
    from comfy_assets.comfy.errors import InputRejected

    async def refused(self, data, filename, **kw):
        raise InputRejected("POST /upload/image: 400", status=400, detail="400 Bad Request")

    monkeypatch.setattr(ComfyClient, "upload_input", refused)
    fake = FakeComfy(prompt_seconds=0.005)
    summary, job, store = await render_one_picture(tmp_path, 4, fake)
    assert summary.dead_lettered == 1
    assert posted(fake, job.prompt_id) == 0
    assert "input 1.image (one.png)" in (store.get(job.id).reason or "")


@pytest.mark.parametrize(
    ("policy", "failed"), [("delivery", "failed_fatal"), ("draft", "degraded")]
)
async def test_requeuing_the_failed_shot_brings_back_the_shots_that_waited_for_it(
    tmp_path, policy, failed
):
    path = storyboard(tmp_path / "jobs")
    store = Store(tmp_path / "store")
    fake = FakeComfy(script=["ok", "invalid"], prompt_seconds=0.005)
    await render(path, store, fake, partition="board", policy=policy)
    jobs = load_job_file(path).jobs
    assert [store.get(j.id).state for j in jobs] == ["succeeded"] + [failed] * 3

    assert store.requeue(jobs[1].id)  # only the shot that failed; the script is used up
    summary = await render(path, store, fake, partition="board")
    assert summary.done == STORYBOARD_SHOTS
    assert posted(fake, jobs[0].prompt_id) == 1
    for job in jobs[2:]:
        assert posted(fake, job.prompt_id) == 1
    film = make_film(store, "board", load_job_file(path), tmp_path / "film.mp4")
    assert film.concat.clips == STORYBOARD_SHOTS
