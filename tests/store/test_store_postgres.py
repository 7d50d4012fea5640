"""The store's key behaviours on both backends: SQLite and the machine's PostgreSQL.

The PostgreSQL cases use a fresh database for the session (``pg_url``) and empty tables
for each test.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import InvalidTransition
from comfy_assets.store import (
    AttemptEntry,
    ClaimLost,
    PartitionConflict,
    RenderingStart,
    Store,
    Via,
    metadata,
)
from tests.store.test_store import (
    claim_race,
    files,
    in_two_processes,
    lease_race,
    make_job,
    make_jobs,
    run_to_rendering,
)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend(request, tmp_path) -> tuple[Path, str | None]:
    """(root, db_url) of an empty store on each backend."""
    root = tmp_path / "store"
    if request.param == "sqlite":
        return root, None
    url = request.getfixturevalue("pg_url")
    with Store(root, url) as s, s.engine.begin() as conn:
        names = ", ".join(t.name for t in metadata.sorted_tables)
        conn.execute(sa.text(f"TRUNCATE {names}"))
    return root, url


@pytest.fixture
def any_store(backend):
    s = Store(*backend)
    yield s
    s.close()


def test_the_backend_is_the_one_asked_for(backend, any_store):
    assert any_store.dialect == ("sqlite" if backend[1] is None else "postgresql")


def test_register_keeps_done_jobs_and_resets_changed_ones(any_store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    assert any_store.register_jobs("film", jobs).inserted == [j.id for j in jobs]
    run_to_rendering(any_store, jobs[0])
    any_store.mark_done(jobs[0].id, "w1", files=files("a.png"), now=110.0)
    run_to_rendering(any_store, jobs[1])
    any_store.mark_done(jobs[1].id, "w1", files=files("b.png"), now=110.0)
    edited = make_job(workflow_dir, 1, color=77)
    result = any_store.register_jobs("film", [jobs[0], edited, jobs[2]], now=200.0)
    assert (result.inserted, result.unchanged, result.changed) == (
        [],
        [jobs[0].id, jobs[2].id],
        [jobs[1].id],
    )
    assert any_store.get(jobs[0].id).state == "succeeded"
    # The done job is returned with its record (a run started again resolves it so).
    assert result.ended == {jobs[0].id: any_store.get(jobs[0].id)}
    rec = any_store.get(jobs[1].id)
    assert (rec.state, rec.attempts, rec.prompt_id) == ("pending", 0, edited.prompt_id)
    assert any_store.events(job_id=jobs[1].id)[-1].detail == "inputs changed"
    with pytest.raises(PartitionConflict):
        any_store.register_jobs("other", [jobs[2]])


def test_ten_thousand_jobs_register_in_bulk(any_store, workflow_dir):
    lines = [
        {"id": str(uuid.UUID(int=i, version=4)), "workflow": "image.json", "shot": 10_000 - i}
        for i in range(10_000)
    ]
    path = workflow_dir / "big.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    jobs = load_job_file(path).jobs
    assert len(any_store.register_jobs("big", jobs).inserted) == 10_000
    assert any_store.counts("big")["pending"] == 10_000
    assert len(any_store.register_jobs("big", jobs).unchanged) == 10_000
    listed = any_store.jobs("big")
    assert [(r.shot, r.line) for r in listed[:2]] == [(1, 10_000), (2, 9_999)]  # by shot


def test_claims_expire_and_are_taken_over_with_an_event(any_store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    any_store.register_jobs("film", [job])
    assert any_store.claim(job.id, "w1", lease_s=10.0, now=100.0) == "claimed"
    assert any_store.claim(job.id, "w2", lease_s=10.0, now=109.9) == "held"
    assert any_store.claim(job.id, "w2", lease_s=10.0, now=110.0) == "claimed"
    rec = any_store.get(job.id)
    assert (rec.claimed_by, rec.claim_expires_at) == ("w2", 120.0)
    last = any_store.events(job_id=job.id)[-1]
    assert last.detail == "claim taken over from w1 (its lease expired)"
    assert (last.from_state, last.to_state, last.time) == ("pending", "pending", 110.0)
    assert any_store.renew_claim(job.id, "w1", 10.0, now=111.0) is False
    assert any_store.renew_claim(job.id, "w2", 10.0, now=111.0) is True
    assert any_store.release_claim(job.id, "w2") is True
    assert any_store.get(job.id).claimed_by is None


def test_a_bad_transition_is_rejected_against_the_stored_state(any_store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    any_store.register_jobs("film", [job])
    with pytest.raises(InvalidTransition, match="cannot go from pending to rendering"):
        any_store.transition(job.id, "rendering")
    assert any_store.get(job.id).state == "pending"
    assert [e.to_state for e in any_store.events(job_id=job.id)] == ["pending"]


def test_a_job_runs_to_done_with_files_attempts_and_events(any_store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    any_store.register_jobs("film", [job])
    run_to_rendering(any_store, job)
    any_store.record_attempt(
        job.id, AttemptEntry(1, "success", started_at=101.0, ended_at=105.0, queue_wait_s=1.0)
    )
    any_store.mark_done(job.id, "w1", files=files("s.png", "i.png"), now=106.0)
    rec = any_store.get(job.id)
    assert (rec.state, rec.claimed_by, rec.seconds, rec.gpu_seconds) == (
        "succeeded",
        None,
        5.0,
        3.0,
    )
    assert [f.path for f in any_store.files(job.id)] == ["i.png", "s.png"]
    assert [a.outcome for a in any_store.attempts(job.id)] == ["success"]
    assert [e.to_state for e in any_store.events(job_id=job.id)] == [
        "pending",
        "submitted",
        "rendering",
        "succeeded",
    ]
    with pytest.raises(ClaimLost):
        any_store.mark_done(job.id, "w1")


def test_dead_letter_and_requeue(any_store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1, shot=17)
    any_store.register_jobs("film", [job])
    run_to_rendering(any_store, job)
    any_store.dead_letter(job.id, "w1", "IndexError", now=104.0)
    assert any_store.claim(job.id, "w2") == "dead_lettered"
    assert [r.job_id for r in any_store.dead_letters("film")] == [job.id]
    ended = any_store.register_jobs("film", [job]).ended
    assert (ended[job.id].state, ended[job.id].reason) == ("failed_fatal", "IndexError")
    assert any_store.requeue(job.id) is True
    assert any_store.register_jobs("film", [job]).ended == {}
    assert any_store.requeue(job.id) is False
    assert any_store.counts("film")["pending"] == 1
    story = [e.detail for e in any_store.events(partition="film", shot=17)]
    assert story[-2:] == ["IndexError", "requeued"]


def test_server_leases_are_exclusive_until_expiry(any_store):
    assert any_store.acquire_server("gpu0", "a", 10.0, prompt_id="p", now=100.0)
    assert not any_store.acquire_server("gpu0", "b", 10.0, now=109.0)
    assert any_store.acquire_server("gpu0", "b", 10.0, now=110.0)
    assert not any_store.renew_server("gpu0", "a", 10.0, now=111.0)
    assert any_store.release_server("gpu0", "b", last_model="flux.safetensors")
    lease = any_store.server_leases()["gpu0"]
    assert (lease.owner, lease.last_model, lease.held(now=111.0)) == (
        None,
        "flux.safetensors",
        False,
    )


def test_the_models_a_server_holds_are_noted_whoever_holds_its_lease(any_store):
    any_store.note_server_model("gpu1", '["a.safetensors"]', now=100.0)  # no lease row yet
    assert any_store.acquire_server("gpu1", "a", 10.0, now=101.0)
    any_store.note_server_model("gpu1", '["b.safetensors"]', now=102.0)
    lease = any_store.server_leases()["gpu1"]
    assert (lease.owner, lease.last_model, lease.held(now=103.0)) == (
        "a",
        '["b.safetensors"]',
        True,
    )
    any_store.note_server_model("gpu1", None)  # started again: it holds nothing
    assert any_store.release_server("gpu1", "a")
    assert any_store.server_leases()["gpu1"].last_model is None


def test_two_processes_racing_claim_each_job_exactly_once(backend, any_store, workflow_dir):
    jobs = make_jobs(workflow_dir, 8)
    any_store.register_jobs("film", jobs)
    ids = [j.id for j in jobs]
    results = in_two_processes(claim_race, *backend, ids)
    (p1,), (p2,) = results["p1"], results["p2"]
    assert sorted(p1 + p2) == sorted(ids)
    assert not set(p1) & set(p2)


def test_two_processes_never_hold_one_server_at_once(backend, any_store):
    results = in_two_processes(lease_race, *backend, 40)
    (won1, lost1), (won2, lost2) = results["p1"], results["p2"]
    assert sorted(won1 + won2) == list(range(40))
    assert (lost1, lost2) == (0, 0)


def register_race(root: str, db_url: str | None, owner: str, folder: str, barrier, out) -> None:
    """Child process: register the same 200 jobs as the other process, at the same time."""
    store = Store(Path(root), db_url)
    jobs = make_jobs(Path(folder), 200)
    barrier.wait()
    result = store.register_jobs("film", jobs)
    store.close()
    out.put((owner, result.inserted, result.unchanged))


def test_two_processes_registering_the_same_jobs_insert_each_once(backend, any_store, workflow_dir):
    results = in_two_processes(register_race, *backend, str(workflow_dir))
    (ins1, same1), (ins2, same2) = results["p1"], results["p2"]
    ids = [j.id for j in make_jobs(workflow_dir, 200)]
    assert sorted(ins1 + ins2) == sorted(ids)
    assert sorted(same1 + same2) == sorted(ids)
    assert len(any_store.events(partition="film")) == 200


def test_a_move_from_a_known_state_writes_the_same_rows_as_the_checked_way(any_store, workflow_dir):
    # `from_state` makes submitted and rendering a guarded update without a read (on
    # PostgreSQL one statement); the job and its events must come out as the checked way
    # writes them, on both backends.
    fast, checked = make_jobs(workflow_dir, 2)
    any_store.register_jobs("film", [fast, checked])
    moved: list[object] = []  # events the one-statement way wrote
    one_statement = any_store._move_in_one
    any_store._move_in_one = lambda *args: moved.append(one_statement(*args)) or moved[-1]
    for job, known in ((fast, True), (checked, False)):
        assert any_store.claim(job.id, "w1", now=100.0) == "claimed"
        hint = {"from_state": "pending"} if known else {}
        any_store.transition(
            job.id,
            "submitted",
            owner="w1",
            via=Via(server="gpu0", attempt=1),
            now=101.0,
            prompt_id=job.prompt_id,
            **hint,
        )
        hint = {"from_state": "submitted"} if known else {}
        any_store.transition(
            job.id,
            "rendering",
            owner="w1",
            via=Via(server="gpu0", attempt=1),
            number=7,
            now=102.0,
            detail="number 7",
            **hint,
        )

    def shape(job_id):
        rec = any_store.get(job_id)
        events = [
            (e.time, e.from_state, e.to_state, e.server, e.attempt, e.detail)
            for e in any_store.events(job_id=job_id)
        ]
        fields = (rec.state, rec.server, rec.number, rec.first_submitted_at, rec.claimed_by)
        return fields, events

    assert shape(fast.id) == shape(checked.id)
    assert shape(fast.id)[0] == ("rendering", "gpu0", 7, 101.0, "w1")
    assert len(moved) == 2 and all(moved)  # both moves went the way without a read


def test_a_move_from_a_wrong_known_state_or_by_another_owner_goes_the_checked_way(
    any_store, workflow_dir
):
    job = make_job(workflow_dir, 0)
    any_store.register_jobs("film", [job])
    assert any_store.claim(job.id, "w1", now=100.0) == "claimed"
    with pytest.raises(ClaimLost):
        any_store.transition(job.id, "submitted", owner="w2", from_state="pending")
    with pytest.raises(InvalidTransition):  # the job is pending, not submitted
        any_store.transition(job.id, "rendering", owner="w1", from_state="submitted")
    # Said to be rendering (from where submitted is not allowed) but really pending: the
    # checked way moves it.
    any_store.transition(job.id, "submitted", owner="w1", from_state="rendering")
    assert any_store.get(job.id).state == "submitted"
    assert [e.to_state for e in any_store.events(job_id=job.id)][-1] == "submitted"


def test_a_new_job_is_registered_claimed_and_a_known_one_only_registered(any_store, workflow_dir):
    job, other = make_jobs(workflow_dir, 2)
    found, rec = any_store.register_claimed("film", job, "w1", 60.0, now=100.0)
    assert (found.inserted, found.unchanged) == ([job.id], [])
    assert (rec.job_id, rec.state, rec.claimed_by, rec.claim_expires_at) == (
        job.id,
        "pending",
        "w1",
        160.0,
    )
    assert rec == any_store.get(job.id)  # the record claim_job would give
    events = any_store.events(job_id=job.id)
    assert [(e.from_state, e.to_state, e.detail) for e in events] == [
        (None, "pending", "registered")
    ]
    assert any_store.claim(job.id, "w2", now=101.0) == "held"
    # Known: registered as register_jobs does (a newer take wins), nothing claimed.
    found, rec = any_store.register_claimed("film", job, "w3", 60.0, now=102.0)
    assert (found.unchanged, rec) == ([job.id], None)
    assert any_store.get(job.id).claimed_by == "w1"
    any_store.register_jobs("other", [other])
    with pytest.raises(PartitionConflict):
        any_store.register_claimed("film", other, "w1")


def test_a_done_record_with_its_attempt_rendering_and_files_replaces_the_old_files(
    any_store, workflow_dir
):
    # On PostgreSQL the done record is the row lock and one statement (store/one_trip.py):
    # its rows must be what the checked way writes on SQLite.
    (job,) = make_jobs(workflow_dir, 1)
    any_store.register_claimed("film", job, "w1", 60.0, now=100.0)
    for attempt, names, at in ((1, ("a.png", "b.png"), 100.0), (2, ("b.png", "c.png"), 200.0)):
        if attempt == 2:
            any_store.transition(job.id, "pending", detail="fetching again", now=at)
            assert any_store.claim(job.id, "w1", now=at) == "claimed"
        any_store.transition(
            job.id,
            "submitted",
            owner="w1",
            from_state="pending",
            via=Via(server="gpu0"),
            now=at + 1,
        )
        any_store.mark_done(
            job.id,
            "w1",
            files=files(*names),
            via=Via(
                server="gpu0",
                attempt=attempt,
                tried=AttemptEntry(
                    attempt,
                    "success",
                    server="gpu0",
                    started_at=at + 1,
                    queue_wait_s=1.0,
                    models=("m.safetensors",),
                    model_loaded=True,
                ),
                rendering=RenderingStart("gpu0", attempt, attempt + 6, at + 2),
            ),
            number=attempt + 6,
            now=at + 5,
        )
    rec = any_store.get(job.id)
    assert (rec.state, rec.attempts, rec.number, rec.claimed_by) == ("succeeded", 2, 8, None)
    # Seconds from the first submission; both attempts' waits and GPU time.
    assert (rec.seconds, rec.queue_wait_s, rec.gpu_seconds) == (104.0, 2.0, 6.0)
    assert [(f.path, f.bytes) for f in any_store.files(job.id)] == [("b.png", 10), ("c.png", 11)]
    assert [(a.attempt, a.seconds) for a in any_store.attempts(job.id)] == [(1, 4.0), (2, 4.0)]
    assert [m.attempt for m in any_store.model_loads("film")] == [1, 2]
    events = [(e.time, e.from_state, e.to_state) for e in any_store.events(job_id=job.id)]
    assert events[-3:] == [
        (201.0, "pending", "submitted"),
        (202.0, "submitted", "rendering"),
        (205.0, "rendering", "succeeded"),
    ]
    ids = [e.id for e in any_store.events(job_id=job.id)]
    assert ids == sorted(ids)


def test_a_dead_letter_with_its_attempt_raises_the_attempts(any_store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    any_store.register_claimed("film", job, "w1", 60.0, now=100.0)
    any_store.transition(job.id, "submitted", owner="w1", from_state="pending", now=101.0)
    tried = AttemptEntry(1, "permanent", server="gpu0", started_at=101.0, reason="bad node")
    any_store.dead_letter(
        job.id,
        "w1",
        "bad node",
        via=Via(server="gpu0", attempt=1, tried=tried),
        now=103.0,
    )
    rec = any_store.get(job.id)
    assert (rec.state, rec.attempts, rec.reason, rec.claimed_by) == (
        "failed_fatal",
        1,
        "bad node",
        None,
    )
    assert [(a.attempt, a.outcome) for a in any_store.attempts(job.id)] == [(1, "permanent")]
    assert [e.to_state for e in any_store.events(job_id=job.id)][-1] == "failed_fatal"


def test_a_waiter_counts_only_for_the_servers_it_waits_for(any_store):
    # A pool leaves a freed server for another process only if that one could take it.
    any_store.mark_waiting("a", 60.0, ["gpu_0", "gpu1"])
    assert any_store.others_waiting("b", "gpu_0")
    assert any_store.others_waiting("b", "gpu1")
    assert not any_store.others_waiting("b", "gpuX0")  # "_" is no wildcard here
    assert not any_store.others_waiting("b", "gpu")
    assert not any_store.others_waiting("a", "gpu1")  # its own mark
    any_store.mark_waiting("c", 60.0)  # a process of an older version: any server
    assert any_store.others_waiting("b", "gpu9")


def test_a_store_made_before_a_column_existed_gets_it_when_opened(backend, any_store):
    with any_store.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE comfy_pool_waiters DROP COLUMN servers"))
    any_store.close()
    reopened = Store(*backend)
    try:
        reopened.mark_waiting("a", 60.0, ["gpu0"])
        assert reopened.others_waiting("b", "gpu0")
        assert not reopened.others_waiting("b", "gpu1")
    finally:
        reopened.close()
