"""``comfy-assets requeue`` and ``events`` in process, over a store a run against an
in-thread fake left: exit codes, printed lines, and what was rendered again."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from comfy_assets.cli import events as events_cli
from comfy_assets.cli.main import main
from tests.cli.test_cli_commands import ISO_UTC, run
from tests.support import ROOT, job_id, write_jobs

# --- requeue ---------------------------------------------------------------------------


def test_requeue_needs_store(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["requeue", job_id(0)])
    assert exited.value.code == 2
    assert "--store" in capsys.readouterr().err


def test_requeue_on_a_folder_without_a_store_is_exit_2_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "typo"

    assert main(["requeue", job_id(0), "--store", str(folder)]) == 2

    assert capsys.readouterr().err == f"error: no result store at {folder} (no store.db)\n"
    assert not folder.exists()


def test_requeue_names_ids_that_are_not_lowercase_uuids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = job_id(0)
    argv = ["requeue", good, "job-7", good.upper(), "--store", str(tmp_path)]

    assert main(argv) == 2

    err = capsys.readouterr().err
    assert err == f"error: not a job id (a lowercase UUID): job-7, {good.upper()}\n"
    assert not (tmp_path / "store.db").exists()


def test_requeue_of_a_job_that_is_not_a_dead_letter_is_exit_1(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    assert run(jobs, tmp_path / "store", url) == 0
    capsys.readouterr()

    done, unknown = job_id(0, "jobs.jsonl"), job_id(99)
    assert main(["requeue", done, unknown, "--store", str(tmp_path / "store")]) == 1

    assert capsys.readouterr().err.splitlines() == [
        f"job {done}: neither a dead letter nor degraded (succeeded)",
        f"job {unknown}: no such job in the store",
    ]


# --- events ----------------------------------------------------------------------------


@pytest.fixture
def storyboard_store(tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]) -> Path:
    """A store where three jobs with shots 1, 2 and 3 were rendered (partition "jobs")."""
    extra = [{"shot": shot, "duration_s": 1.0} for shot in (1, 2, 3)]
    jobs = write_jobs(tmp_path / "jobs", 3, extra=extra)
    assert run(jobs, tmp_path / "store", url) == 0
    capsys.readouterr()
    return tmp_path / "store"


def test_events_of_a_job_are_one_line_each_oldest_first(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_id(1, "jobs.jsonl")

    assert main(["events", "--store", str(storyboard_store), "--job", job]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"{ISO_UTC} - → pending - - .*", lines[0])
    assert re.fullmatch(rf"{ISO_UTC} pending → submitted gpu0 attempt 1( .*)?", lines[1])
    assert re.fullmatch(rf"{ISO_UTC} \w+ → succeeded gpu0 attempt 1( .*)?", lines[-1])
    assert not any(job in line for line in lines)  # one job: no job column


def test_events_json_gives_one_object_per_line(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_id(0, "jobs.jsonl")

    assert main(["events", "--store", str(storyboard_store), "--job", job, "--json"]) == 0

    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {e["job_id"] for e in events} == {job}
    assert events[0]["from_state"] is None and events[0]["to_state"] == "pending"
    assert events[-1]["to_state"] == "succeeded"
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)


def test_events_of_a_shot_are_only_that_shots_job(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["events", "--store", str(storyboard_store), "--partition", "jobs"]

    assert main([*argv, "--shot", "2", "--json"]) == 0
    shot_2 = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {e["job_id"] for e in shot_2} == {job_id(1, "jobs.jsonl")}

    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > len(shot_2)
    assert all(re.match(rf"{ISO_UTC} job [0-9a-f-]{{36}} ", line) for line in lines)


def test_events_piped_into_a_reader_that_stops_early_exits_quietly(
    tmp_path: Path, url: str
) -> None:
    # `comfy-assets events ... | head -1`: no traceback, the exit status of a program
    # stopped by SIGPIPE (141).
    jobs = write_jobs(tmp_path / "jobs", 40)
    store = tmp_path / "store"
    assert run(jobs, store, url) == 0
    cmd = [sys.executable, "-m", "comfy_assets.cli", "events", "--store", str(store)]
    read_end, write_end = os.pipe()
    # The smallest pipe (one page): the events (about 20 KB) can't all fit in it and in
    # the writer's buffer, so the writer is still writing when the reader goes away.
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [*cmd, "--partition", "jobs"], stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT
    )
    os.close(write_end)
    proc.stdout = os.fdopen(read_end, "rb")
    assert proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert first and "Traceback" not in err


@pytest.mark.parametrize(
    "query, named",
    [
        (["--partition", "jobs", "--shot", "7"], "shot 7 of partition 'jobs'"),
        (["--partition", "nope"], "partition 'nope'"),
        (["--job", job_id(99)], f"job {job_id(99)}"),
    ],
)
def test_events_matching_nothing_is_exit_1(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str], query: list[str], named: str
) -> None:
    assert main(["events", "--store", str(storyboard_store), *query]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"no events for {named} in {storyboard_store}\n"


def test_events_without_a_store_is_exit_2_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "--store", str(tmp_path / "none"), "--job", job_id(0)]) == 2
    assert "no result store at" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    "query, message",
    [
        (["--job", "17"], "is not a job id"),
        (["--job", job_id(0), "--shot", "3"], "--shot needs --partition"),
    ],
)
def test_events_bad_queries_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], query: list[str], message: str
) -> None:
    assert main(["events", "--store", str(tmp_path), *query]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "query",
    [
        [],
        ["--job", job_id(0), "--partition", "jobs"],
        ["--partition", "p", "--shot", "-1"],
        ["--partition", "p", "--limit", "-1"],
        ["--partition", "p", "--before", "0"],
    ],
)
def test_events_argument_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], query: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["events", "--store", str(tmp_path), *query])
    assert exited.value.code == 2


@pytest.mark.parametrize("option", ["--limit", "--before"])
def test_events_a_number_past_what_a_store_holds_is_an_argument_error(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    argv = ["events", "--store", str(storyboard_store), "--partition", "jobs"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, option, "99999999999999999999"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected an integer <= 9223372036854775807" in err
    assert "Traceback" not in err


def test_events_limit_prints_the_latest_and_says_how_to_see_the_earlier_ones(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["events", "--store", str(storyboard_store), "--partition", "jobs"]
    assert main([*argv, "--json"]) == 0
    every = capsys.readouterr()
    assert every.err == ""  # under the default limit: every event, no note
    events = [json.loads(line) for line in every.out.splitlines()]
    assert len(events) > 8

    assert main([*argv, "--json", "--limit", "4"]) == 0
    latest = capsys.readouterr()
    assert [json.loads(line) for line in latest.out.splitlines()] == events[-4:]
    first = events[-4]["id"]
    assert latest.err == (
        f"{len(events) - 4} earlier events not printed: --before {first} prints the 4"
        " before these, --limit 0 prints every one\n"
    )

    assert main([*argv, "--limit", "4", "--before", str(first)]) == 0
    page = capsys.readouterr()
    assert len(page.out.splitlines()) == 4
    assert all(re.match(rf"{ISO_UTC} job [0-9a-f-]{{36}} ", line) for line in page.out.splitlines())
    assert page.err.startswith(f"{len(events) - 8} earlier events not printed: --before ")

    assert main([*argv, "--json", "--limit", "0", "--before", str(first)]) == 0
    older = capsys.readouterr()
    assert [json.loads(line) for line in older.out.splitlines()] == events[:-4]
    assert older.err == ""


def test_events_before_the_first_event_is_exit_1(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_id(0, "jobs.jsonl")
    assert main(["events", "--store", str(storyboard_store), "--job", job, "--json"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])["id"]

    argv = ["events", "--store", str(storyboard_store), "--job", job, "--before", str(first)]
    assert main(argv) == 1

    assert capsys.readouterr().err == (
        f"no events for job {job} before event {first} in {storyboard_store}\n"
    )


def test_events_says_one_earlier_event_in_the_singular(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = job_id(0, "jobs.jsonl")
    argv = ["events", "--store", str(storyboard_store), "--job", job, "--json"]
    assert main(argv) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(events) >= 2

    assert main([*argv, "--limit", str(len(events) - 1)]) == 0
    assert capsys.readouterr().err == (
        f"1 earlier event not printed: --before {events[1]['id']} prints it,"
        " --limit 0 prints every one\n"
    )


def test_events_counts_earlier_events_only_so_far(
    storyboard_store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A million-job partition has millions of earlier events: they are counted up to
    # EARLIER_COUNTED (100,000), so the note comes in bounded time.
    monkeypatch.setattr(events_cli, "EARLIER_COUNTED", 3)
    argv = ["events", "--store", str(storyboard_store), "--partition", "jobs", "--json"]

    assert main([*argv, "--limit", "2"]) == 0

    printed = capsys.readouterr()
    first = json.loads(printed.out.splitlines()[0])["id"]
    assert printed.err == (
        f"over 3 earlier events not printed: --before {first} prints the 2 before these,"
        " --limit 0 prints every one\n"
    )
