"""The result store on SQLite: registration, claims, transitions, reading, server
leases, and claims raced by two processes (attempts and done records: test_store_records.py)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import traceback
import uuid
from pathlib import Path

import pytest

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import job_from_dict, load_job_file
from comfy_assets.jobs.states import InvalidTransition
from comfy_assets.store import (
    AttemptEntry,
    ClaimLost,
    OutputFile,
    PartitionConflict,
    Store,
    UnknownJob,
    Via,
)

SHA = "ab" * 32


def job_id(i: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"test-store:{i}"))


def make_job(folder: Path, i: int, *, color: int = 0, line: int | None = None, **fields) -> Job:
    obj = {"id": job_id(i), "workflow": "image.json", "set": {"1.color": color + i}, **fields}
    return job_from_dict(obj, base_dir=folder, source="test", line=i + 1 if line is None else line)


def make_jobs(folder: Path, n: int, **kwargs) -> list[Job]:
    return [make_job(folder, i, **kwargs) for i in range(n)]


def run_to_rendering(store: Store, job: Job, owner: str = "w1", now: float = 100.0) -> None:
    assert store.claim(job.id, owner, now=now) == "claimed"
    store.transition(
        job.id, "submitted", owner=owner, via=Via(server="gpu0", attempt=1), now=now + 1
    )
    store.transition(job.id, "rendering", via=Via(server="gpu0", attempt=1), number=7, now=now + 2)


def files(*names: str) -> list[OutputFile]:
    return [OutputFile(n, SHA, 10 + i, node_id="3", key="images") for i, n in enumerate(names)]


# --- registration ---------------------------------------------------------------------


def test_new_jobs_are_registered_pending_with_an_event(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    result = store.register_jobs("film", jobs, now=50.0)
    assert result.inserted == [j.id for j in jobs]
    assert result.unchanged == result.changed == []
    assert store.counts("film")["pending"] == 3
    rec = store.get(jobs[1].id)
    assert (rec.state, rec.attempts, rec.prompt_id, rec.partition) == (
        "pending",
        0,
        jobs[1].prompt_id,
        "film",
    )
    assert rec.set == {"1.color": 1}
    assert (rec.created_at, rec.updated_at) == (50.0, 50.0)
    (event,) = store.events(job_id=jobs[1].id)
    assert (event.from_state, event.to_state, event.detail, event.time) == (
        None,
        "pending",
        "registered",
        50.0,
    )


def test_registering_the_same_jobs_again_leaves_done_jobs_done(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 2)
    store.register_jobs("film", jobs)
    run_to_rendering(store, jobs[0])
    store.mark_done(jobs[0].id, "w1", files=files("a.png"), now=110.0)
    result = store.register_jobs("film", make_jobs(workflow_dir, 2))
    assert result.inserted == result.changed == []
    assert result.unchanged == [j.id for j in jobs]
    assert store.get(jobs[0].id).state == "succeeded"
    assert len(store.files(jobs[0].id)) == 1
    assert len(store.events(job_id=jobs[0].id)) == 4  # registered, submitted, rendering, done
    # A run started again resolves it from this answer, without claiming it.
    assert list(result.ended) == [jobs[0].id]
    assert result.ended[jobs[0].id] == store.get(jobs[0].id)


def test_a_done_job_registered_with_changed_inputs_is_not_ended(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 2)
    store.register_jobs("film", jobs)
    for job in jobs:
        run_to_rendering(store, job)
        store.mark_done(job.id, "w1", files=files("a.png"), now=110.0)
    edited = make_jobs(workflow_dir, 2, color=500)
    result = store.register_jobs("film", [edited[0], jobs[1]], now=200.0)
    assert list(result.ended) == [jobs[1].id]


def test_changed_inputs_reset_a_done_job_to_pending(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 2)
    store.register_jobs("film", jobs)
    run_to_rendering(store, jobs[0])
    store.record_attempt(jobs[0].id, AttemptEntry(1, "success", seconds=3.0), now=109.0)
    store.mark_done(jobs[0].id, "w1", files=files("a.png"), now=110.0)
    edited = make_jobs(workflow_dir, 2, color=500)
    result = store.register_jobs("film", [edited[0], jobs[1]], now=200.0)
    assert (result.changed, result.unchanged) == ([jobs[0].id], [jobs[1].id])
    rec = store.get(jobs[0].id)
    assert (rec.state, rec.attempts, rec.prompt_id, rec.set) == (
        "pending",
        0,
        edited[0].prompt_id,
        {"1.color": 500},
    )
    assert rec.finished_at is None and rec.seconds is None
    last = store.events(job_id=jobs[0].id)[-1]
    assert (last.from_state, last.to_state, last.detail) == (
        "succeeded",
        "pending",
        "inputs changed",
    )
    assert store.claim(jobs[0].id, "w2", now=201.0) == "claimed"


def test_changed_inputs_of_a_job_in_flight_abandon_the_old_attempt(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job, owner="old")
    (edited,) = make_jobs(workflow_dir, 1, color=9)
    assert store.register_jobs("film", [edited]).changed == [job.id]
    rec = store.get(job.id)
    assert (rec.state, rec.claimed_by, rec.prompt_id) == ("pending", None, edited.prompt_id)
    steps = [(e.from_state, e.to_state) for e in store.events(job_id=job.id)][-2:]
    assert steps == [("rendering", "failed_retryable"), ("failed_retryable", "pending")]
    # The old worker can no longer finish the job with outputs of the old inputs.
    with pytest.raises(ClaimLost, match="old does not hold the claim"):
        store.mark_done(job.id, "old", files=files("stale.png"))
    assert store.files(job.id) == []


def test_shot_and_line_changes_are_refreshed_without_a_state_change(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    moved = make_job(workflow_dir, 0, shot=4, line=9, optional=True)
    assert moved.prompt_id == job.prompt_id
    assert store.register_jobs("film", [moved]).unchanged == [job.id]
    rec = store.get(job.id)
    assert (rec.shot, rec.line, rec.optional, rec.state) == (4, 9, True, "pending")


def test_a_job_id_in_another_partition_is_refused_and_nothing_is_written(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    store.register_jobs("film-a", jobs[:1])
    with pytest.raises(PartitionConflict, match="film-a"):
        store.register_jobs("film-b", jobs)
    assert store.partitions() == ["film-a"]
    assert store.get(jobs[1].id) is None


def test_a_job_given_twice_is_refused(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    with pytest.raises(ValueError, match="given twice"):
        store.register_jobs("film", [job, job])


def test_ten_thousand_jobs_register_in_one_call(store, workflow_dir):
    lines = [
        {"id": str(uuid.UUID(int=i, version=4)), "workflow": "image.json", "set": {"1.color": i}}
        for i in range(10_000)
    ]
    path = workflow_dir / "big.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    jf = load_job_file(path)
    assert len(store.register_jobs("big", jf.jobs).inserted) == 10_000
    assert store.counts("big")["pending"] == 10_000
    assert len(store.events(partition="big")) == 10_000
    assert len(store.register_jobs("big", jf.jobs).unchanged) == 10_000


# --- claims ---------------------------------------------------------------------------


def test_claim_answers_claimed_held_done_and_dead_lettered(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    store.register_jobs("film", jobs)
    assert store.claim(jobs[0].id, "w1", now=100.0) == "claimed"
    assert store.claim(jobs[0].id, "w2", now=101.0) == "held"
    assert store.claim(jobs[0].id, "w1", now=102.0) == "claimed"  # ours already
    store.mark_done(jobs[0].id, "w1", files=files("x.png"), now=103.0)
    assert store.claim(jobs[0].id, "w2", now=104.0) == "done"
    assert store.claim(jobs[1].id, "w1", now=100.0) == "claimed"
    store.dead_letter(jobs[1].id, "w1", "bad prompt", now=101.0)
    assert store.claim(jobs[1].id, "w2", now=102.0) == "dead_lettered"


def test_claim_of_an_unknown_job_names_it(store):
    with pytest.raises(UnknownJob, match="job nope: not in the store"):
        store.claim("nope", "w1")


def test_two_store_objects_on_one_file_see_each_others_claims(tmp_path, workflow_dir):
    a, b = Store(tmp_path / "s"), Store(tmp_path / "s")
    jobs = make_jobs(workflow_dir, 2)
    a.register_jobs("film", jobs)
    assert a.claim(jobs[0].id, "a", now=100.0) == "claimed"
    assert b.claim(jobs[0].id, "b", now=100.5) == "held"
    assert b.claim(jobs[1].id, "b", now=100.5) == "claimed"
    assert a.claim(jobs[1].id, "a", now=100.5) == "held"
    a.close()
    b.close()


def test_renewing_keeps_a_claim_alive_past_its_first_expiry(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", lease_s=10.0, now=100.0)
    assert store.renew_claim(job.id, "w1", 10.0, now=108.0) is True
    assert store.claim(job.id, "w2", now=115.0) == "held"
    assert store.claim(job.id, "w2", now=118.0) == "claimed"


def test_release_frees_the_claim_only_for_its_owner(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", now=100.0)
    assert store.release_claim(job.id, "w2") is False
    assert store.claim(job.id, "w2", now=101.0) == "held"
    assert store.release_claim(job.id, "w1") is True
    assert store.claim(job.id, "w2", now=102.0) == "claimed"
    assert store.events(job_id=job.id)[-1].detail == "registered"  # a free claim, no takeover


# --- transitions ----------------------------------------------------------------------


def test_transition_updates_the_row_and_writes_event_and_log_line(store, workflow_dir, caplog):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", now=100.0)
    with caplog.at_level(logging.INFO, logger="comfy_assets.jobs.events"):
        store.transition(
            job.id, "submitted", owner="w1", via=Via(server="gpu1", attempt=1), now=101.0, number=12
        )
    rec = store.get(job.id)
    assert (rec.state, rec.server, rec.number, rec.first_submitted_at) == (
        "submitted",
        "gpu1",
        12,
        101.0,
    )
    event = store.events(job_id=job.id)[-1]
    assert (event.from_state, event.to_state, event.server, event.attempt, event.time) == (
        "pending",
        "submitted",
        "gpu1",
        1,
        101.0,
    )
    (record,) = [
        r
        for r in caplog.records
        if r.name == "comfy_assets.jobs.events" and r.event["id"] == event.id
    ]
    line = json.loads(record.getMessage())
    assert line == {
        "id": event.id,
        "time": 101.0,
        "job_id": job.id,
        "partition": "film",
        "from_state": "pending",
        "to_state": "submitted",
        "server": "gpu1",
        "attempt": 1,
        "detail": None,
    }


def test_a_bad_transition_is_rejected_and_changes_nothing(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    with pytest.raises(InvalidTransition, match="cannot go from pending to rendering"):
        store.transition(job.id, "rendering", now=101.0)
    assert store.get(job.id).state == "pending"
    assert len(store.events(job_id=job.id)) == 1


def test_the_transition_is_checked_against_the_database_not_the_caller(tmp_path, workflow_dir):
    a, b = Store(tmp_path / "s"), Store(tmp_path / "s")
    (job,) = make_jobs(workflow_dir, 1)
    a.register_jobs("film", [job])
    a.transition(job.id, "failed_fatal", reason="policy")
    with pytest.raises(InvalidTransition, match="from failed_fatal to submitted"):
        b.transition(job.id, "submitted")


def test_transition_with_owner_requires_the_claim(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    store.claim(job.id, "w1", now=100.0)
    with pytest.raises(ClaimLost, match="w2 does not hold the claim"):
        store.transition(job.id, "submitted", owner="w2")
    assert store.get(job.id).state == "pending"


def test_transition_rejects_an_unknown_field(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    with pytest.raises(TypeError, match="prompt"):
        store.transition(job.id, "submitted", prompt="x")


def test_a_fatal_transition_frees_the_claim(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)
    store.transition(job.id, "failed_fatal", reason="policy stop", now=120.0)
    rec = store.get(job.id)
    assert (rec.state, rec.claimed_by, rec.reason, rec.finished_at) == (
        "failed_fatal",
        None,
        "policy stop",
        120.0,
    )


# --- reading --------------------------------------------------------------------------


def test_jobs_are_listed_by_shot_then_line(store, workflow_dir):
    jobs = [
        make_job(workflow_dir, 0, shot=3),
        make_job(workflow_dir, 1),
        make_job(workflow_dir, 2, shot=1),
        make_job(workflow_dir, 3, shot=3),
        make_job(workflow_dir, 4),
    ]
    store.register_jobs("film", jobs)
    assert [(r.shot, r.line) for r in store.jobs("film")] == [
        (1, 3),
        (3, 1),
        (3, 4),
        (None, 2),
        (None, 5),
    ]


def test_what_happened_to_shot_17_is_one_call(store, workflow_dir):
    jobs = [make_job(workflow_dir, i, shot=i + 16) for i in range(3)]
    store.register_jobs("film", jobs)
    run_to_rendering(store, jobs[1])
    store.dead_letter(jobs[1].id, "w1", "IndexError in ImageToMask", now=105.0)
    story = [(e.to_state, e.detail) for e in store.events(partition="film", shot=17)]
    assert story == [
        ("pending", "registered"),
        ("submitted", None),
        ("rendering", None),
        ("failed_fatal", "IndexError in ImageToMask"),
    ]


def test_events_filter_by_partition(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    store.register_jobs("a", jobs[:1])
    store.register_jobs("b", jobs[1:])
    assert {e.job_id for e in store.events(partition="b")} == {jobs[1].id, jobs[2].id}
    assert len(store.events()) == 3
    ids = [e.id for e in store.events()]
    assert ids == sorted(ids)


def test_counts_list_every_state_and_partitions_are_sorted(store, workflow_dir):
    jobs = make_jobs(workflow_dir, 3)
    store.register_jobs("zeta", jobs[:2])
    store.register_jobs("alpha", jobs[2:])
    store.transition(jobs[0].id, "failed_fatal")
    assert store.counts("zeta") == {
        "pending": 1,
        "submitted": 0,
        "rendering": 0,
        "succeeded": 0,
        "degraded": 0,
        "failed_retryable": 0,
        "failed_fatal": 1,
    }
    assert store.partitions() == ["alpha", "zeta"]
    assert store.get("unknown") is None


def test_job_dir_is_root_partition_job(store):
    assert store.job_dir("film", "abc") == store.root / "film" / "abc"
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="cannot be used as a folder name"):
            store.job_dir(bad, "abc")


# --- server leases --------------------------------------------------------------------


def test_a_server_is_held_by_one_owner_until_released_or_expired(store):
    assert store.acquire_server("gpu0", "a", 30.0, prompt_id="p1", now=100.0) is True
    assert store.acquire_server("gpu0", "b", 30.0, now=110.0) is False
    assert store.acquire_server("gpu0", "a", 30.0, prompt_id="p2", now=111.0) is True  # ours
    lease = store.server_leases()["gpu0"]
    assert (lease.owner, lease.expires_at, lease.prompt_id) == ("a", 141.0, "p2")
    assert lease.held(now=140.0) and not lease.held(now=141.0)
    assert store.release_server("gpu0", "b") is False
    assert store.release_server("gpu0", "a", last_model="sdxl.safetensors") is True
    lease = store.server_leases()["gpu0"]
    assert (lease.owner, lease.prompt_id, lease.last_model) == (None, None, "sdxl.safetensors")
    assert store.acquire_server("gpu0", "b", 30.0, now=112.0) is True
    assert store.server_leases()["gpu0"].last_model == "sdxl.safetensors"


def test_an_expired_server_lease_goes_to_the_next_owner(tmp_path):
    a, b = Store(tmp_path / "s"), Store(tmp_path / "s")
    assert a.acquire_server("gpu0", "a", 5.0, now=100.0)
    assert b.renew_server("gpu0", "b", 5.0, now=101.0) is False
    assert a.renew_server("gpu0", "a", 5.0, now=104.0) is True  # now until 109
    assert b.acquire_server("gpu0", "b", 5.0, now=108.9) is False
    assert b.acquire_server("gpu0", "b", 5.0, now=109.0) is True
    assert a.renew_server("gpu0", "a", 5.0, now=109.5) is False
    assert a.release_server("gpu0", "a") is False
    assert b.server_leases()["gpu0"].owner == "b"


# --- two processes --------------------------------------------------------------------


def claim_race(root: str, db_url: str | None, owner: str, ids: list[str], barrier, out) -> None:
    """Child process: for each job, wait for the other process, then both claim it."""
    store = Store(Path(root), db_url)
    got = []
    for job in ids:
        barrier.wait()
        if store.claim(job, owner, lease_s=3600.0) == "claimed":
            got.append(job)
    store.close()
    out.put((owner, got))


def lease_race(root: str, db_url: str | None, owner: str, rounds: int, barrier, out) -> None:
    """Child process: each round, both processes try to take the free gpu0 at once; the
    winner renews and releases it. Reports the rounds won and renewals lost."""
    store = Store(Path(root), db_url)
    won, lost = [], 0
    for r in range(rounds):
        barrier.wait()  # gpu0 is free
        if store.acquire_server("gpu0", owner, 60.0):
            won.append(r)
        barrier.wait()  # both have tried
        if won and won[-1] == r:
            lost += not store.renew_server("gpu0", owner, 60.0)
            store.release_server("gpu0", owner)
        barrier.wait()  # released before the next round
    store.close()
    out.put((owner, won, lost))


def _child(target, root: str, db_url: str | None, owner: str, arg, barrier, out) -> None:
    try:
        target(root, db_url, owner, arg, barrier, out)
    except BaseException:
        barrier.abort()  # the other process stops waiting instead of hanging
        out.put((owner, "error", traceback.format_exc()))
        raise


def in_two_processes(target, root: Path, db_url: str | None, arg: object) -> dict[str, tuple]:
    """Run ``target(root, db_url, owner, arg, barrier, out)`` as p1 and p2 at once;
    returns owner -> the rest of what each put on ``out``."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2, timeout=60), ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(target, str(root), db_url, o, arg, barrier, out))
        for o in ("p1", "p2")
    ]
    for p in procs:
        p.start()
    try:
        messages = [out.get(timeout=90) for _ in procs]  # one each: a result or an error
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    errors = [f"process {m[0]} failed:\n{m[2]}" for m in messages if m[1] == "error"]
    if errors:
        pytest.fail("\n".join(errors))
    assert [p.exitcode for p in procs] == [0, 0]
    return {owner: tuple(rest) for owner, *rest in messages}


def test_two_processes_racing_claim_each_job_exactly_once(tmp_path, workflow_dir):
    store = Store(tmp_path / "s")
    jobs = make_jobs(workflow_dir, 8)
    store.register_jobs("film", jobs)
    ids = [j.id for j in jobs]
    results = in_two_processes(claim_race, tmp_path / "s", None, ids)
    (p1,), (p2,) = results["p1"], results["p2"]
    assert sorted(p1 + p2) == sorted(ids)
    assert not set(p1) & set(p2)
    for owner, got in (("p1", p1), ("p2", p2)):
        assert all(store.get(j).claimed_by == owner for j in got)


def test_two_processes_never_hold_one_server_at_once(tmp_path):
    Store(tmp_path / "s").close()
    results = in_two_processes(lease_race, tmp_path / "s", None, 40)
    (won1, lost1), (won2, lost2) = results["p1"], results["p2"]
    assert sorted(won1 + won2) == list(range(40))  # every round exactly one winner
    assert (lost1, lost2) == (0, 0)


def test_a_requeued_job_numbers_its_attempts_on_and_keeps_the_earlier_ones(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    run_to_rendering(store, job)
    store.record_attempt(job.id, AttemptEntry(1, "permanent", seconds=4.0, reason="IndexError"))
    store.dead_letter(job.id, "w1", "IndexError")
    assert store.requeue(job.id)
    rec = store.get(job.id)
    assert (rec.attempts, rec.attempts_before) == (0, 1)
    run_to_rendering(store, job, now=200.0)
    store.record_attempt(job.id, AttemptEntry(rec.attempts_before + 1, "success", seconds=2.0))
    assert [(a.attempt, a.outcome, a.seconds) for a in store.attempts(job.id)] == [
        (1, "permanent", 4.0),
        (2, "success", 2.0),
    ]
    assert store.get(job.id).attempts == 1  # the new budget counts one try


def test_claim_job_returns_the_record_as_the_claim_left_it(store, workflow_dir):
    (job,) = make_jobs(workflow_dir, 1)
    store.register_jobs("film", [job])
    status, rec = store.claim_job(job.id, "w1", lease_s=10.0, now=100.0)
    assert (status, rec.claimed_by, rec.claim_expires_at, rec.state) == (
        "claimed",
        "w1",
        110.0,
        "pending",
    )
    assert store.get(job.id).claimed_by == "w1"
    status, rec = store.claim_job(job.id, "w2", lease_s=10.0, now=105.0)
    assert (status, rec.claimed_by) == ("held", "w1")
