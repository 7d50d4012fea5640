"""The render farm on one machine (``tests/farm``): GPU hosts, worker and orchestration
hosts in namespaces of their own, PostgreSQL and RabbitMQ on the database host, and what
must hold when a host is cut off, killed, renamed, skewed or its database restarted
(``tests/farm/invariants.py``). Needs root; skips with the reason otherwise."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.states import DONE
from comfy_assets.store import Store
from comfy_assets.store.owners import OWNER_BEAT_S, OWNER_DEAD_S
from tests.farm import Farm, Proc, invariants, unavailable
from tests.farm.host import NO_FAKETIME, libfaketime
from tests.farm.invariants import JobEnd, Snapshot
from tests.support import write_jobs

RUN_TIMEOUT_S = 90.0  # a process that has not ended by then fails the test (no measure)
WAIT_S = 60.0
# What a run or worker prints when it takes a claim whose holder is gone.
TAKEN = "claim taken over from"
WAITING = "waiting (taken over if its heartbeat stops"


def _skip_reason() -> str | None:
    try:
        return unavailable()
    except OSError as e:
        return f"the farm cannot be probed: {e}"


SKIP = _skip_reason()
needs_farm = pytest.mark.skipif(SKIP is not None, reason=f"no farm here: {SKIP}")


@pytest.fixture
def farm(tmp_path: Path) -> Iterator[Farm]:
    with Farm(tmp_path / "farm") as f:
        yield f


def run_cmd(farm: Farm, jobs: Path, store: Path, *extra: str) -> list[str]:
    """``comfy-assets run`` of ``jobs`` on every fake of the farm, the store's database
    the farm's; the job lease is the default one (the owners' heartbeats decide)."""
    return farm.python(
        "comfy_assets.cli", "run", "--jobs", str(jobs), "--store", str(store),
        "--db-url", farm.db_url, *farm.server_args(),
        "--attempts", "4", "--base-delay-s", "0.05", "--max-delay-s", "0.5",
        "--poll-s", "0.1", "--timeout-s", "60", "--server-lease-s", "3",
        "--probe-timeout-s", "1", "--unhealthy-wait-s", "0.2", *extra,
    )  # fmt: skip


def worker_cmd(farm: Farm, queue: str, store: Path, jobs: Path) -> list[str]:
    """``comfy-assets worker`` on ``queue``, the same knobs as ``run_cmd``."""
    return farm.python(
        "comfy_assets.cli", "worker", "--rabbitmq", farm.amqp_url, "--queue", queue,
        "--store", str(store), "--db-url", farm.db_url, "--workflows-dir", str(jobs.parent),
        "--partition", jobs.stem, *farm.server_args(),
        "--attempts", "4", "--base-delay-s", "0.05", "--max-delay-s", "0.5",
        "--poll-s", "0.1", "--timeout-s", "60", "--server-lease-s", "3", "--grace-s", "5",
    )  # fmt: skip


def schema(farm: Farm, store: Path) -> None:
    """The store's tables, made before several hosts race to use them."""
    Store(store, farm.local_db_url).close()


def jobs_table(farm: Farm) -> list[tuple[str, str, str | None, str | None]]:
    """(job_id, state, claimed_by, server) of every job: a read of the farm's database
    that never waits for it (an error while it restarts is an empty answer)."""
    engine = sa.create_engine(farm.local_db_url, connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT job_id, state, claimed_by, server FROM comfy_jobs")
            ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]
    except sa.exc.OperationalError:
        return []
    finally:
        engine.dispose()


def in_flight(farm: Farm, hostname: str) -> list[str]:
    """Jobs a process of host name ``hostname`` holds mid-attempt (submitted, rendering)."""
    return [
        job_id
        for job_id, state, holder, _ in jobs_table(farm)
        if state in ("submitted", "rendering") and (holder or "").startswith(f"{hostname}:")
    ]


def done_count(farm: Farm) -> int:
    return sum(1 for _, state, _, _ in jobs_table(farm) if state in DONE)


def finish(proc: Proc) -> int:
    """``proc``'s exit status; a process still running after ``RUN_TIMEOUT_S`` is killed
    and fails the test with its output."""
    try:
        return proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.signal(9)
        pytest.fail(f"{proc.name} still running after {RUN_TIMEOUT_S} s:\n{proc.text()[-4000:]}")


def check(
    farm: Farm, store: Path, jobs: Path, procs: list[Proc], *, results_csv: bool = True
) -> Snapshot:
    """Assert every invariant (``tests/farm/invariants.py``); returns the snapshot."""
    snapshot = invariants.collect(farm, store, jobs, results_csv=results_csv, procs=procs)
    found = invariants.violations(snapshot)
    outputs = "\n".join(f"--- {p.name}\n{p.text()[-3000:]}" for p in procs)
    assert not found, "\n".join(found) + "\n" + outputs
    return snapshot


def interrupted(snapshot: Snapshot) -> list[str]:
    """Prompts interrupted or lost on any fake."""
    return [
        f"{server}: {run['prompt_id']} {run['outcome']}"
        for server, s in snapshot.stats.items()
        for run in s["runs"]
        if run["outcome"] in ("interrupted", "lost")
    ]


# --- the scenarios ---------------------------------------------------------------------


@needs_farm
def test_a_gpu_host_cut_off_mid_prompt_then_back_renders_every_job_once(farm, tmp_path):
    gpus = [farm.add_gpu_host(f"gpu{i}", fakes=2, prompt_seconds=0.15) for i in (1, 2, 3)]
    orch = farm.add_host("orch")
    jobs = write_jobs(tmp_path / "jobs", 12, salt="cut-gpu")
    store = tmp_path / "store"
    run = orch.start(run_cmd(farm, jobs, store), name="run")
    victim = gpus[1]
    farm.wait(
        "a prompt of ours running on gpu2",
        lambda: any(f.queued() for f in victim.fakes),
        WAIT_S,
        poll_s=0.02,
        watch=[run],
    )
    victim.link(False)
    try:
        cut_off = [
            j
            for j, state, _, server in jobs_table(farm)
            if state in ("submitted", "rendering") and (server or "").startswith("gpu2")
        ]
        others = len(load_job_file(jobs).jobs) - len(cut_off)
        # The farm goes on without gpu2: every job not caught there is done meanwhile.
        farm.wait("the other jobs done", lambda: done_count(farm) >= others, WAIT_S, watch=[run])
    finally:
        victim.link(True)
    assert finish(run) == 0, run.text()
    check(farm, store, jobs, [run, *(f.proc for f in farm.fakes)])


@needs_farm
def test_a_worker_host_cut_from_the_database_posts_nothing_and_records_nothing_taken_from_it(
    farm, tmp_path
):
    farm.add_gpu_host("gpu1", fakes=2, prompt_seconds=0.25)
    farm.add_gpu_host("gpu2", fakes=2, prompt_seconds=0.25)
    jobs = write_jobs(tmp_path / "jobs", 10, salt="cut-db")
    store = tmp_path / "store"
    schema(farm, store)
    w1, w2 = farm.add_host("w1"), farm.add_host("w2")
    run1 = w1.start(run_cmd(farm, jobs, store), name="run")
    farm.wait("w1 mid-attempt", lambda: in_flight(farm, "w1"), WAIT_S, poll_s=0.02, watch=[run1])
    run2 = w2.start(run_cmd(farm, jobs, store), name="run")
    held = set(in_flight(farm, "w1"))
    w1.cut(farm.db_address)
    with Store(store, farm.local_db_url) as s:
        cut_at = s.now()
    try:
        farm.wait("w2 to take over w1's claims", lambda: TAKEN in run2.text(), WAIT_S, watch=[run2])
    finally:
        w1.heal(farm.db_address)
    with Store(store, farm.local_db_url) as s:
        healed_at = s.now()
    code1, code2 = finish(run1), finish(run2)
    assert code2 == 0, run2.text()
    assert code1 in (0, 1), run1.text()
    snapshot = check(farm, store, jobs, [run1, run2])
    # Once its heartbeat could not land for OWNER_DEAD_S - OWNER_BEAT_S, w1 posts nothing;
    # the jobs it held are posted by nobody else until w2 takes them (then caught up on).
    quiet_from = cut_at + OWNER_DEAD_S - OWNER_BEAT_S + 1.0
    prompts = {j.prompt_id for j in snapshot.jobs if j.job_id in held}
    with Store(store, farm.local_db_url) as s:
        taken = [
            e.time for job_id in held for e in s.events(job_id) if "taken over" in (e.detail or "")
        ]
    until = min(taken, default=healed_at)
    late = [
        f"{server}: {p['prompt_id']} at cut+{p['time'] - cut_at:.1f} s"
        for server, stats in snapshot.stats.items()
        for p in stats["posts"]
        if p["prompt_id"] in prompts and quiet_from <= p["time"] < until
    ]
    assert not late, f"w1 posted while cut from the database: {late}\n{run1.text()}"


@needs_farm
def test_a_worker_host_killed_mid_job_is_taken_over_by_a_new_worker(farm, tmp_path):
    farm.add_gpu_host("gpu1", fakes=2, prompt_seconds=0.25)
    farm.add_gpu_host("gpu2", fakes=2, prompt_seconds=0.25)
    jobs = write_jobs(tmp_path / "jobs", 8, salt="kill-worker")
    store = tmp_path / "store"
    schema(farm, store)
    queue = farm.queue("render")
    client = farm.add_host("client")
    enqueue = client.start(
        farm.python(
            "comfy_assets.cli",
            "enqueue",
            "--rabbitmq",
            farm.amqp_url,
            "--queue",
            queue,
            "--jobs",
            str(jobs),
        ),  # fmt: skip
        name="enqueue",
    )
    assert finish(enqueue) == 0, enqueue.text()
    w1 = farm.add_host("w1")
    worker1 = w1.start(worker_cmd(farm, queue, store, jobs), name="worker")
    farm.wait("w1 mid-attempt", lambda: in_flight(farm, "w1"), WAIT_S, poll_s=0.02, watch=[worker1])
    w1.kill()
    w2 = farm.add_host("w2")
    worker2 = w2.start(worker_cmd(farm, queue, store, jobs), name="worker")
    count = len(load_job_file(jobs).jobs)
    farm.wait("every job done", lambda: done_count(farm) == count, WAIT_S, watch=[worker2])
    worker2.signal(15)
    assert finish(worker2) == 0, worker2.text()
    assert TAKEN in worker2.text(), worker2.text()
    check(farm, store, jobs, [worker1, worker2], results_csv=False)


@needs_farm
def test_two_runs_of_one_host_name_in_pid_namespaces_of_their_own_take_nothing_from_each_other(
    farm, tmp_path
):
    # Long enough a batch for B to start and wait while A renders.
    for i in (1, 2):
        farm.add_gpu_host(f"gpu{i}", fakes=2, prompt_seconds=0.2)
    jobs = write_jobs(tmp_path / "jobs", 24, salt="same-name")
    store = tmp_path / "store"
    schema(farm, store)
    a, b = farm.add_host("a", hostname="vm"), farm.add_host("b", hostname="vm")
    run_a = a.start(run_cmd(farm, jobs, store), name="run")
    farm.wait("A mid-attempt", lambda: in_flight(farm, "vm"), WAIT_S, poll_s=0.02, watch=[run_a])
    # As in two containers started one after the other: on b, a process came and went
    # first, so B's pid is A's plus one, and A's pid is no process of b's namespace.
    assert finish(b.start(["true"], name="true")) == 0
    run_b = b.start(run_cmd(farm, jobs, store), name="run")
    farm.wait("B waiting for A's claims", lambda: WAITING in run_b.text(), WAIT_S, watch=[run_b])
    pids = (run_a.ns_pid, run_b.ns_pid)
    code_a, code_b = finish(run_a), finish(run_b)
    assert pids[0] is not None and pids[1] == pids[0] + 1, pids
    assert (code_a, code_b) == (0, 0), run_a.text() + run_b.text()
    for run in (run_a, run_b):
        assert TAKEN not in run.text(), run.text()
    snapshot = check(farm, store, jobs, [run_a, run_b])
    assert not interrupted(snapshot)


@needs_farm
def test_a_host_a_minute_ahead_steals_no_live_claim_and_takes_a_dead_hosts_at_once(farm, tmp_path):
    if libfaketime() is None:
        pytest.skip(f"a host's clock is set off with {NO_FAKETIME}, not installed")
    for i in (1, 2):
        farm.add_gpu_host(f"gpu{i}", fakes=2, prompt_seconds=0.25)
    jobs = write_jobs(tmp_path / "jobs", 24, salt="skew")
    store = tmp_path / "store"
    schema(farm, store)
    a, ahead = farm.add_host("a"), farm.add_host("ahead", clock_offset_s=60)
    run_a = a.start(run_cmd(farm, jobs, store), name="run")
    farm.wait("A mid-attempt", lambda: in_flight(farm, "a"), WAIT_S, poll_s=0.02, watch=[run_a])
    run_b = ahead.start(run_cmd(farm, jobs, store), name="run")
    farm.wait("B waiting for A's claims", lambda: WAITING in run_b.text(), WAIT_S, watch=[run_b])
    # B asks for A's claims every --poll-s: two more jobs of A done, and B has asked
    # many times while A was alive.
    done = done_count(farm)
    farm.wait("A going on", lambda: done_count(farm) >= done + 2, WAIT_S, watch=[run_a])
    farm.wait("A mid-attempt again", lambda: in_flight(farm, "a"), WAIT_S, watch=[run_a])
    assert TAKEN not in run_b.text(), run_b.text()
    a.kill()
    assert finish(run_b) == 0, run_b.text()
    assert TAKEN in run_b.text(), run_b.text()
    check(farm, store, jobs, [run_a, run_b])


@needs_farm
def test_the_database_host_restarted_mid_batch_loses_nothing_and_takes_nothing(farm, tmp_path):
    for i in (1, 2, 3):
        farm.add_gpu_host(f"gpu{i}", fakes=2, prompt_seconds=0.1)
    jobs = write_jobs(tmp_path / "jobs", 16, salt="db-restart")
    store = tmp_path / "store"
    schema(farm, store)
    a, b = farm.add_host("a"), farm.add_host("b")
    run_a = a.start(run_cmd(farm, jobs, store), name="run")
    run_b = b.start(run_cmd(farm, jobs, store), name="run")
    farm.wait(
        "a few jobs done", lambda: done_count(farm) >= 4, WAIT_S, poll_s=0.02, watch=[run_a, run_b]
    )
    farm.restart_database()
    code_a, code_b = finish(run_a), finish(run_b)
    assert (code_a, code_b) == (0, 0), run_a.text() + run_b.text()
    for run in (run_a, run_b):
        assert TAKEN not in run.text(), run.text()
    check(farm, store, jobs, [run_a, run_b])


# --- each invariant can fail ------------------------------------------------------------


def _run(prompt_id: str, posted: float, end: float | None, outcome: str | None = "success"):
    return {
        "prompt_id": prompt_id,
        "client_id": "comfy-assets-x",
        "word": "ok",
        "posted": posted,
        "start": posted,
        "last_message": end,
        "end": end,
        "outcome": outcome,
    }


def test_a_job_neither_done_nor_dead_lettered_is_a_violation():
    jobs = [
        JobEnd("j1", "p1", "pending"),
        JobEnd("j2", "p2", None),
        JobEnd("j3", "p3", "failed_fatal", reason=""),
        JobEnd("j4", "p4", "succeeded", files=0),
    ]
    found = invariants.ended(jobs)
    assert len(found) == 4, found
    assert not invariants.ended([JobEnd("j5", "p5", "succeeded", files=2)])


def test_a_prompt_that_succeeded_twice_or_elsewhere_than_recorded_is_a_violation():
    stats = {"gpu1s0": {"runs": [_run("p1", 1, 2)]}, "gpu2s0": {"runs": [_run("p1", 3, 4)]}}
    twice = invariants.once([JobEnd("j1", "p1", "succeeded", "gpu1s0", files=2)], stats)
    assert len(twice) == 1 and "2 times" in twice[0], twice
    one = {"gpu2s0": {"runs": [_run("p1", 3, 4)]}}
    elsewhere = invariants.once([JobEnd("j1", "p1", "succeeded", "gpu1s0", files=2)], one)
    assert len(elsewhere) == 1 and "gpu2s0" in elsewhere[0], elsewhere
    assert not invariants.once([JobEnd("j1", "p1", "succeeded", "gpu2s0", files=2)], one)


def test_a_prompt_posted_while_another_runs_on_that_server_is_a_violation():
    stats = {"gpu1s0": {"runs": [_run("p1", 1.0, 3.0), _run("p2", 2.0, 4.0)]}}
    assert len(invariants.one_at_a_time(stats)) == 1
    stats = {"gpu1s0": {"runs": [_run("p1", 1.0, 3.0), _run("p2", 3.5, 4.0)]}}
    assert not invariants.one_at_a_time(stats)


def test_a_prompt_left_queued_a_missing_csv_row_and_a_traceback_are_violations():
    assert invariants.nothing_queued({"gpu1s0": ["p1"], "gpu1s1": []}) == [
        "gpu1s0: prompts still queued or running at the end: ['p1']"
    ]
    jobs = [JobEnd("j1", "p1", "succeeded"), JobEnd("j2", "p2", "succeeded")]
    rows = [{"job_id": "j1", "state": "succeeded"}]
    assert len(invariants.results_rows(rows, jobs)) == 1
    rows = [{"job_id": "j1", "state": "succeeded"}, {"job_id": "j2", "state": "pending"}]
    assert len(invariants.results_rows(rows, jobs)) == 1
    assert invariants.no_tracebacks({"w1/run": "Traceback (most recent call last):\n  x"})
