"""``comfy-assets run`` in process, against an in-thread fake: exit codes, printed lines, the
results CSV, and what the fake was asked to render (requeue and events: their own file)."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render import summary
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import ROOT, free_port, job_id, start_fake_process, write_jobs

# Tiny delays and polls, so a retry or a poll never makes a test slow.
FAST = ["--base-delay-s", "0.01", "--max-delay-s", "0.05", "--no-jitter", "--poll-s", "0.05"]
ISO_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00"


def run(jobs: Path, store: Path, url: str, *extra: str) -> int:
    """``comfy-assets run`` on one fake server, with fast retries."""
    return main(
        ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(store)]
        + FAST
        + list(extra)
    )


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def posts(fake: FakeComfy) -> dict[str, int]:
    """How many times each prompt was posted to the fake."""
    return {pid: p["posted"] for pid, p in fake.stats["prompts"].items()}


# --- run: the results CSV ------------------------------------------------------------


def test_run_writes_the_results_csv_and_prints_its_path(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = tmp_path / "store"

    assert run(jobs, store, url) == 0

    out = capsys.readouterr().out.splitlines()
    csv_path = store / "jobs" / "results.csv"
    assert "summary: 3 done, 0 dead-lettered" in out
    assert out[-1] == f"results: {csv_path}"
    table = rows(csv_path)
    assert [r["job_id"] for r in table] == [job_id(i, "jobs.jsonl") for i in range(3)]
    assert [r["1.color"] for r in table] == ["1000", "1001", "1002"]
    assert {r["state"] for r in table} == {"succeeded"}
    assert all(r["server"] == "gpu0" and r["files"] for r in table)
    assert sorted(posts(fake).values()) == [1, 1, 1]
    assert not [line for line in out if " jobs |" in line]  # no bar when not a terminal


def test_run_on_a_terminal_shows_a_progress_bar_under_its_lines(
    tmp_path: Path, fake: FakeComfy, url: str
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    cmd += ["--server", f"gpu0={url}", "--store", str(tmp_path / "store"), *FAST]
    controller, terminal = pty.openpty()
    # An 80-column terminal: a pty starts with 0 columns, too narrow for any bar.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(cmd, stdout=terminal, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the program closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(60) == 0, proc.stderr.read().decode() if proc.stderr else ""
    screen = b"".join(chunks).decode()

    # The bar is redrawn in place (carriage returns); the batch's lines print above it.
    drawn = re.split(r"[\r\n]+", screen)
    bars = [line for line in drawn if " jobs |" in line]
    assert bars[-1].startswith("3/3 jobs |") and "| 3 done [" in bars[-1]
    assert "job/s]" in bars[-1]  # the rate
    assert sum(1 for line in drawn if line.startswith("job ")) == 3
    assert "summary: 3 done, 0 dead-lettered" in drawn


@pytest.mark.parametrize("both", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_run_piped_into_a_reader_that_stops_early_still_renders_every_job(
    tmp_path: Path, fake: FakeComfy, url: str, both: bool
) -> None:
    # `comfy-assets run ... | head -1`: the reader goes away after the first line; the
    # run goes on, renders every job, writes the CSV and exits 0, with one note. With
    # `2>&1 | head -1` the note can't be written either; the run goes on all the same.
    jobs = write_jobs(tmp_path / "jobs", 6)
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    cmd += ["--server", f"gpu0={url}", "--store", str(store), *FAST]
    stderr = subprocess.STDOUT if both else subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, cwd=ROOT)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = "" if proc.stderr is None else proc.stderr.read().decode()
    assert proc.wait(60) == 0, err
    assert first.startswith(b"job ")
    if not both:
        assert "standard output was closed; the run goes on" in err
        assert "Traceback" not in err
    assert {r["state"] for r in rows(store / "jobs" / "results.csv")} == {"succeeded"}
    assert len(rows(store / "jobs" / "results.csv")) == 6
    assert sorted(posts(fake).values()) == [1] * 6


@pytest.mark.parametrize("option", ["--events", "-v"])
def test_run_with_log_lines_piped_into_a_reader_that_stops_early_prints_no_traceback(
    tmp_path: Path, fake: FakeComfy, url: str, option: str
) -> None:
    # `comfy-assets run --events ... | head -1`: the event and scheduling lines go to
    # stdout too; once the reader is gone they go nowhere, as the job lines do.
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs), option]
    cmd += ["--server", f"gpu0={url}", "--store", str(store), *FAST]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0, err
    assert "Traceback" not in err and "Logging error" not in err
    assert "standard output was closed; the run goes on" in err
    assert len(rows(store / "jobs" / "results.csv")) == 3


def test_run_whose_output_folder_cannot_be_written_stops_with_one_line_and_the_csv(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Our own disk failing (a folder we may not write, a full disk) is no fault of the
    # job: the run stops, says why in one line, and still writes the table.
    jobs = write_jobs(tmp_path / "jobs", 2)
    store = tmp_path / "store"
    (store / "jobs").mkdir(parents=True)
    (store / "jobs" / job_id(0, "jobs.jsonl")).write_text("in the way of the job's folder")

    assert run(jobs, store, url) == 1

    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert job_id(0, "jobs.jsonl") in captured.err and "the run stopped" in captured.err
    assert captured.out.splitlines()[-1] == f"results: {store / 'jobs' / 'results.csv'}"
    assert len(rows(store / "jobs" / "results.csv")) == 2


def test_run_whose_store_folder_is_a_file_says_so_in_one_line(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    store = tmp_path / "store"
    store.write_text("not a folder")

    assert run(jobs, store, url) == 1

    err = capsys.readouterr().err
    assert err == f"error: cannot open the store folder {store}: File exists\n"


def test_run_stopped_by_sigterm_exits_143_and_still_writes_the_results_csv(tmp_path: Path) -> None:
    # The CSV is the table of what is done: a stopped run writes it too, with a row per
    # job (the ones not done yet say so).
    fake = FakeComfy(script=["ok", "hang"], prompt_seconds=0.005)  # job 2 runs until stopped
    jobs = write_jobs(tmp_path / "jobs", 8)
    store = tmp_path / "store"
    with fake.serve_in_thread(port=0) as url:
        cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
        cmd += ["--server", f"gpu0={url}", "--store", str(store), *FAST]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        assert proc.stdout is not None and proc.stderr is not None
        assert b"succeeded" in proc.stdout.readline()  # one job is done: stop the run now
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert "stopped by SIGTERM" in err.decode()
    csv_path = store / "jobs" / "results.csv"
    assert f"results: {csv_path}" in out.decode()
    table = rows(csv_path)
    assert len(table) == 8
    assert sum(r["state"] == "succeeded" for r in table) == 1
    assert [r["outcome"] for r in fake.stats["runs"]] == ["success", "interrupted"]


def test_signals_while_a_stopped_run_cleans_up_do_not_cut_the_cleanup_short(
    tmp_path: Path,
) -> None:
    port = free_port()
    fake = start_fake_process(port, "--script", "ok,hang", "--prompt-seconds", "0.005")
    url = f"http://127.0.0.1:{port}"
    jobs = write_jobs(tmp_path / "jobs", 3)
    hung = load_job_file(jobs).jobs[1]
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    cmd += ["--server", f"gpu0={url}", "--store", str(store), *FAST]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert b"succeeded" in proc.stdout.readline()  # job 2 hangs on the server now
        fake.send_signal(signal.SIGSTOP)  # the server freezes: the cleanup waits for it
        proc.send_signal(signal.SIGINT)
        assert proc.stderr.readline().startswith(b"Ctrl+C: stopping: removing our prompts")
        proc.send_signal(signal.SIGINT)
        assert proc.stderr.readline().startswith(b"Ctrl+C: already stopping: ")
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr.readline().startswith(b"SIGTERM: already stopping: ")
        fake.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        stats = json.loads(urllib.request.urlopen(f"{url}/fake/stats", timeout=10).read())
    finally:
        fake.send_signal(signal.SIGCONT)
        fake.kill()
        fake.wait()
        proc.kill()
    assert proc.returncode == 130, err.decode()
    assert "stopped by Ctrl+C" in err.decode()
    said = [line for line in out.decode().splitlines() if line.startswith(f"job {hung.id}")]
    assert said and "interrupted" in said[-1] and "claim released" in said[-1], out.decode()
    assert [r["outcome"] for r in stats["runs"]] == ["success", "interrupted"]
    with Store.existing(store) as opened:
        record = opened.get(hung.id)
    assert record is not None and record.claimed_by is None


def requeue_and_render(
    jobs: Path,
    store: Path,
    url: str,
    failed: str,
    fake: FakeComfy,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``requeue`` job ``failed`` of a 3-job file, run the file again: every job succeeds
    with its files, and only that job's prompt was posted a second time."""
    assert main(["requeue", failed, "--store", str(store)]) == 0
    assert capsys.readouterr().out == f"job {failed}: requeued (pending)\n"
    assert run(jobs, store, url) == 0
    table = {r["job_id"]: r for r in rows(store / "jobs" / "results.csv")}
    assert {r["state"] for r in table.values()} == {"succeeded"}
    assert table[failed]["files"]
    prompt = {j.id: j.prompt_id for j in load_job_file(jobs).jobs}[failed]
    counts = posts(fake)
    assert counts.pop(prompt) == 2  # the failed job again, nothing else
    assert sorted(counts.values()) == [1, 1]


def test_a_dead_letter_is_a_row_with_its_reason_and_requeue_renders_it_again(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = tmp_path / "store"
    fake.script.append("invalid")  # the first prompt posted fails validation: permanent

    assert run(jobs, store, url) == 1

    out = capsys.readouterr().out
    (dead,) = re.findall(r"dead letter ([0-9a-f-]{36}):", out)
    assert "more dead letter" not in out  # fewer than named: each one a line, as ever
    assert f"results: {store / 'jobs' / 'results.csv'}" in out.splitlines()
    table = {r["job_id"]: r for r in rows(store / "jobs" / "results.csv")}
    assert len(table) == 3
    assert table[dead]["state"] == "failed_fatal"
    assert "prompt_outputs_failed_validation" in table[dead]["reason"]
    assert [r["state"] for i, r in table.items() if i != dead] == ["succeeded"] * 2

    requeue_and_render(jobs, store, url, dead, fake, capsys)


def test_dead_letters_over_the_named_are_counted_by_reason_in_one_line_saying_where_they_are(
    tmp_path: Path,
    fake: FakeComfy,
    url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two named stand for the 20: five dead letters are three more than named.
    monkeypatch.setattr(summary, "DEAD_LETTERS_NAMED", 2)
    jobs = write_jobs(tmp_path / "jobs", 5)
    store = tmp_path / "store"
    fake.script.extend(["invalid"] * 5)  # every prompt fails validation: permanent

    assert run(jobs, store, url) == 1

    out = capsys.readouterr().out.splitlines()
    ids = [j.id for j in load_job_file(jobs).jobs]
    reasons = {r["job_id"]: r["reason"] for r in rows(store / "jobs" / "results.csv")}
    assert "summary: 0 done, 5 dead-lettered" in out
    named = [line for line in out if line.startswith("  dead letter ")]
    # The first two in line order, as every dead letter was printed before.
    assert named == [f"  dead letter {i}: {reasons[i]}" for i in ids[:2]]
    (more,) = [line for line in out if "more dead letters" in line]
    assert out.index(more) == out.index(named[-1]) + 1
    # Each reason with its count, cut at REASON_CHARS characters (the table has it whole).
    chars = summary.REASON_CHARS
    cut = {why: why if len(why) <= chars else why[: chars - 1] + "…" for why in reasons.values()}
    counted = "; ".join(f"{n} × {cut[w]!r}" for w, n in Counter(reasons.values()).most_common())
    where = store / "jobs" / "results.csv"
    status = f"comfy-assets status --store {store} --partition jobs"
    assert more == (
        f"  … and 3 more dead letters (5 in all: {counted}): every one is in results.csv at "
        f"{where}; `{status}` lists every one by reason"
    )
    # The command it names works and lists every dead letter.
    assert main(status.split()[1:]) == 0
    listed = capsys.readouterr().out
    assert all(f"job {i}" in listed for i in ids)


def test_a_job_degraded_under_draft_is_requeued_and_renders_in_the_next_run(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = tmp_path / "store"
    fake.script.append("invalid")  # the first prompt posted fails validation: permanent

    assert run(jobs, store, url, "--policy", "draft") == 0
    out = capsys.readouterr().out
    (degraded,) = re.findall(r"job ([0-9a-f-]{36}): degraded \(draft\)", out)
    table = {r["job_id"]: r for r in rows(store / "jobs" / "results.csv")}
    assert table[degraded]["state"] == "degraded"
    assert table[degraded]["files"] == ""  # a draft's failure: nothing rendered
    # Run again, it stays as it is and says how to render it.
    assert run(jobs, store, url) == 0
    assert f"job {degraded}: degraded earlier (" in capsys.readouterr().out

    requeue_and_render(jobs, store, url, degraded, fake, capsys)


def test_an_output_over_max_output_bytes_dead_letters_its_job_and_the_others_finish(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64x64 solid PNGs are about 540 bytes; 1024x1024 ones about 5.7 KB.
    big = {"set": {"1.color": 1001, "1.width": 1024, "1.height": 1024}}
    jobs = write_jobs(tmp_path / "jobs", 3, extra=[{}, big, {}])
    store = tmp_path / "store"
    loaded = load_job_file(jobs).jobs

    assert run(jobs, store, url, "--max-output-bytes", "2KiB") == 1

    out = capsys.readouterr().out
    table = {r["job_id"]: r for r in rows(store / "jobs" / "results.csv")}
    assert [table[j.id]["state"] for j in loaded] == ["succeeded", "failed_fatal", "succeeded"]
    reason = table[loaded[1].id]["reason"]
    assert "OutputTooLarge" in reason and "over the limit of 2048 bytes" in reason
    assert f"dead letter {loaded[1].id}: download: OutputTooLarge" in out
    # No file of the big job, not even a part; the others have both of theirs.
    assert not (store / "jobs" / loaded[1].id).exists() or not any(
        (store / "jobs" / loaded[1].id).iterdir()
    )
    for job in (loaded[0], loaded[2]):
        assert len(list((store / "jobs" / job.id).glob("*.png"))) == 2
    # Permanent: rendered once, not posted again.
    assert posts(fake) == {j.prompt_id: 1 for j in loaded}


def test_max_output_bytes_takes_a_size_and_refuses_anything_else(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    with pytest.raises(SystemExit) as info:
        run(jobs, tmp_path / "store", url, "--max-output-bytes", "4GB")
    assert info.value.code == 2
    assert "argument --max-output-bytes: expected a size in bytes" in capsys.readouterr().err


def test_a_job_line_deleted_from_the_file_leaves_the_results_csv(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 3)
    store = tmp_path / "store"
    assert run(jobs, store, url) == 0
    lines = jobs.read_text().splitlines()
    jobs.write_text("\n".join([lines[0], lines[2]]) + "\n")

    assert run(jobs, store, url) == 0

    table = rows(store / "jobs" / "results.csv")
    assert [r["job_id"] for r in table] == [job_id(0, "jobs.jsonl"), job_id(2, "jobs.jsonl")]
    assert sum(posts(fake).values()) == 3  # the second run rendered nothing again


# --- run: bad input is exit 2, nothing posted -----------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", '{"header": {"policy": "draft"}}\n'])
def test_a_job_file_without_jobs_is_exit_2_not_a_hang(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    jobs = tmp_path / "empty.jsonl"
    jobs.write_text(text)

    assert run(jobs, tmp_path / "store", url) == 2

    assert capsys.readouterr().err == f"error: {jobs}:0: file: no jobs in file\n"
    assert posts(fake) == {}


def test_a_nan_set_value_is_exit_2_naming_line_and_field(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 2)
    first, second = jobs.read_text().splitlines()
    jobs.write_text(f"{first}\n{second.replace('1001', 'NaN')}\n")

    assert run(jobs, tmp_path / "store", url) == 2

    err = capsys.readouterr().err
    assert f"{jobs}:2: set.1.color: expected a finite number, got NaN" in err
    assert posts(fake) == {}


@pytest.mark.parametrize(
    "option, value",
    [
        ("--attempts", "0"),
        ("--attempts", "two"),
        ("--base-delay-s", "-1"),
        ("--max-delay-s", "-0.5"),
        ("--max-delay-s", "nan"),
        ("--timeout-s", "0"),
        ("--timeout-s", "inf"),
        ("--poll-s", "0"),
        ("--lease-s", "-5"),
        ("--server-lease-s", "0"),
        ("--max-queue", "0"),
    ],
)
@pytest.mark.parametrize("command", ["run", "worker"])
def test_an_out_of_range_batch_option_is_an_argparse_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, option: str, value: str
) -> None:
    argv = [command, "--jobs", "j.jsonl", "--server", "gpu0=http://127.0.0.1:9"]
    argv += ["--store", str(tmp_path / "store"), f"{option}={value}"]

    with pytest.raises(SystemExit) as exited:
        main(argv)

    assert exited.value.code == 2
    assert f"argument {option}: expected " in capsys.readouterr().err
    assert not (tmp_path / "store").exists()


def test_the_smallest_allowed_batch_options_run(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # One attempt: the job refused with a 500 is a dead letter at once. A queue of one:
    # no prompt of ours is posted while another client's prompt is on the server.
    busy = FakeComfy(script=["500"], busy=1, prompt_seconds=0.01)
    jobs = write_jobs(tmp_path / "jobs", 2)
    limits = ["--attempts", "1", "--base-delay-s", "0", "--max-delay-s", "0", "--max-queue", "1"]
    with busy.serve_in_thread(port=0) as busy_url:
        assert run(jobs, tmp_path / "store", busy_url, *limits) == 1
    assert "summary: 1 done, 1 dead-lettered" in capsys.readouterr().out
    theirs, *ours = sorted(busy.stats["runs"], key=lambda r: r["start"])
    assert not theirs["client_id"].startswith("comfy-assets-")
    assert len(ours) == 1 and ours[0]["posted"] >= theirs["end"]
    assert sorted(p["posted"] for p in busy.stats["prompts"].values())[-2:] == [1, 1]


def test_run_with_no_server_reachable_gives_up_after_the_timeout_and_writes_the_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 2)
    store = tmp_path / "store"
    code = run(jobs, store, "http://127.0.0.1:9", "--unreachable-timeout-s", "0.2")
    out = capsys.readouterr().out
    assert code == 1
    assert "stopped: no server reachable for " in out
    assert "the jobs not done stay pending (run again)" in out
    named = ", ".join(f"{job_id(i, 'jobs.jsonl')} (pending)" for i in range(2))
    assert f"  2 not run: {named}\n" in out
    table = rows(store / "jobs" / "results.csv")
    assert [r["state"] for r in table] == ["pending", "pending"]


# --- URLs with passwords from the environment -------------------------------------------


@pytest.mark.parametrize(
    "command, variables",
    [
        ("run", ["COMFY_ASSETS_DB_URL"]),
        ("requeue", ["COMFY_ASSETS_DB_URL"]),
        ("events", ["COMFY_ASSETS_DB_URL"]),
        ("film", ["COMFY_ASSETS_DB_URL"]),
        ("enqueue", ["COMFY_ASSETS_RABBITMQ_URL"]),
        ("worker", ["COMFY_ASSETS_DB_URL", "COMFY_ASSETS_RABBITMQ_URL"]),
    ],
)
def test_help_says_which_variable_can_hold_a_url_with_its_password(
    command: str, variables: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for variable in variables:
        assert f"${variable}, which keeps the password out of ps" in text


def test_the_database_url_comes_from_the_environment_when_no_db_url_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A SQLite URL elsewhere than <store>/store.db shows which one was used.
    db = tmp_path / "elsewhere.db"
    monkeypatch.setenv("COMFY_ASSETS_DB_URL", f"sqlite:///{db}")
    store = tmp_path / "store"
    assert main(["events", "--store", str(store), "--job", job_id(1)]) == 1
    assert db.is_file() and not (store / "store.db").exists()
    assert f"no events for job {job_id(1)}" in capsys.readouterr().err


def test_a_worker_without_a_queue_url_or_a_job_file_is_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("COMFY_ASSETS_RABBITMQ_URL", raising=False)
    args = ["worker", "--queue", "q", "--server", "gpu0=http://127.0.0.1:1"]
    assert main([*args, "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "no RabbitMQ URL: give --rabbitmq URL or set $COMFY_ASSETS_RABBITMQ_URL" in err


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_exit_130() -> None:
    # What a Ctrl+C while the libraries load does: main() interrupted, no traceback.
    code = (
        "import comfy_assets.cli.main as m\n"
        "def interrupted():\n"
        "    raise KeyboardInterrupt\n"
        "m.main = interrupted\n"
        "m.entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 130
    assert done.stderr == "stopped by Ctrl+C\n"
