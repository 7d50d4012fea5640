"""The campaign's invariant checker fails on bad records: one clean schedule is played
once, then each test breaks one thing in a copy of what it left and expects the
violation that names it."""

from __future__ import annotations

import copy
import csv
import dataclasses
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import load_job_file
from tests.campaign.invariants import violations
from tests.campaign.play import Played, play
from tests.campaign.schedule import PICTURES, JobPlan, Schedule, ServerPlan

# An image job, a job inverting an input picture, and one chained from the image job's
# solid output.
CLEAN = Schedule(
    seed=0,
    jobs=3,
    servers=(ServerPlan(script=()),),
    mode="run",
    lines=(JobPlan(), JobPlan("picture", picture=0), JobPlan("chained", upstream=0, node="3")),
)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Played, Path]:
    folder = tmp_path_factory.mktemp("clean")
    played = play(CLEAN, folder)
    assert violations(played) == []
    return played, folder


def broken(
    clean: tuple[Played, Path], tmp_path: Path, change: Callable[[Played], None]
) -> list[str]:
    """The violations of a copy of the clean schedule's records after ``change``."""
    played, folder = clean
    copied = tmp_path / "copy"
    shutil.copytree(folder, copied)
    mine = copy.deepcopy(played)
    for phase in mine.phases:
        phase.store = copied / phase.store.relative_to(folder)
        phase.job_files = [copied / j.relative_to(folder) for j in phase.job_files]
        for run in phase.runs:
            run.jobs = copied / run.jobs.relative_to(folder)
    change(mine)
    return violations(mine)


def jobs(played: Played) -> list[Job]:
    return load_job_file(played.phases[0].job_files[0]).jobs


def job_ids(played: Played) -> list[str]:
    return [j.id for j in jobs(played)]


def post_time(played: Played, prompt_id: str) -> float:
    (at,) = [p["time"] for p in played.stats["gpu0"]["posts"] if p["prompt_id"] == prompt_id]
    return at


def sql(played: Played, statement: str, *args: object) -> None:
    with sqlite3.connect(played.phases[0].store / "store.db") as db:
        db.execute(statement, args)


def test_a_clean_schedule_has_no_violation(clean, tmp_path):
    assert broken(clean, tmp_path, lambda p: None) == []


def test_the_clean_schedule_uploads_its_inputs_and_posts_each_job_once(clean):
    played, _ = clean
    stats = played.stats["gpu0"]
    # The picture, and the image job's solid output for the chained job.
    assert stats["uploads"] == 2
    assert [p["prompt_id"] for p in stats["posts"]].count(jobs(played)[2].prompt_id) == 1
    assert len(stats["posts"]) == 3


def test_a_traceback_in_a_runs_output_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        p.phases[0].runs[0].stderr += "Traceback (most recent call last):\n  boom\n"

    (found,) = broken(clean, tmp_path, change)
    assert "traceback on stderr" in found


def test_a_repr_in_a_runs_output_is_a_violation(clean, tmp_path):
    line = "server gpu1 unreachable: connection lost (<RawResponseMessage(version=...)>)"

    def change(p: Played) -> None:
        p.phases[0].runs[0].stdout += line + "\n"

    (found,) = broken(clean, tmp_path, change)
    assert found.endswith(f"a repr on stdout: {line}")


def test_a_repr_in_a_jobs_event_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        sql(
            p,
            "UPDATE comfy_events SET detail = ? WHERE job_id = ? AND to_state = 'succeeded'",
            "done after <ClientResponse object at 0x7f3a2c>",
            job_ids(p)[0],
        )

    (found,) = broken(clean, tmp_path, change)
    assert "a repr in its reason or events: done after <ClientResponse object at 0x7f3a2c>" in found


def test_a_line_or_an_event_of_a_megabyte_is_a_violation(clean, tmp_path):
    huge = "execution_error in node 3 (SaveImage): OSError: File name too long: " + "p" * 2**20

    def change(p: Played) -> None:
        p.phases[0].runs[0].stdout += huge + "\n"
        sql(
            p,
            "UPDATE comfy_events SET detail = ? WHERE job_id = ? AND to_state = 'succeeded'",
            huge,
            job_ids(p)[0],
        )

    line, event = broken(clean, tmp_path, change)
    assert f"run 1: a line of {len(huge)} characters on stdout: execution_error" in line
    assert f": a reason or event of {len(huge)} characters: execution_error" in event
    assert len(line) < 500 and len(event) < 500


@pytest.mark.parametrize(
    "dead",
    [
        [],  # never dead-lettered
        ["job 1: dead-lettered, our error while handling this job: UnicodeEncodeError: ..."],
    ],
)
def test_a_hostile_message_not_refused_as_invalid_is_a_violation(clean, tmp_path, dead):
    def change(p: Played) -> None:
        p.schedule = dataclasses.replace(p.schedule, hostile="\x00")
        p.phases[0].worker = {"acked": 1, "messages": 1, "hostile": dead}

    (found,) = broken(clean, tmp_path, change)
    assert found.startswith("worker: the hostile message not dead-lettered as invalid")

    def refused(p: Played) -> None:
        change(p)
        reason = "invalid job: jobs message 1:1: set.1.color: holds a NUL character (U+0000), ..."
        p.phases[0].worker = {"acked": 1, "messages": 1, "hostile": [reason]}

    assert broken(clean, tmp_path / "refused", refused) == []


def test_a_file_whose_bytes_changed_in_the_store_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        job = job_ids(p)[0]
        folder = p.phases[0].store / "jobs" / job
        next(folder.glob("solid_*.png")).write_bytes(b"not the render")

    (found,) = broken(clean, tmp_path, change)
    assert "sha256 differs from its done record" in found


def test_a_file_that_is_not_the_servers_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        served = p.phases[0].server_bytes["gpu0"]
        name = next(n for n in served if n.startswith("solid_"))
        served[name] = "0" * 64

    (found,) = broken(clean, tmp_path, change)
    assert "is not gpu0's file" in found


def test_a_job_left_pending_is_a_violation_and_so_is_exit_0(clean, tmp_path):
    def change(p: Played) -> None:
        sql(p, "UPDATE comfy_jobs SET state = 'pending' WHERE job_id = ?", job_ids(p)[1])

    found = broken(clean, tmp_path, change)
    assert any("ended pending, neither done nor a dead letter" in f for f in found), found
    assert any("exit 0, expected 1" in f for f in found), found
    assert any("results.csv says" in f for f in found), found


def test_a_dead_letter_whose_reason_names_no_fault_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        sql(
            p,
            "UPDATE comfy_jobs SET state = 'failed_fatal', reason = 'something happened' "
            "WHERE job_id = ?",
            job_ids(p)[0],
        )
        p.phases[0].runs[0].returncode = 1
        path = p.phases[0].store / "jobs" / "results.csv"
        rows = list(csv.DictReader(path.open()))
        rows[0]["state"] = "failed_fatal"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    (found,) = broken(clean, tmp_path, change)
    assert "dead letter names no fault: 'something happened'" in found


def test_a_second_success_no_event_explains_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        runs = p.stats["gpu0"]["runs"]
        twice = copy.deepcopy(runs[0])
        twice["posted"] = twice["start"] = runs[-1]["end"] + 1
        twice["end"] = twice["start"] + 0.01
        runs.append(twice)
        p.phases[0].end_run[0] += 1

    (found,) = broken(clean, tmp_path, change)
    assert "succeeded 2 times, no event says why" in found


def test_a_prompt_posted_while_another_of_ours_runs_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        first, second = p.stats["gpu0"]["runs"][:2]
        second["posted"] = (first["start"] + first["end"]) / 2

    (found,) = broken(clean, tmp_path, change)
    assert "was queued or running" in found


def test_a_late_prompt_holds_the_server_until_its_execution_success_only(clean, tmp_path):
    def change(p: Played) -> None:
        first, second = p.stats["gpu0"]["runs"][:2]
        first["word"] = "late"
        first["last_message"] = second["posted"] - 0.01  # execution_success, then the POST
        first["end"] = second["posted"] + 0.4  # history written after the next POST

    def too_soon(p: Played) -> None:
        change(p)
        first, second = p.stats["gpu0"]["runs"][:2]
        first["last_message"] = second["posted"] + 0.05  # still executing at the POST

    assert broken(clean, tmp_path / "after", change) == []
    (found,) = broken(clean, tmp_path / "during", too_soon)
    assert "was queued or running" in found


def test_our_prompt_left_on_a_server_and_a_busy_server_are_violations(clean, tmp_path):
    def change(p: Played) -> None:
        p.ours_left["gpu0"] = ["a-prompt-id"]
        p.not_idle["gpu0"] = "not idle within 10 s"

    found = broken(clean, tmp_path, change)
    assert len(found) == 2
    assert "our prompts still queued or running at the end: ['a-prompt-id']" in found[0]


def test_a_missing_results_row_and_a_run_that_never_ended_are_violations(clean, tmp_path):
    def change(p: Played) -> None:
        path = p.phases[0].store / "jobs" / "results.csv"
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines[:-1]) + "\n")
        p.phases[0].runs[0].timed_out = True

    found = broken(clean, tmp_path, change)
    assert any("results.csv rows 2 are not the 3 jobs" in f for f in found), found
    assert any("did not end within the harness's timeout" in f for f in found), found


def test_a_post_before_its_input_picture_was_uploaded_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        job = jobs(p)[1]
        (name,) = [n for n in p.stats["gpu0"]["uploaded"] if job.inputs[0].sha256 in n]
        p.stats["gpu0"]["uploaded"][name]["first"] = post_time(p, job.prompt_id) + 0.2

    (found,) = broken(clean, tmp_path, change)
    picture = jobs(clean[0])[1].inputs[0]
    assert picture.path == PICTURES[0]
    assert found.endswith(
        f"before input 1.image was uploaded there as comfy_assets/{picture.sha256}.png "
        "(first uploaded 0.200 s after the POST)"
    )


def test_a_post_whose_upstream_file_was_never_uploaded_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        uploaded = p.stats["gpu0"]["uploaded"]
        picture = jobs(p)[1].inputs[0].sha256
        (name,) = [n for n in uploaded if picture not in n]  # the upstream's solid image
        del uploaded[name]

    (found,) = broken(clean, tmp_path, change)
    chained = jobs(clean[0])[2]
    assert f"job {chained.id}: prompt {chained.prompt_id} posted to gpu0 before input " in found
    assert found.endswith("(never uploaded)")


def test_a_chained_job_posted_before_its_upstream_succeeded_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        upstream, _, chained = jobs(p)
        sql(
            p,
            "UPDATE comfy_events SET time = ? WHERE job_id = ? AND to_state = 'succeeded'",
            post_time(p, chained.prompt_id) + 0.5,
            upstream.id,
        )

    (found,) = broken(clean, tmp_path, change)
    upstream, _, chained = jobs(clean[0])
    assert found.endswith(
        f"job {chained.id}: prompt {chained.prompt_id} posted to gpu0 before job "
        f"{upstream.id} it continues from was done (it succeeded 0.500 s after the POST)"
    )


def test_a_chained_job_posted_while_its_upstream_never_succeeded_is_a_violation(clean, tmp_path):
    def change(p: Played) -> None:
        sql(
            p, "DELETE FROM comfy_events WHERE job_id = ? AND to_state = 'succeeded'", job_ids(p)[0]
        )

    (found,) = broken(clean, tmp_path, change)
    assert found.endswith("it continues from was done (it never succeeded)")
