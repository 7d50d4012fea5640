"""The result store on SQLite: attempts, done records and their files, degraded jobs,
dead letters and requeues."""

from __future__ import annotations

import pytest

from comfy_assets.jobs.states import InvalidTransition
from comfy_assets.store import (
    AttemptEntry,
    ClaimLost,
    OutputFile,
    RenderingStart,
    UnknownJob,
    Via,
)
from tests.store.test_store import SHA, files, make_job, make_jobs, run_to_rendering

# --- attempts, done records, dead letters --------------------------------------------


def test_attempts_are_recorded_and_counted(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.record_attempt(
        job.id,
        AttemptEntry(
            1,
            "transient",
            server="gpu0",
            prompt_id=job.prompt_id,
            number=3,
            started_at=100.0,
            ended_at=104.0,
            queue_wait_s=1.0,
            reason="POST /prompt 500",
        ),
    )
    store.record_attempt(
        job.id, AttemptEntry(2, "success", seconds=2.0, gpu_seconds=1.5), now=110.0
    )
    first, second = store.attempts(job.id)
    assert (first.attempt, first.seconds, first.outcome, first.reason, first.number) == (
        1,
        4.0,
        "transient",
        "POST /prompt 500",
        3,
    )
    assert (second.started_at, second.ended_at, second.gpu_seconds) == (108.0, 110.0, 1.5)
    assert store.get(job.id).attempts == 2
    store.record_attempt(job.id, AttemptEntry(1, "permanent", seconds=1.0))  # replaces attempt 1
    assert [a.outcome for a in store.attempts(job.id)] == ["permanent", "success"]
    assert store.get(job.id).attempts == 2


def test_record_attempt_checks_outcome_and_job(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    with pytest.raises(ValueError, match="outcome must be one of"):
        store.record_attempt(job.id, AttemptEntry(1, "ok", seconds=1.0))
    with pytest.raises(UnknownJob):
        store.record_attempt("missing", AttemptEntry(1, "success", seconds=1.0))


def test_mark_done_records_files_totals_and_frees_the_claim(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)  # first submitted at 101
    store.record_attempt(
        job.id, AttemptEntry(1, "success", started_at=101.0, ended_at=111.0, queue_wait_s=2.0)
    )
    names = ("solid_00001_.png", "inverted_00001_.png")
    store.mark_done(job.id, "w1", files=files(*names), now=112.0)
    rec = store.get(job.id)
    assert (rec.state, rec.claimed_by, rec.finished_at) == ("succeeded", None, 112.0)
    assert (rec.seconds, rec.queue_wait_s, rec.gpu_seconds) == (11.0, 2.0, 8.0)
    got = [(f.path, f.sha256, f.bytes, f.prompt_id) for f in store.files(job.id)]
    assert got == [
        ("inverted_00001_.png", SHA, 11, job.prompt_id),
        ("solid_00001_.png", SHA, 10, job.prompt_id),
    ]
    last = store.events(job_id=job.id)[-1]
    assert (last.from_state, last.to_state, last.detail) == ("rendering", "succeeded", "2 files")


def test_mark_done_without_the_claim_writes_nothing(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job, owner="w1")
    with pytest.raises(ClaimLost):
        store.mark_done(job.id, "w2", files=files("a.png"))
    assert store.files(job.id) == []
    assert store.get(job.id).state == "rendering"


def test_the_attempt_that_finished_a_job_is_written_with_its_done_record(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)  # first submitted at 101
    tried = AttemptEntry(1, "success", server="gpu0", started_at=101.0, queue_wait_s=2.0)
    with pytest.raises(ClaimLost):  # not the holder: neither the attempt nor the done
        store.mark_done(job.id, "w2", files=files("a.png"), now=111.0, via=Via(tried=tried))
    assert (store.attempts(job.id), store.get(job.id).state) == ([], "rendering")
    store.mark_done(job.id, "w1", files=files("a.png"), now=111.0, via=Via(tried=tried))
    (attempt,) = store.attempts(job.id)
    assert (attempt.server, attempt.seconds, attempt.outcome) == ("gpu0", 10.0, "success")
    rec = store.get(job.id)
    assert (rec.state, rec.attempts, rec.queue_wait_s, rec.gpu_seconds) == (
        "succeeded",
        1,
        2.0,
        8.0,
    )


def test_a_failed_attempt_is_written_with_its_transition_or_dead_letter(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)
    first = AttemptEntry(1, "transient", seconds=1.0, reason="POST /prompt 500")
    store.transition(job.id, "failed_retryable", via=Via(attempt=1, tried=first))
    store.transition(job.id, "pending")
    store.transition(job.id, "submitted")
    second = AttemptEntry(2, "permanent", seconds=2.0, reason="IndexError")
    store.dead_letter(job.id, "w1", "IndexError", via=Via(attempt=2, tried=second))
    assert [(a.attempt, a.outcome) for a in store.attempts(job.id)] == [
        (1, "transient"),
        (2, "permanent"),
    ]
    assert (store.get(job.id).state, store.get(job.id).attempts) == ("failed_fatal", 2)


def test_a_rendering_move_not_yet_written_lands_with_the_record_that_ends_the_attempt(
    store, workflow_dir
):
    jobs = make_jobs(workflow_dir, 3)
    store.register_jobs("film", jobs)
    for job in jobs:
        assert store.claim(job.id, "w1", now=100.0) == "claimed"
        store.transition(
            job.id, "submitted", owner="w1", via=Via(server="gpu0", attempt=1), now=101.0
        )
    started = RenderingStart("gpu0", 1, 7, 102.0)
    tried = AttemptEntry(1, "success", server="gpu0", seconds=2.0)
    store.mark_done(
        jobs[0].id,
        "w1",
        files=files("a.png"),
        now=103.0,
        via=Via(tried=tried, rendering=started),
    )
    failed = AttemptEntry(1, "transient", seconds=2.0, reason="POST /free sent")
    store.transition(
        jobs[1].id, "failed_retryable", via=Via(attempt=1, tried=failed, rendering=started)
    )
    store.dead_letter(jobs[2].id, "w1", "IndexError", via=Via(attempt=1, rendering=started))
    for job, last in zip(jobs, ["succeeded", "failed_retryable", "failed_fatal"], strict=True):
        moves = [(e.time, e.from_state, e.to_state, e.server) for e in store.events(job.id)]
        assert moves[-2:] == [
            (102.0, "submitted", "rendering", "gpu0"),
            (103.0 if last == "succeeded" else moves[-1][0], "rendering", last, moves[-1][3]),
        ]
        assert store.get(job.id).number == 7
    # A job no longer submitted (done) refuses the move and keeps its record.
    with pytest.raises(InvalidTransition):
        store.transition(jobs[0].id, "pending", via=Via(rendering=started))
    assert store.get(jobs[0].id).state == "succeeded"


def test_a_rendering_move_timed_by_a_clock_that_stepped_keeps_the_jobs_events_in_order(
    store, workflow_dir
):
    jobs = make_jobs(workflow_dir, 2)
    store.register_jobs("film", jobs)
    for job in jobs:
        store.claim(job.id, "w1", now=100.0)
        store.transition(
            job.id, "submitted", owner="w1", via=Via(server="gpu0", attempt=1), now=101.0
        )
    tried = AttemptEntry(1, "success", server="gpu0", seconds=2.0)
    # The host's clock stepped back before the POST's answer, then forward past the end.
    for job, at in zip(jobs, (99.0, 110.0), strict=True):
        store.mark_done(
            job.id,
            "w1",
            now=103.0,
            via=Via(tried=tried, rendering=RenderingStart("gpu0", 1, 7, at)),
        )
        # submitted, rendering, succeeded (registered came first, by this host's clock)
        times = [e.time for e in store.events(job.id)][-3:]
        assert times == [101.0, 101.0 if at < 101.0 else 103.0, 103.0]


def test_a_refused_done_record_leaves_no_files_behind(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", now=100.0)
    store.transition(job.id, "submitted", now=101.0)
    store.transition(job.id, "failed_retryable", now=102.0)
    with pytest.raises(InvalidTransition):
        store.mark_done(job.id, "w1", files=files("a.png"))
    assert store.files(job.id) == []
    assert store.get(job.id).claimed_by == "w1"


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape.png", ""])
def test_mark_done_refuses_a_path_outside_the_job_dir(store, workflow_dir, bad):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)
    with pytest.raises(ValueError, match="not inside the job dir"):
        store.mark_done(job.id, "w1", files=[OutputFile(bad, SHA, 1)])
    assert store.get(job.id).state == "rendering"


def test_a_degraded_job_keeps_its_reason(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1, optional=True)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", now=100.0)
    store.mark_done(job.id, "w1", state="degraded", reason="optional shot skipped", now=101.0)
    rec = store.get(job.id)
    assert (rec.state, rec.reason, rec.done) == ("degraded", "optional shot skipped", True)
    assert store.events(job_id=job.id)[-1].detail == "0 files; optional shot skipped"


def test_a_rerun_replaces_the_files_of_the_previous_done_record(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)
    store.mark_done(job.id, "w1", files=files("old.png"), now=110.0)
    store.transition(job.id, "pending", detail="rerun", now=111.0)
    run_to_rendering(store, job, now=120.0)
    store.mark_done(job.id, "w1", files=files("new.png"), now=130.0)
    assert [f.path for f in store.files(job.id)] == ["new.png"]


def test_the_files_of_a_partition_are_its_done_jobs_files_each_by_path(store, workflow_dir):
    film = make_jobs(workflow_dir, 3)
    (other,) = [make_job(workflow_dir, 9)]
    store.register_jobs("film", film)
    store.register_jobs("other", [other])
    for job, names in ((film[0], ("b.png", "a.png")), (film[1], ()), (other, ("c.png",))):
        run_to_rendering(store, job)
        store.mark_done(job.id, "w1", files=files(*names), now=110.0)
    by_job = store.partition_files("film")
    assert {j: [f.path for f in fs] for j, fs in by_job.items()} == {
        film[0].id: ["a.png", "b.png"]  # no files: no key; pending: no key
    }
    assert by_job[film[0].id] == store.files(film[0].id)
    assert [f.path for f in store.partition_files("other")[other.id]] == ["c.png"]


def test_dead_letter_then_requeue(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 2)
    store.register_jobs("film", jobs)
    run_to_rendering(store, jobs[0])
    store.record_attempt(jobs[0].id, AttemptEntry(1, "permanent", seconds=1.0))
    store.dead_letter(jobs[0].id, "w1", "prompt_outputs_failed_validation", now=130.0)
    (dead,) = store.dead_letters("film")
    assert (dead.job_id, dead.reason, dead.claimed_by, dead.attempts) == (
        jobs[0].id,
        "prompt_outputs_failed_validation",
        None,
        1,
    )
    assert store.dead_letters() == [dead]
    assert store.dead_letters("other") == []
    assert store.requeue(jobs[1].id) is False  # pending, not dead-lettered
    assert store.requeue(jobs[0].id, now=140.0) is True
    rec = store.get(jobs[0].id)
    assert (rec.state, rec.reason, rec.attempts) == ("pending", None, 0)
    assert store.dead_letters("film") == []
    assert store.events(job_id=jobs[0].id)[-1].detail == "requeued"
    assert store.requeue(jobs[0].id) is False
    assert store.requeue("no-such-job") is False
    assert store.claim(jobs[0].id, "w2") == "claimed"


def test_dead_letter_requires_the_claim(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    with pytest.raises(ClaimLost):
        store.dead_letter(job.id, "w1", "nope")
    assert store.get(job.id).state == "pending"
