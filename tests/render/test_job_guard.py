"""A job whose handling raises in our own code is that job's dead letter, never the
batch's end: the other jobs render, the summary is printed and results.csv written. The
parser refuses the inputs that did so (tests/jobs/test_untakeable_text.py), so these tests
make our code raise for one job by hand."""

from __future__ import annotations

import asyncio
import csv
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import sqlalchemy.exc

from comfy_assets.cli.main import main
from comfy_assets.comfy import capabilities
from comfy_assets.comfy import client as client_module
from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.guard import our_error, stops_the_batch
from comfy_assets.store import Store, StoreDiskFull, StoreUnavailable
from comfy_assets.store.schema import metadata
from fake_comfy import FakeComfy
from tests.support import batch_over_fakes, write_jobs

FAST = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--no-jitter", "--poll-s", "0.05"]


@pytest.fixture
def fake() -> FakeComfy:
    return FakeComfy(prompt_seconds=0.005)


@pytest.fixture
def url(fake: FakeComfy) -> Any:
    with fake.serve_in_thread(port=0) as served:
        yield served


def _run(jobs: Path, store: Path, url: str) -> int:
    return main(
        ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(store), *FAST]
    )


def _table(store: Path) -> dict[str, dict[str, str]]:
    with (store / "jobs" / "results.csv").open(newline="", encoding="utf-8") as handle:
        return {row["job_id"]: row for row in csv.DictReader(handle)}


@dataclass(frozen=True)
class Three:
    """A job file of three jobs (``path``) and its ``jobs``, run over the fake at ``url``;
    our code is made to raise for ``bad``, the second."""

    path: Path
    jobs: list[Job]
    url: str

    @property
    def bad(self) -> Job:
        return self.jobs[1]


@pytest.fixture
def three(tmp_path: Path, url: str) -> Three:
    jobs = write_jobs(tmp_path / "jobs", 3)
    return Three(jobs, load_job_file(jobs).jobs, url)


def _run_with_one_bad(
    three: Three, capsys: pytest.CaptureFixture[str]
) -> tuple[list[str], dict[str, str]]:
    """Run ``three``: the two others succeed and ``three.bad`` is the batch's one dead
    letter, the run's exit status 1. The lines printed and its row of results.csv."""
    store = three.path.parent.parent / "store"
    assert _run(three.path, store, three.url) == 1
    out = capsys.readouterr().out.splitlines()
    assert "summary: 2 done, 1 dead-lettered" in out
    assert out[-1] == f"results: {store / 'jobs' / 'results.csv'}"
    table = _table(store)
    assert [table[j.id]["state"] for j in three.jobs] == [
        "succeeded",
        "failed_fatal",
        "succeeded",
    ]
    return out, table[three.bad.id]


def test_a_prompt_our_client_cannot_encode_is_that_jobs_dead_letter_and_the_batch_ends(
    three: Three,
    fake: FakeComfy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = client_module.json_dumps

    def json_dumps(value: Any) -> str:
        # The text a lone surrogate in the prompt gives: encoding it to UTF-8 raises.
        text = real(value)
        if isinstance(value, dict) and value.get("prompt_id") == three.bad.prompt_id:
            return text + "\ud800"
        return text

    monkeypatch.setattr(client_module, "json_dumps", json_dumps)

    out, row = _run_with_one_bad(three, capsys)

    assert row["reason"].startswith(
        "our error while handling this job: UnicodeEncodeError: 'utf-8' codec can't encode "
        "character '\\ud800'"
    )
    assert row["attempts"] == "1"  # permanent: not tried again
    assert three.bad.prompt_id not in fake.stats["prompts"]  # nothing reached the server
    assert any(line.startswith(f"job {three.bad.id}: dead-lettered, our error") for line in out)


def test_a_result_the_store_refuses_to_write_is_that_jobs_dead_letter(
    three: Three, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = Store.mark_done

    def mark_done(self: Store, job_id: str, *args: Any, **kwargs: Any) -> None:
        if job_id == three.bad.id:  # as PostgreSQL answers a NUL in a text column
            raise sqlalchemy.exc.DataError(
                "UPDATE comfy_jobs ...", {}, ValueError("text fields cannot contain NUL (0x00)")
            )
        real(self, job_id, *args, **kwargs)

    monkeypatch.setattr(Store, "mark_done", mark_done)

    _, row = _run_with_one_bad(three, capsys)

    assert row["reason"].startswith("our error while handling this job: DataError: ")
    assert "text fields cannot contain NUL" in row["reason"]


@pytest.mark.parametrize(
    "error",
    [
        asyncio.CancelledError(),
        KeyboardInterrupt(),
        StoreUnavailable("claim", 30.0, OSError("connection refused")),
        StoreDiskFull("dead_letter", "store.db", OSError("full")),
        sqlalchemy.exc.OperationalError("SELECT 1", {}, OSError("database is locked")),
        OSError(errno.ENOSPC, "No space left on device"),
        MemoryError(),
    ],
)
def test_a_cancel_an_outage_or_our_disk_still_stops_the_batch(error: BaseException) -> None:
    assert stops_the_batch(error)


@pytest.mark.parametrize(
    "error",
    [
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
        ValueError("embedded null byte"),
        sqlalchemy.exc.DataError("INSERT ...", {}, ValueError("NUL")),
        OSError(errno.ENAMETOOLONG, "File name too long"),
        KeyError("a bug"),
    ],
)
def test_what_our_code_raises_for_one_job_is_that_jobs_failure(error: Exception) -> None:
    assert not stops_the_batch(error)


def test_our_error_is_bounded_and_holds_nothing_a_store_or_terminal_refuses() -> None:
    reason = our_error(ValueError("a\x00b\ud800" + "x" * 10_000_000))
    assert reason.startswith("our error while handling this job: ValueError: a\\x00b\\ud800xxx")
    assert reason.endswith("… (10,000,004 characters)")
    assert len(reason) < 400
    reason.encode("utf-8")


@pytest.mark.postgres
async def test_a_nul_that_reaches_postgresql_is_that_jobs_dead_letter(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parser refuses a NUL, and reasons escape one: both bypassed here, so PostgreSQL
    # itself refuses the dead letter's reason (psycopg's DataError), as it did before.
    extra = [{"set": {"3.seed": i, "5.width": 64, "5.height": 64}} for i in range(3)]
    jobs = write_jobs(tmp_path / "jobs", 3, workflow="text_to_image.json", extra=extra)
    job_file = load_job_file(jobs)
    good, bad, other = job_file.jobs
    bad.workflow["4"]["inputs"]["ckpt_name"] = "a\x00b.safetensors"
    monkeypatch.setattr(capabilities, "excerpt", lambda text: text)
    fake = FakeComfy(prompt_seconds=0.005, models=["v1-5-pruned-emaonly-fp16.safetensors"])
    with Store(tmp_path / "store", pg_url) as store, store.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE " + ", ".join(t.name for t in metadata.sorted_tables)))
    with Store(tmp_path / "store", pg_url) as store:
        summary = await batch_over_fakes(job_file, store, fake, partition="jobs")
        assert (summary.done, summary.dead_lettered) == (2, 1)
        record = store.get(bad.id)
        assert record.state == "failed_fatal"
        assert record.reason.startswith("our error while handling this job: DataError: ")
        assert "cannot contain NUL" in record.reason
        assert [store.get(j.id).state for j in (good, other)] == ["succeeded", "succeeded"]
