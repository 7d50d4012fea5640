"""Bad input to the commands: one line on stderr naming what is wrong, exit 2 (1 for a
database that refuses us), nothing posted and nothing created; never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from fake_comfy import FakeComfy
from tests.support import ROOT, write_jobs


def posted(fake: FakeComfy) -> int:
    return sum(p["posted"] for p in fake.stats["prompts"].values())


def exit_code(argv: list[str]) -> int:
    """``main(argv)``; argparse's own errors end in SystemExit, taken as its code."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf", "soon"])
def test_health_refuses_a_timeout_that_is_not_a_positive_number(value: str, capsys) -> None:
    code = exit_code(["health", "--server", "g=http://127.0.0.1:9", "--timeout-s", value])
    err = capsys.readouterr().err
    assert code == 2
    assert f"argument --timeout-s: expected a number > 0, got '{value}'" in err


@pytest.mark.parametrize(
    ("partition", "why"),
    [
        ("p" * 300, "300 bytes long: a folder name has at most 255"),
        (" ", "white space at an end"),
        ("a\nb", "control characters"),
        ("", "cannot be used as a folder name"),
    ],
)
def test_run_refuses_a_partition_that_cannot_be_a_folder_before_posting(
    partition: str, why: str, tmp_path: Path, fake: FakeComfy, url: str, capsys
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    argv = ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(tmp_path / "s")]

    code = exit_code([*argv, "--partition", partition])

    assert code == 2
    assert why in capsys.readouterr().err
    assert posted(fake) == 0
    assert not (tmp_path / "s").exists()


def test_a_database_url_that_is_not_one_is_bad_input_for_every_store_command(
    tmp_path: Path, capsys
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    store = ["--store", str(tmp_path / "s"), "--db-url", "notaurl"]
    commands = [
        ["run", "--jobs", str(jobs), "--server", "g=http://127.0.0.1:9", *store],
        ["requeue", "00000000-0000-4000-8000-000000000000", *store],
        ["events", "--partition", "p", *store],
        ["film", "--jobs", str(ROOT / "data/jobs/storyboard.jsonl"), *store],
    ]
    for argv in commands:
        assert exit_code(argv) == 2, argv
        err = capsys.readouterr().err
        assert "error: --db-url: not a database URL SQLAlchemy can open" in err, argv
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("db_url", "said"),
    [
        (
            "mysql://u:p@db/x",
            "the store is kept in PostgreSQL (postgresql+psycopg://...) or SQLite, not mysql",
        ),
        ("postgresql+pg8000://u:p@db/x", "its database driver is not installed"),
    ],
)
def test_a_database_the_store_cannot_use_is_one_line_of_bad_input(
    tmp_path: Path, capsys, db_url: str, said: str
) -> None:
    store = ["--store", str(tmp_path / "s"), "--db-url", db_url]
    for argv in (["status", *store], ["events", "--partition", "p", *store]):
        assert exit_code(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --db-url: {said}"), err
        assert "p@db" not in err


def test_a_database_that_refuses_the_role_ends_run_with_one_line_and_no_password(
    tmp_path: Path, fake: FakeComfy, url: str, capsys
) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    db_url = "postgresql+psycopg://nobody:sekret@127.0.0.1:5432/nodb"
    argv = ["run", "--jobs", str(jobs), "--server", f"gpu0={url}", "--store", str(tmp_path)]

    code = exit_code([*argv, "--db-url", db_url])

    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: the store's database is unreachable (opening the store failed:")
    assert "nobody" in err and "sekret" not in err
    assert posted(fake) == 0


def test_events_refuses_a_shot_beyond_what_a_job_file_may_hold(tmp_path: Path, capsys) -> None:
    argv = ["events", "--store", str(tmp_path), "--partition", "p", "--shot", "9" * 23]
    assert exit_code(argv) == 2
    assert "argument --shot: expected an integer from 0 to 2147483647" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--grace-s", "-1", "expected a number >= 0"),
        ("--heartbeat-s", "0", "expected a number > 0"),
        ("--queue", "", "expected a queue name of 1 to 255 bytes"),
        ("--queue", "amq.mine", "not starting with 'amq.'"),
    ],
)
def test_worker_refuses_options_out_of_range(
    option: str, value: str, expected: str, tmp_path: Path, capsys
) -> None:
    argv = ["worker", "--jobs", str(write_jobs(tmp_path / "jobs", 1))]
    argv += ["--server", "g=http://127.0.0.1:9", "--store", str(tmp_path / "s"), option, value]
    assert exit_code(argv) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_enqueue_refuses_an_empty_queue_name_before_connecting(tmp_path: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "jobs", 1)
    argv = ["enqueue", "--rabbitmq", "amqp://guest:guest@127.0.0.1:9/", "--queue", ""]
    assert exit_code([*argv, "--jobs", str(jobs)]) == 2
    assert "argument --queue: expected a queue name" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_the_fake_refuses_a_port_out_of_range(port: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fake_comfy", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--port" in done.stderr and "Traceback" not in done.stderr
