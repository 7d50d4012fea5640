"""Store records to film shots, policy and cost inputs, after real renders on the fake."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.film.gate import gate
from comfy_assets.film.probe import probe
from comfy_assets.film.shots import (
    attempt_costs,
    attempt_seconds,
    bad_shot_lines,
    film_cost_report,
    film_path,
    film_policy,
    has_shots,
    shots_from_store,
)
from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.run import run_batch_sync
from comfy_assets.store import AttemptRecord, Store
from fake_comfy import FakeComfy
from tests.support import fast_config, write_jobs

REPO = Path(__file__).resolve().parents[2]
PARTITION = "storyboard"
SHOT_SECONDS = [1.0, 1.5, 2.0, 1.0, 1.25, 1.0]


def render(
    job_file: JobFile, store: Store, script: list[str], config: BatchConfig | None = None
) -> FakeComfy:
    """Render the file on one fake server (prompts run in line order); returns the fake."""
    fake = FakeComfy(script=script, prompt_seconds=0.005)
    with fake.serve_in_thread(port=0) as url:
        run_batch_sync(
            job_file,
            partition=PARTITION,
            servers=[ServerSpec("gpu0", url)],
            store=store,
            config=config or fast_config(),
        )
    return fake


@contextmanager
def rendered(
    storyboard: Path, tmp_path: Path, script: list[str]
) -> Iterator[tuple[JobFile, Store]]:
    """The storyboard rendered (``render``, the fake following ``script``) into a store at
    ``tmp_path/store``; yields the job file and the open store."""
    job_file = load_job_file(storyboard)
    with Store(tmp_path / "store") as store:
        render(job_file, store, script)
        yield job_file, store


def test_shots_follow_the_job_file_and_take_state_and_files_from_the_store(
    storyboard: Path, tmp_path: Path
) -> None:
    # Delivery: the render stops after shot 3.
    with rendered(storyboard, tmp_path, ["ok", "ok", "error"]) as (job_file, store):
        shots = shots_from_store(store, PARTITION, job_file)

    assert [s.shot for s in shots] == [1, 2, 3, 4, 5, 6]
    assert [s.job_id for s in shots] == [job.id for job in job_file.jobs]
    assert [s.duration_s for s in shots] == SHOT_SECONDS
    for s, seconds in zip(shots[:2], SHOT_SECONDS, strict=False):
        assert s.state == "succeeded"
        (path,) = s.files
        assert path.is_relative_to(tmp_path / "store" / PARTITION / s.job_id)
        assert probe(path).duration_s == pytest.approx(seconds, abs=1 / 24)
    assert (shots[2].state, shots[2].files) == ("failed_fatal", [])
    assert "IndexError" in shots[2].reason
    assert {s.state for s in shots[3:]} == {"pending"}


def test_a_shot_rendered_with_other_inputs_is_pending_and_its_old_file_unused(
    storyboard: Path, tmp_path: Path
) -> None:
    with Store(tmp_path / "store") as store:
        render(load_job_file(storyboard), store, [])
        lines = storyboard.read_text().splitlines()
        shot2 = json.loads(lines[2])
        shot2["set"]["1.color"] = 0x00FF00
        lines[2] = json.dumps(shot2)
        storyboard.write_text("\n".join(lines) + "\n")
        changed = load_job_file(storyboard)  # not rendered again: the store has old inputs
        shots = shots_from_store(store, PARTITION, changed)
        result = gate(shots, film_policy(changed))

    assert (shots[1].state, shots[1].files) == ("pending", [])
    assert shots[1].reason == "its inputs changed since it was rendered"
    assert [s.state for s in shots if s.shot != 2] == ["succeeded"] * 5
    assert result.blocked == [2]
    assert bad_shot_lines(result) == [
        f"shot 2 (job {changed.jobs[1].id}): blocked: not finished: pending"
    ]


def test_a_partition_that_never_saw_the_jobs_has_every_shot_pending(
    storyboard: Path, tmp_path: Path
) -> None:
    with rendered(storyboard, tmp_path, []) as (job_file, store):
        shots = shots_from_store(store, "another", job_file)

    assert [(s.state, s.files) for s in shots] == [("pending", [])] * 6
    assert shots[0].reason == "not in the store under partition 'another'"


def test_jobs_without_a_shot_number_are_not_shots(tmp_path: Path) -> None:
    path = write_jobs(
        tmp_path / "mixed",
        3,
        workflow="video_shot.json",
        extra=[{"shot": 2, "duration_s": 1.0}, {}, {"shot": 1, "duration_s": 1.0}],
    )
    job_file = load_job_file(path)
    stills = load_job_file(write_jobs(tmp_path / "stills", 2))
    with Store(tmp_path / "store") as store:
        shots = shots_from_store(store, PARTITION, job_file)

    assert [(s.shot, s.job_id) for s in shots] == [
        (2, job_file.jobs[0].id),
        (1, job_file.jobs[2].id),
    ]
    assert has_shots(job_file) and not has_shots(stills)


def test_a_broken_shot_file_in_the_store_is_blocked_with_its_reason(
    storyboard: Path, tmp_path: Path
) -> None:
    with rendered(storyboard, tmp_path, []) as (job_file, store):
        shots = shots_from_store(store, PARTITION, job_file)
    (shot4,) = shots[3].files
    shot4.write_bytes(shot4.read_bytes()[:-300])  # cut the end off

    delivery = gate(shots, film_policy(job_file))
    draft = gate(shots, film_policy(job_file, "draft"))

    assert delivery.blocked == [4]
    assert "truncated" in delivery.verdicts[3].reason
    assert (draft.passed, draft.placeholders) == (True, [4])
    assert shot4.is_file()  # judging never deletes a shot's file


def test_the_run_config_policy_wins_and_the_tolerance_comes_from_the_header(
    storyboard: Path,
) -> None:
    lines = storyboard.read_text().splitlines()
    lines[0] = json.dumps({"header": {"policy": "draft", "duration_tolerance": 0.25}})
    storyboard.write_text("\n".join(lines) + "\n")
    job_file = load_job_file(storyboard)

    assert film_policy(job_file).mode == "draft"
    assert film_policy(job_file, "delivery").mode == "delivery"
    assert film_policy(job_file, "delivery").duration_tolerance == 0.25
    with pytest.raises(ValueError, match="policy mode"):
        film_policy(job_file, "final")


def test_attempt_costs_count_successful_and_wasted_attempts(
    storyboard: Path, tmp_path: Path
) -> None:
    job_file = load_job_file(storyboard)
    # Draft: every shot runs. Shot 1's first post is answered 500 and retried; the
    # fifth post fails for good.
    script = ["500", "ok", "ok", "ok", "error"]
    with Store(tmp_path / "store") as store:
        render(job_file, store, script, fast_config(policy="draft"))
        costs = attempt_costs(store, [job.id for job in job_file.jobs])
        report = film_cost_report(store, job_file)

    outcomes = [(c.job_id, c.outcome) for c in costs]
    first = job_file.jobs[0].id
    # Shot 1 is tried again; whichever shot the fifth POST carried (which one depends on
    # how the consumers take turns, shot 1's second try included) failed for good.
    assert [outcome for job_id, outcome in outcomes if job_id == first][0] == "transient"
    assert [job_id for job_id, _ in outcomes].count(first) == 2
    assert sorted(outcome for _, outcome in outcomes) == ["permanent"] + ["success"] * 5 + [
        "transient"
    ]
    assert len(costs) == 7
    assert all(c.seconds >= 0 for c in costs)
    assert report is not None
    assert (report["attempts"], report["failed_attempts"]) == (7, 2)
    assert (report["transient_failures"], report["permanent_failures"]) == (1, 1)
    assert report["shots"] == 6
    assert report["gpu_seconds"] == pytest.approx(
        report["gpu_seconds_success"] + report["gpu_seconds_wasted"], abs=0.11
    )


def test_a_requeued_shot_keeps_the_gpu_time_its_failed_attempt_wasted(
    storyboard: Path, tmp_path: Path
) -> None:
    with rendered(storyboard, tmp_path, ["ok"] * 5 + ["error"]) as (job_file, store):
        assert store.requeue(job_file.jobs[5].id)
        render(job_file, store, [])
        report = film_cost_report(store, job_file)

    assert report is not None
    assert (report["attempts"], report["permanent_failures"]) == (7, 1)


def test_no_attempt_means_no_cost_report(storyboard: Path, tmp_path: Path) -> None:
    with Store(tmp_path / "store") as store:
        assert film_cost_report(store, load_job_file(storyboard)) is None


def attempt(**fields: object) -> AttemptRecord:
    values: dict = dict(
        job_id="j",
        attempt=1,
        server="gpu0",
        prompt_id="p",
        number=1,
        started_at=0.0,
        ended_at=10.0,
        seconds=10.0,
        queue_wait_s=4.0,
        gpu_seconds=None,
        outcome="success",
        reason=None,
    )
    values.update(fields)
    return AttemptRecord(**values)


def test_attempt_seconds_are_the_server_run_time_else_wall_time_minus_queue_wait() -> None:
    assert attempt_seconds(attempt(gpu_seconds=5.5)) == 5.5
    assert attempt_seconds(attempt()) == 6.0
    assert attempt_seconds(attempt(queue_wait_s=None)) == 10.0
    assert attempt_seconds(attempt(queue_wait_s=12.0)) == 0.0  # clock skew never goes negative


def test_the_film_goes_in_the_partition_folder(tmp_path: Path) -> None:
    assert film_path(tmp_path, "reel") == tmp_path / "reel" / "film.mp4"
