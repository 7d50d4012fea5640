"""An object store that fails under a batch (a real SeaweedFS behind ``S3FaultProxy``):
down for a while mid-batch, throttling with 503 SlowDown, uploads cut halfway, full; and
a SeaweedFS of the test's own that hangs (SIGSTOP) and comes back (SIGCONT). Each ends clearly with
nothing lost and nothing done twice: every prompt posted once, every output an object of
the bucket, no multipart upload left open, no job a dead letter for the store's failure.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import scan_job_file
from comfy_assets.render.batch import CONSUMERS_PER_SERVER
from comfy_assets.store import Store
from comfy_assets.store.files import (
    FileStoreFull,
    FileStoreUnavailable,
    FolderFileStore,
    OutputRef,
    S3FileStore,
    S3Settings,
)
from fake_comfy import FakeComfy
from tests.s3_fault_proxy import S3FaultProxy
from tests.s3_server import S3Server, seaweedfs
from tests.support import (
    batch_over_fakes,
    fake_servers,
    fast_batch,
    fast_config,
    posted,
    wait_until,
    write_jobs,
)


@pytest.fixture
def proxy(s3_endpoint: S3Server) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(s3_endpoint.endpoint).running() as p:
        yield p


def files_through(proxy: S3FaultProxy, s3: S3Server, bucket: str, tmp_path: Path) -> S3FileStore:
    """An S3FileStore at ``s3://bucket/farm`` reached through ``proxy``, its client's own
    retries few and short, so a store that is down ends an attempt within seconds."""
    settings = S3Settings(
        endpoint=proxy.endpoint, access_key_id=s3.access_key, secret_access_key=s3.secret_key
    )
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    return S3FileStore(
        f"s3://{bucket}/farm", settings, spool_dir=spool, max_retries=2, retry_timeout_s=5.0
    )


def assert_all_stored_once(
    store: Store, fakes: list[FakeComfy], s3: S3Server, bucket: str, jobs: int
) -> None:
    """Every job done, its prompt posted once across the fakes, each output an object
    of the bucket by its sha256 with its size, no multipart upload open."""
    records = store.jobs("p")
    assert [r.state for r in records] == ["succeeded"] * jobs
    objects = s3.objects(bucket, "farm/")
    for rec in records:
        assert sum(posted(f, rec.prompt_id) for f in fakes) == 1, rec.job_id
        files = store.files(rec.job_id)
        assert files
        for f in files:
            assert objects[f"farm/sha256/{f.sha256}"] == f.bytes
    assert s3.multipart_uploads(bucket) == []


async def test_a_store_down_mid_batch_is_waited_out_and_the_outputs_caught_up_not_posted_again(
    proxy: S3FaultProxy, s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fakes = [FakeComfy(prompt_seconds=0.005), FakeComfy(prompt_seconds=0.005)]
    jf = load_job_file(write_jobs(tmp_path / "jobs", 6))
    files = files_through(proxy, s3_endpoint, s3_bucket, tmp_path)
    store = Store(tmp_path / "records", file_store=files)
    lines: list[str] = []
    failed = [0]

    def on_line(line: str) -> None:
        lines.append(line)
        if "succeeded" in line and not failed[0]:
            proxy.down = True  # the store goes down once a first job is done
        if "outputs not stored" in line:
            failed[0] += 1
            if failed[0] == 3:
                proxy.down = False  # and comes back once three attempts failed on it

    config = fast_config(attempts=2, files_wait_s=120.0, max_delay_s=0.5)
    summary = await batch_over_fakes(jf, store, *fakes, config=config, on_line=on_line)

    assert (summary.done, summary.dead_lettered) == (6, 0)
    assert failed[0] >= 3 and proxy.counts["down"] > 0
    assert any("the store's failure, not the job's" in line for line in lines)
    assert any("caught up, nothing posted" in line for line in lines)
    assert_all_stored_once(store, fakes, s3_endpoint, s3_bucket, 6)


@pytest.mark.parametrize(
    ("fault", "counted"),
    [
        ("slowdown", "slowdown"),  # 503 SlowDown twice: fewer than one request's retries
        ("cut_uploads", "cut"),  # two uploads cut halfway: nothing half-written is seen
    ],
)
async def test_throttling_and_cut_uploads_are_retried_by_the_client_and_no_attempt_fails(
    fault: str,
    counted: str,
    proxy: S3FaultProxy,
    s3_endpoint: S3Server,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 2))
    store = Store(
        tmp_path / "records", file_store=files_through(proxy, s3_endpoint, s3_bucket, tmp_path)
    )
    setattr(proxy, fault, 2)

    summary = await batch_over_fakes(jf, store, fake)

    assert (summary.done, summary.dead_lettered) == (2, 0)
    assert proxy.counts[counted] == 2
    outcomes = [a.outcome for r in store.jobs("p") for a in store.attempts(r.job_id)]
    assert outcomes == ["success", "success"]
    assert_all_stored_once(store, [fake], s3_endpoint, s3_bucket, 2)


async def test_a_full_bucket_stops_the_batch_at_once_and_a_later_one_catches_up(
    proxy: S3FaultProxy, s3_endpoint: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    fake = FakeComfy(prompt_seconds=0.005)
    jf = load_job_file(write_jobs(tmp_path / "jobs", 8))
    files = files_through(proxy, s3_endpoint, s3_bucket, tmp_path)
    store = Store(tmp_path / "records", file_store=files)
    proxy.full = True

    async with fake_servers(fake) as servers:  # one server life: its /history kept
        with pytest.raises(FileStoreFull) as stopped:
            await fast_batch(jf, servers, store)
        said = str(stopped.value)
        assert said.startswith(f"s3://{s3_bucket}/farm: storing the output ")
        assert said.endswith("the object store is full (507 InsufficientStorage)")
        assert s3_endpoint.secret_key not in said
        assert [r.state for r in store.jobs("p")].count("dead_lettered") == 0
        # No new job was taken once the store said it was full (those posted while the
        # client retried the first output's 507 are caught up below).
        assert sum(v["posted"] for v in fake.stats["prompts"].values()) < 8

        proxy.full = False
        summary = await fast_batch(jf, servers, store)

    assert (summary.done, summary.dead_lettered) == (8, 0)
    assert_all_stored_once(store, [fake], s3_endpoint, s3_bucket, 8)  # caught up, once


def weed_pid(endpoint: str) -> int:
    """The pid of the ``weed`` process whose S3 gateway serves ``endpoint``."""
    port = endpoint.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"weed") and f"-s3.port={port}".encode() in argv:
            return int(entry.name)
    raise LookupError(f"no weed process serves {endpoint}")


async def test_a_store_that_hangs_holds_its_jobs_until_it_answers_each_prompt_posted_once(
    tmp_path: Path,
) -> None:
    # A SeaweedFS of the test's own, stopped (SIGSTOP: its sockets accept, nothing
    # answers) once a first job is done, and continued once the server's consumers each
    # hold a rendered prompt whose outputs wait for the store.
    with seaweedfs(tmp_path / "seaweedfs", "hang-key", "hang-secret") as s3:
        s3.create_bucket("hang")
        pid = weed_pid(s3.endpoint)
        settings = S3Settings(
            endpoint=s3.endpoint, access_key_id="hang-key", secret_access_key="hang-secret"
        )
        (tmp_path / "spool").mkdir()
        files = S3FileStore("s3://hang/farm", settings, spool_dir=tmp_path / "spool")
        store = Store(tmp_path / "records", file_store=files)
        fake = FakeComfy(prompt_seconds=0.005)
        jf = load_job_file(write_jobs(tmp_path / "jobs", 5))
        stopped = [False]

        def on_line(line: str) -> None:
            if "succeeded" in line and not stopped[0]:
                stopped[0] = True
                os.kill(pid, signal.SIGSTOP)

        try:
            async with fake_servers(fake) as servers:
                batch = asyncio.create_task(fast_batch(jf, servers, store, on_line=on_line))
                await wait_until(
                    lambda: stopped[0] and len(fake.stats["runs"]) >= 1 + CONSUMERS_PER_SERVER,
                    60,
                    "prompts rendered while the store hangs",
                )
                assert not batch.done()  # the outputs wait for the store
                os.kill(pid, signal.SIGCONT)
                summary = await batch
        finally:
            os.kill(pid, signal.SIGCONT)

        assert (summary.done, summary.dead_lettered) == (5, 0)
        assert_all_stored_once(store, [fake], s3, "hang", 5)


class UnansweringFileStore(FolderFileStore):
    """A folder store whose check of a done job's outputs finds the store away."""

    def output_problem(self, partition: str, job_id: str, file: OutputRef) -> str | None:
        raise FileStoreUnavailable(f"{self.location}: checking the output {file.path}: away")


# Run again, the file is loaded whole (its done jobs claimed) or read a chunk at a time
# (its done jobs resolved from their registration: ``render/feed.py``).
@pytest.mark.parametrize("read", ["whole", "in chunks"])
async def test_a_done_job_whose_store_does_not_answer_its_check_is_done_not_posted_again(
    tmp_path: Path, read: str
) -> None:
    fake = FakeComfy(prompt_seconds=0.005)
    path = write_jobs(tmp_path / "jobs", 2)
    first = await batch_over_fakes(load_job_file(path), Store(tmp_path / "store"), fake)
    assert first.done == 2
    lines: list[str] = []
    store = Store(tmp_path / "store", file_store=UnansweringFileStore(tmp_path / "store"))

    jf = load_job_file(path) if read == "whole" else scan_job_file(path)
    again = await batch_over_fakes(jf, store, fake, on_line=lines.append)

    assert (again.done, again.dead_lettered) == (2, 0)
    assert sum(v["posted"] for v in fake.stats["prompts"].values()) == 2  # none again
    said = [line for line in lines if "already done, nothing posted" in line]
    assert len(said) == 2
    assert all("(its outputs not checked: " in line and "away)" in line for line in said)
