"""The batch writes through the store's ``FileStore``: a done record only once the file
store confirms every output, the files table as the job's manifest, and ``s3://`` inputs
read through the file store; seen from the fake's records, the store and the files."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.store import Store
from comfy_assets.store.files import (
    FileStoreUnavailable,
    FolderFileStore,
    S3FileStore,
    StoredFile,
)
from fake_comfy import FakeComfy
from tests.render.test_inputs_render import picture, pixels_of
from tests.support import (
    WORKFLOWS,
    batch_over_fakes,
    executed,
    fast_config,
    job_id,
    one_job,
    posted,
)


class LosingFileStore(FolderFileStore):
    """A folder store that loses the first output it writes, ``times`` times over: the
    file is gone by the time the batch asks ``confirm_outputs``."""

    def __init__(self, root: Path, times: int) -> None:
        super().__init__(root)
        self.left = times
        self.lost: list[str] = []

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        stored = await super().write_output(partition, job_id, path, chunks)
        if self.left:
            self.left -= 1
            (self.job_dir(partition, job_id) / path).unlink()
            self.lost.append(path)
        return stored


async def render_losing(tmp_path: Path, times: int, lines: list[str], **config: object):
    """One job rendered (2 attempts allowed) on a fake into a store whose files lose an
    output ``times`` times; returns (fake, job, its files, the store, the summary)."""
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, _ = one_job(tmp_path)
    files = LosingFileStore(tmp_path / "store", times=times)
    store = Store(tmp_path / "store", file_store=files)
    settings = fast_config(attempts=2, **config)
    summary = await batch_over_fakes(jf, store, fake, config=settings, on_line=lines.append)
    return fake, job, files, store, summary


async def test_a_lost_output_writes_no_done_record_and_the_job_is_caught_up_not_posted_again(
    tmp_path,
):
    lines: list[str] = []
    fake, job, files, store, summary = await render_losing(tmp_path, 1, lines)

    assert (summary.done, summary.dead_lettered) == (1, 0)
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    first, second = store.attempts(job.id)
    assert (first.outcome, second.outcome) == ("transient", "success")
    assert first.reason is not None
    store_path = tmp_path / "store"
    assert f"outputs not confirmed in the store {store_path}: missing: {files.lost[0]}" in (
        first.reason
    )
    assert "the store's failure, not the job's" in first.reason
    assert any("caught up, nothing posted" in line for line in lines)
    for f in store.files(job.id):
        data = (store.job_dir("p", job.id) / f.path).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (f.sha256, f.bytes)
    # The done record came only after the store confirmed: one succeeded event, last.
    states = [e.to_state for e in store.events(job_id=job.id)]
    assert states.count("succeeded") == 1 and states[-1] == "succeeded"


async def test_lost_outputs_are_waited_out_past_the_jobs_own_attempts(tmp_path):
    lines: list[str] = []
    fake, job, files, store, summary = await render_losing(tmp_path, 5, lines)

    assert (summary.done, summary.dead_lettered) == (1, 0)
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    outcomes = [a.outcome for a in store.attempts(job.id)]
    assert len(files.lost) == 5
    # More attempts than the 2 allowed: the store's failures are not the job's.
    assert len(outcomes) > 2 and outcomes == ["transient"] * (len(outcomes) - 1) + ["success"]


async def test_files_failing_past_their_wait_stop_the_batch_the_job_pending_not_dead(
    tmp_path,
):
    lines: list[str] = []
    with pytest.raises(FileStoreUnavailable) as stopped:
        await render_losing(tmp_path, 100, lines, files_wait_s=0.0)

    assert str(stopped.value).startswith(
        f"the store's files {tmp_path / 'store'} failed to store outputs for 0 s "
        "(files_wait_s 0); last: outputs not confirmed in the store"
    )
    store = Store.existing(tmp_path / "store")
    (rec,) = store.jobs("p")
    assert rec.state == "failed_retryable"
    assert store.files(rec.job_id) == []
    reasons = [a.reason or "" for a in store.attempts(rec.job_id)]
    assert len(reasons) == 1
    assert "the store's failure, not the job's" in reasons[0]
    assert any(line.endswith("it stays pending") for line in lines)


class AwayFileStore(FolderFileStore):
    """A folder store that does not answer for its first write (an object store down
    past its retries)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.refused = 0

    async def write_output(
        self, partition: str, job_id: str, path: str, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        if not self.refused:
            self.refused += 1
            raise FileStoreUnavailable(f"{self.root}: no answer for 60 s (writing {path})")
        return await super().write_output(partition, job_id, path, chunks)


async def test_a_store_away_while_outputs_are_written_is_the_stores_failure_then_caught_up(
    tmp_path,
):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, _ = one_job(tmp_path)
    store = Store(tmp_path / "store", file_store=AwayFileStore(tmp_path / "store"))

    summary = await batch_over_fakes(jf, store, fake, config=fast_config(attempts=1))

    assert (summary.done, summary.dead_lettered) == (1, 0)
    assert (posted(fake, job.prompt_id), executed(fake, job.prompt_id)) == (1, 1)
    first, second = store.attempts(job.id)
    assert (first.outcome, second.outcome) == ("transient", "success")
    assert first.reason is not None and "no answer for 60 s" in first.reason
    assert "the store's failure, not the job's" in first.reason


async def test_the_files_table_is_the_jobs_manifest_with_content_types(tmp_path):
    fake = FakeComfy(prompt_seconds=0.005)
    jf, job, store = one_job(tmp_path)

    summary = await batch_over_fakes(jf, store, fake)

    assert summary.done == 1
    manifest = [(f.path, f.bytes, f.sha256, f.content_type) for f in store.files(job.id)]
    assert len(manifest) == 2
    for path, size, sha256, content_type in manifest:
        data = (store.job_dir("p", job.id) / path).read_bytes()
        assert (size, sha256, content_type) == (
            len(data),
            hashlib.sha256(data).hexdigest(),
            "image/png",
        )


class ObjectFolderStore(FolderFileStore):
    """A folder store that also reads ``s3://`` objects from ``objects`` (URL -> bytes),
    as an S3 store reads them from its endpoint; ``opened`` lists each URL opened."""

    def __init__(self, root: Path, objects: dict[str, bytes]) -> None:
        super().__init__(root)
        self.objects = objects
        self.opened: list[str] = []

    def open_object(self, url: str) -> BinaryIO:
        self.opened.append(url)
        if url not in self.objects:
            raise FileNotFoundError(url)
        return io.BytesIO(self.objects[url])


def s3_input_jobs(folder: Path, urls: list[str]) -> Path:
    """A job file inverting each picture ``urls`` names; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKFLOWS / "invert_picture.json", folder / "invert_picture.json")
    lines = [
        json.dumps(
            {"id": job_id(i, "s3"), "workflow": "invert_picture.json", "inputs": {"1.image": u}}
        )
        for i, u in enumerate(urls)
    ]
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_s3_input_is_refused_naming_file_line_and_field_when_the_store_is_a_folder(
    tmp_path,
):
    path = s3_input_jobs(tmp_path / "jobs", ["s3://plates/a.png"])
    with pytest.raises(JobFileError) as info:
        load_job_file(path, rules=InputRules(objects=FolderFileStore(tmp_path / "store")))
    (error,) = info.value.errors
    assert (error.line, error.field) == (1, "inputs.1.image")
    assert "s3://plates/a.png" in error.message
    assert "is a folder: s3:// inputs are read only with an S3 store" in error.message
    assert str(path) in str(info.value)
    with pytest.raises(JobFileError, match="read only with an S3 store .* there is none here"):
        load_job_file(path)  # no store at all: nothing reads objects


def test_a_missing_or_too_big_s3_input_is_refused_naming_the_object(tmp_path):
    path = s3_input_jobs(tmp_path / "jobs", ["s3://plates/gone.png", "s3://plates/big.png"])
    objects = ObjectFolderStore(tmp_path / "store", {"s3://plates/big.png": b"x" * 11})
    with pytest.raises(JobFileError) as info:
        load_job_file(path, rules=InputRules(max_input_bytes=10, objects=objects))
    gone, big = info.value.errors
    assert (gone.line, gone.field, big.line, big.field) == (
        1,
        "inputs.1.image",
        2,
        "inputs.1.image",
    )
    assert '"s3://plates/gone.png": no such object' in gone.message
    assert '"s3://plates/big.png": over the limit of 10 bytes' in big.message


async def test_an_s3_input_is_read_through_the_file_store_and_uploaded_to_the_server(tmp_path):
    source = picture(tmp_path / "plate.png", 7)
    url = "s3://plates/shots/plate.png"
    objects = ObjectFolderStore(tmp_path / "store", {url: (tmp_path / "plate.png").read_bytes()})
    store = Store(tmp_path / "store", file_store=objects)
    path = s3_input_jobs(tmp_path / "jobs", [url])
    job_file = load_job_file(path, rules=InputRules(objects=objects))
    (job,) = job_file.jobs
    assert job.inputs[0].path == url
    fake = FakeComfy(prompt_seconds=0.005)

    summary = await batch_over_fakes(job_file, store, fake)

    assert summary.done == 1
    assert int(fake.stats["uploads"]) == 1
    assert objects.opened == [url, url]  # hashed at load, then read for the upload
    (out,) = [f for f in store.files(job.id) if f.path.endswith(".png")]
    inverted = pixels_of(store.job_dir("p", job.id) / out.path)
    expected = np.clip(255.0 * (1.0 - source.astype(np.float32) / 255.0), 0, 255)
    assert np.array_equal(inverted, expected.astype(np.uint8))


def test_an_s3_input_key_with_a_dot_dot_part_is_refused_naming_the_key_once(
    tmp_path: Path, s3_store: S3FileStore, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/plates/../farm/files/results.csv"
    path = s3_input_jobs(tmp_path / "jobs", [url, f"s3://{s3_bucket}"])
    with pytest.raises(JobFileError) as info:
        load_job_file(path, rules=InputRules(objects=s3_store))
    dots, bucket = info.value.errors
    assert (dots.line, dots.field, bucket.line, bucket.field) == (
        1,
        "inputs.1.image",
        2,
        "inputs.1.image",
    )
    assert dots.message == (
        f"\"{url}\": key 'plates/../farm/files/results.csv' has an empty, '.' or '..' part"
    )
    assert bucket.message == (
        f'"s3://{s3_bucket}": it names a bucket, not an object (s3://BUCKET/KEY)'
    )
