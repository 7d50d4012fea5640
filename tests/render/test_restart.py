"""A job file run again, read a chunk at a time (``render/feed.py``), on a store where part
of it ended already (a run killed part way, started again): the jobs ended before are said
and resolved as their chunk is registered, without a claim each before the first job left
to run is posted; the others are posted once each; a changed job, a dead letter and a done
job whose outputs went missing are taken as before."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.render.feed import FIRST_CHUNK
from comfy_assets.render.summary import BatchSummary
from comfy_assets.store import FileRecord, Store
from fake_comfy import FakeComfy
from tests.support import fake_servers, fast_batch, posted, write_jobs

# Past the first chunk, so the jobs done before fill it and part of the next.
JOBS = FIRST_CHUNK + 36
DONE_BEFORE = FIRST_CHUNK + 6


def first_lines(path: Path, count: int) -> JobScan:
    """The first ``count`` lines of ``path``, as a file of their own beside it (its
    workflow's folder): what a run killed part way had reached."""
    part = path.with_name("part.jsonl")
    part.write_text("".join(path.read_text().splitlines(keepends=True)[:count]))
    return scan_job_file(part)


def counting_claims(store: Store) -> Counter[str]:
    """Count ``store.claim_job`` calls by job id from now on (the batch's claims go
    through the store's method)."""
    calls: Counter[str] = Counter()
    claim_job = store.claim_job

    def counted(job_id: str, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        calls[job_id] += 1
        return claim_job(job_id, *args, **kwargs)

    store.claim_job = counted  # type: ignore[method-assign]
    return calls


@dataclass
class RunAgain:
    """What ``run_again`` gives: the jobs of the whole file, the store, the summaries of
    the first run and of the run again, the lines of the run again, and the claims it
    asked for (job id -> how many times)."""

    jobs: list[Job]
    store: Store
    first: BatchSummary
    again: BatchSummary
    lines: list[str]
    claims: Counter[str]


async def run_again(
    tmp_path: Path, fake: FakeComfy, between: Callable[[Path, Store], None] | None = None
) -> RunAgain:
    """Render the first ``DONE_BEFORE`` jobs of a ``JOBS``-job file as partition "p" on
    ``fake``, then (after ``between(path, store)``, if given) the whole file again, read a
    chunk at a time."""
    path = write_jobs(tmp_path / "jobs", JOBS)
    store = Store(tmp_path / "store")
    lines: list[str] = []
    async with fake_servers(fake) as servers:
        first = await fast_batch(first_lines(path, DONE_BEFORE), servers, store)
        if between is not None:
            between(path, store)
        scan = scan_job_file(path)
        jobs = scan.reader().take(JOBS)
        claims = counting_claims(store)
        again = await fast_batch(scan, servers, store, on_line=lines.append)
    return RunAgain(jobs, store, first, again, lines, claims)


async def test_a_run_again_of_a_file_whose_first_jobs_are_done_posts_only_the_others(tmp_path):
    fake = FakeComfy(prompt_seconds=0.0)
    run = await run_again(tmp_path, fake)
    assert run.again.done == JOBS and run.again.dead_lettered == 0
    # Every prompt posted once: those done before by the first run, the rest by this one.
    assert [posted(fake, job.prompt_id) for job in run.jobs] == [1] * JOBS
    done_before, left = run.jobs[:DONE_BEFORE], run.jobs[DONE_BEFORE:]
    said = [line for line in run.lines if "already done, nothing posted" in line]
    assert sorted(said) == sorted(f"job {j.id}: already done, nothing posted" for j in done_before)
    # The jobs done before were resolved from their registration: none claimed, so the
    # first job left to run waits for no claim of theirs.
    assert set(run.claims) == {job.id for job in left}
    assert {r.state for r in run.store.jobs("p")} == {"succeeded"}


async def test_a_run_again_says_a_dead_letter_and_posts_nothing_for_it(tmp_path):
    # The first prompt posted fails validation: a dead letter at once.
    fake = FakeComfy(prompt_seconds=0.0, script=["invalid"])
    run = await run_again(tmp_path, fake)
    ((dead, reason),) = run.first.dead_letters
    assert run.again.done == JOBS - 1 and run.again.dead_lettered == 1
    assert [posted(fake, job.prompt_id) for job in run.jobs] == [1] * JOBS
    assert f"job {dead}: dead-lettered earlier ({reason}); requeue it to run again" in run.lines
    assert dead not in run.claims
    assert run.store.get(dead).state == "failed_fatal"


def change_third_job(path: Path, store: Store) -> None:
    """The file changed at the same name: its third job now renders another colour."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[2]["set"]["1.color"] = 7
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


async def test_a_run_again_of_a_changed_file_renders_the_changed_job_once(tmp_path):
    fake = FakeComfy(prompt_seconds=0.0)
    run = await run_again(tmp_path, fake, change_third_job)
    changed = run.jobs[2]
    assert run.again.done == JOBS
    # Its new prompt posted once; every other one once, by one run or the other.
    assert [posted(fake, job.prompt_id) for job in run.jobs] == [1] * JOBS
    assert run.store.get(changed.id).prompt_id == changed.prompt_id
    assert f"job {changed.id}: already done, nothing posted" not in run.lines
    assert sum("already done, nothing posted" in line for line in run.lines) == DONE_BEFORE - 1


async def test_a_run_again_fetches_missing_outputs_of_a_done_job_without_posting_it(tmp_path):
    fake = FakeComfy(prompt_seconds=0.0)
    lost: list[tuple[str, FileRecord]] = []

    def delete_an_output(path: Path, store: Store) -> None:
        gone = first_lines(path, 4).reader().take(4)[3].id
        (solid,) = [f for f in store.files(gone) if "solid" in f.path]
        (store.job_dir("p", gone) / solid.path).unlink()
        lost.append((gone, solid))

    run = await run_again(tmp_path, fake, delete_an_output)
    ((gone, solid),) = lost
    assert run.again.done == JOBS
    assert [posted(fake, job.prompt_id) for job in run.jobs] == [1] * JOBS
    assert (run.store.job_dir("p", gone) / solid.path).stat().st_size == solid.bytes
    assert any(f"job {gone}: outputs missing: {solid.path}" in line for line in run.lines)
    assert f"job {gone}: already done, nothing posted" not in run.lines
