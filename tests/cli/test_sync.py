"""``comfy-assets sync``: a partition's outputs copied to a folder, then only what is new
or changed; a file not as recorded in the store is not copied (exit 1); bad input exit
2; the same through a store whose files are reached only by reading them."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.store import Store
from comfy_assets.store.files.sync import sync_outputs
from fake_comfy import FakeComfy
from tests.cli.test_cli_commands import run
from tests.file_store_support import LinkedFileStore
from tests.support import write_jobs


def sync(store: Path, to: Path, partition: str = "jobs") -> int:
    return main(["sync", "--store", str(store), "--partition", partition, "--to", str(to)])


def outputs(store: Path) -> dict[str, bytes]:
    """Every output of partition ``jobs`` as ``<job id>/<path>`` -> its bytes."""
    with Store(store) as opened:
        return {
            f"{job_id}/{f.path}": (store / "jobs" / job_id / f.path).read_bytes()
            for job_id, files in opened.partition_files("jobs").items()
            for f in files
        }


def folder(to: Path) -> dict[str, bytes]:
    return {p.relative_to(to).as_posix(): p.read_bytes() for p in to.rglob("*") if p.is_file()}


def test_sync_copies_what_is_new_or_changed_and_leaves_the_rest(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store, desk = tmp_path / "store", tmp_path / "desk"
    assert run(write_jobs(tmp_path / "jobs", 3), store, url) == 0
    stored = outputs(store)
    n, size = len(stored), sum(map(len, stored.values()))
    assert n >= 3
    capsys.readouterr()

    assert sync(store, desk) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"sync jobs -> {desk}: {n} new, 0 changed, 0 unchanged, 0 failed ({size} bytes copied)"
    ]
    assert folder(desk) == stored

    assert sync(store, desk) == 0
    assert capsys.readouterr().out.endswith(
        f": 0 new, 0 changed, {n} unchanged, 0 failed (0 bytes copied)\n"
    )

    # One copy edited in place (same size), one deleted, one file of the user's own.
    edited, deleted = sorted(stored)[:2]
    (desk / edited).write_bytes(b"x" * len(stored[edited]))
    (desk / deleted).unlink()
    (desk / "notes.txt").write_text("mine")
    assert sync(store, desk) == 0
    copied = len(stored[edited]) + len(stored[deleted])
    assert capsys.readouterr().out.endswith(
        f": 1 new, 1 changed, {n - 2} unchanged, 0 failed ({copied} bytes copied)\n"
    )
    assert folder(desk) == {**stored, "notes.txt": b"mine"}


def test_a_file_not_as_recorded_in_the_store_is_not_copied(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store, desk = tmp_path / "store", tmp_path / "desk"
    assert run(write_jobs(tmp_path / "jobs", 2), store, url) == 0
    stored = outputs(store)
    changed, gone = sorted(stored)[:2]
    (store / "jobs" / changed).write_bytes(b"y" * len(stored[changed]))  # edited in the store
    (store / "jobs" / gone).unlink()
    capsys.readouterr()

    assert sync(store, desk) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].endswith(
        f"{len(stored) - 2} new, 0 changed, 0 unchanged, 2 failed "
        f"({sum(len(stored[k]) for k in sorted(stored)[2:])} bytes copied)"
    )
    lines = sorted(err.splitlines())
    size = len(stored[changed])
    assert lines[0].startswith(f"not copied: {changed}: {size} bytes, sha256 ")
    assert f"; recorded {size} bytes, sha256 " in lines[0]
    assert lines[1] == f"not copied: {gone}: gone from the store"
    assert changed not in folder(desk) and gone not in folder(desk)


def test_sync_refuses_bad_input(
    tmp_path: Path, fake: FakeComfy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    assert sync(store, tmp_path / "desk") == 2
    assert "error:" in capsys.readouterr().err
    assert run(write_jobs(tmp_path / "jobs", 1), store, url) == 0
    capsys.readouterr()
    assert sync(store, tmp_path / "desk", partition="nothing") == 2
    assert "partition 'nothing' of" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert sync(store, tmp_path / "a-file") == 2
    assert "--to" in capsys.readouterr().err
    assert not (tmp_path / "desk").exists()


def test_sync_reads_a_store_whose_files_are_not_on_this_disk(
    tmp_path: Path, fake: FakeComfy, url: str
) -> None:
    store, desk = tmp_path / "store", tmp_path / "desk"
    assert run(write_jobs(tmp_path / "jobs", 2), store, url) == 0
    linked = LinkedFileStore(store)  # the same bytes, reached only through open_output
    with Store(store) as opened:
        files = [(j, f) for j, fs in opened.partition_files("jobs").items() for f in fs]
    counts = sync_outputs(linked, "jobs", files, desk)
    assert (counts.new, counts.unchanged, counts.failed) == (len(files), 0, [])
    assert folder(desk) == outputs(store)
    again = sync_outputs(linked, "jobs", files, desk)
    assert (again.new, again.changed, again.unchanged) == (0, 0, len(files))
