"""The readers that need no disk, against a real SeaweedFS (``s3_store``): the API's 307 to
a presigned URL that a client follows for the bytes and a range, results.csv stored as
an object, a film cut from shots read out of the bucket and stored there, and ``sync``
copying a partition's objects to a folder, then only what changed."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from comfy_assets.api.submission import parse_submission
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.film.make import store_film
from comfy_assets.film.probe import probe
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.results import write_results
from comfy_assets.render.run import run_batch_sync
from comfy_assets.store import OutputFile, Store
from comfy_assets.store.api_jobs import ApiJob, ApiLedger
from comfy_assets.store.files import S3FileStore
from comfy_assets.store.files.local import file_copy
from comfy_assets.store.files.sync import sync_outputs
from fake_comfy import FakeComfy
from tests.api_support import api_client, auth, fresh_queue, job_body, make_api
from tests.support import fast_config, write_jobs

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[3]


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _render(job_file_path: Path, store: Store, partition: str) -> None:
    fake = FakeComfy(prompt_seconds=0.005)
    with fake.serve_in_thread(port=0) as url:
        run_batch_sync(
            load_job_file(job_file_path),
            partition=partition,
            servers=[ServerSpec("gpu0", url)],
            store=store,
            config=fast_config(),
        )


async def _into_bucket(store: Store, objects: S3FileStore, partition: str) -> int:
    """Every output the batch wrote to the store's folder, stored in ``objects`` too;
    then the store reads its files from the bucket. Returns how many."""
    n = 0
    for job_id, files in store.partition_files(partition).items():
        for f in files:
            data = (store.root / partition / job_id / f.path).read_bytes()
            stored = await objects.write_output(partition, job_id, f.path, _once(data))
            assert stored.sha256 == f.sha256
            n += 1
    shutil.rmtree(store.root / partition)  # nothing left to read on this disk
    store.file_store = objects  # type: ignore[attr-defined]
    return n


@pytest.mark.rabbitmq
async def test_the_api_redirects_to_a_presigned_url_that_serves_the_bytes(
    store: Store, s3_store: S3FileStore
) -> None:
    import aiohttp

    data = bytes(range(256)) * 64
    sha = hashlib.sha256(data).hexdigest()
    sub = parse_submission(
        job_body(), partition="api-alice", max_input_bytes=10, max_message_bytes=10**6
    )
    job_id = sub.job.id
    ApiLedger(store).take(
        ApiJob(job_id, "alice", sub.content, sub.message, None, store.now()), "api-alice", sub.job
    )
    await s3_store.write_output("api-alice", job_id, "a_00001_.png", _once(data))
    assert store.claim(job_id, "test-owner") == "claimed"
    store.mark_done(job_id, "test-owner", files=[OutputFile("a_00001_.png", sha, len(data))])
    store.file_store = s3_store  # type: ignore[attr-defined]
    async with fresh_queue() as queue:
        client = await api_client(make_api(store, queue))
        async with client:
            view = await (await client.get(f"/v1/jobs/{job_id}", headers=auth())).json()
            [entry] = view["files"]
            assert entry["url"].startswith("http://127.0.0.1:")
            assert "X-Amz-Signature=" in entry["url"] and "X-Amz-Expires=3600" in entry["url"]
            link = f"/v1/jobs/{job_id}/files/a_00001_.png"
            moved = await client.get(link, headers=auth(), allow_redirects=False)
            assert moved.status == 307 and "X-Amz-Signature=" in moved.headers["Location"]
            followed = await client.get(link, headers=auth())
            assert followed.status == 200 and await followed.read() == data
            part = await client.get(link, headers={**auth(), "Range": "bytes=100-199"})
            assert part.status == 206 and await part.read() == data[100:200]
        async with aiohttp.ClientSession() as plain, plain.get(entry["url"]) as got:
            assert got.status == 200 and await got.read() == data  # no token needed


async def test_results_and_a_film_are_objects_cut_from_objects(
    tmp_path: Path, s3_store: S3FileStore
) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "workflows").mkdir()
    shutil.copy(REPO / "data/workflows/video_shot.json", tmp_path / "workflows")
    shutil.copy(REPO / "data/jobs/storyboard.jsonl", tmp_path / "jobs")
    path = tmp_path / "jobs" / "storyboard.jsonl"
    with Store(tmp_path / "store") as store:
        _render(path, store, "board")
        assert await _into_bucket(store, s3_store, "board") == 6

        where, table = write_results(store, "board")
        film = store_film(store, "board", load_job_file(path))

    assert where == f"{s3_store.where}/files/board/results.csv"
    assert len(table) == 6
    csv_text = s3_store.open_file("board/results.csv").read().decode()
    assert csv_text.count("\n") == 7 and "succeeded" in csv_text
    assert not (tmp_path / "store" / "board").exists()  # nothing written on this disk
    assert film.film_key == "board/film.mp4"
    local = file_copy(s3_store, "board/film.mp4", tmp_path / "check")
    assert probe(local).duration_s == pytest.approx(7.75, abs=1 / 24)
    sheet = file_copy(s3_store, "board/film.contact.png", tmp_path / "check")
    assert probe(sheet).kind == "image"


async def test_sync_copies_a_partitions_objects_then_only_what_changed(
    tmp_path: Path, s3_store: S3FileStore
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    desk = tmp_path / "desk"
    with Store(tmp_path / "store") as store:
        _render(jobs, store, "jobs")
        wanted = {
            f"{job_id}/{f.path}": (store.root / "jobs" / job_id / f.path).read_bytes()
            for job_id, files in store.partition_files("jobs").items()
            for f in files
        }
        n = await _into_bucket(store, s3_store, "jobs")
        outputs = [(j, f) for j, fs in store.partition_files("jobs").items() for f in fs]

    first = sync_outputs(s3_store, "jobs", outputs, desk)
    assert (first.new, first.changed, first.unchanged, first.failed) == (n, 0, 0, [])
    got = {p.relative_to(desk).as_posix(): p.read_bytes() for p in desk.rglob("*") if p.is_file()}
    assert got == wanted
    edited = sorted(wanted)[0]
    (desk / edited).write_bytes(b"z" * len(wanted[edited]))
    again = sync_outputs(s3_store, "jobs", outputs, desk)
    assert (again.new, again.changed, again.unchanged) == (0, 1, n - 1)
    assert again.copied_bytes == len(wanted[edited])
    assert (desk / edited).read_bytes() == wanted[edited]
