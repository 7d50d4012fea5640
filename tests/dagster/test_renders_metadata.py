"""The renders asset's metadata at any partition size: a job table of at most
``JOB_TABLE_ROWS`` rows (dead letters first, then a sample, saying where the whole table
is), a contact sheet of at most ``SHEET_TILES`` tiles saying of how many, and a data
version read a page at a time. The limits and the page are made small here so that a
few jobs stand for a million."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from dagster import ExecuteInProcessResult, TableMetadataValue
from PIL import Image

from comfy_assets.farm import metadata, partition_view
from comfy_assets.render import summary
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.dagster.test_assets import checks, read_csv, render, serving, write_job_file


def renders_metadata(result: ExecuteInProcessResult) -> dict:
    (event,) = [
        e for e in result.get_asset_materialization_events() if e.asset_key.path == ["renders"]
    ]
    return dict(event.materialization.metadata)


def data_version(result: ExecuteInProcessResult) -> str:
    (event,) = [
        e for e in result.get_asset_materialization_events() if e.asset_key.path == ["renders"]
    ]
    return event.materialization.tags["dagster/data_version"]


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store read two jobs at a time: a partition of six is three pages."""
    monkeypatch.setattr(partition_view, "PAGE", 2)


def test_a_partition_over_the_tables_rows_shows_its_dead_letters_first_and_says_where_the_rest_is(
    jobs_dir: Path, tmp_path: Path, instance, small_pages: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_view, "JOB_TABLE_ROWS", 3)
    monkeypatch.setattr(summary, "DEAD_LETTERS_NAMED", 1)
    write_job_file(jobs_dir, "six", [1, 2, 3, 4, 5, 6])
    fake = FakeComfy(script=["error", "error"])  # the first two prompts fail for good

    with serving(fake) as comfy:
        result = render(instance, "six", comfy, tmp_path / "store")

    assert checks(result) == {"no_dead_letters": False, "all_jobs_done": False}
    meta = renders_metadata(result)
    table = meta["job_table"]
    assert isinstance(table, TableMetadataValue)
    rows = [r.data for r in table.records]
    assert [r["state"] for r in rows] == ["failed_fatal", "failed_fatal", "succeeded"]
    dead_lines = [r["line"] for r in rows[:2]]
    assert dead_lines == sorted(dead_lines)
    # The sample spreads over the file: one row left, so every 6th line, the 6th.
    assert rows[2]["line"] == 6
    where = (tmp_path / "store" / "six" / "results.csv").resolve()
    assert meta["job_table_shown"].value == (
        "3 of 6 jobs shown (2 dead letters, 0 other failures, 1 of a sample every 6 lines); "
        f"the whole table is results.csv at {where}"
    )
    assert meta["jobs"].value == 6 and meta["done"].value == 4
    assert meta["counts"].value == {"failed_fatal": 2, "succeeded": 4}
    # The whole table is there, every job of the file.
    frame = read_csv(tmp_path / "store", "six")
    assert len(frame) == 6
    # The log names the first dead letter (by line) and counts the rest.
    errors = [
        record.user_message
        for record in instance.all_logs(result.run_id)
        if record.step_key == "renders" and record.level >= logging.ERROR
    ]
    first = frame[frame["state"] == "failed_fatal"]["job_id"].iloc[0]
    assert [m for m in errors if "DEAD LETTER" in m] == [
        m for m in errors if m.startswith(f"job {first}: DEAD LETTER, ")
    ]
    assert len([m for m in errors if "DEAD LETTER" in m]) == 1
    assert f"… and 1 more dead letter: every one is in results.csv at {where}" in errors


def test_a_partition_within_the_tables_rows_shows_every_job_in_line_order(
    jobs_dir: Path, tmp_path: Path, instance, small_pages: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_view, "JOB_TABLE_ROWS", 5)
    write_job_file(jobs_dir, "five", [1, 2, 3, 4, 5])

    with serving(FakeComfy(script=["ok", "error"])) as comfy:
        result = render(instance, "five", comfy, tmp_path / "store")

    meta = renders_metadata(result)
    rows = [r.data for r in meta["job_table"].records]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert sorted(r["state"] for r in rows) == ["failed_fatal"] + ["succeeded"] * 4
    assert "job_table_shown" not in meta


def test_the_contact_sheet_shows_its_first_tiles_and_says_of_how_many_outputs(
    jobs_dir: Path, tmp_path: Path, instance, small_pages: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metadata, "SHEET_TILES", 3)
    write_job_file(jobs_dir, "four", [0x110000, 0x002200, 0x000033, 0x444444])

    with serving(FakeComfy()) as comfy:
        result = render(instance, "four", comfy, tmp_path / "store")

    meta = renders_metadata(result)
    assert meta["contact_sheet"].value.startswith(
        "![four: the first 3 of 8 outputs of 4 jobs](data:image/png;base64,"
    )
    assert meta["pictures"].value.startswith("the first 3 of 8 outputs of 4 jobs")
    with Image.open(meta["contact_sheet_path"].value) as image:
        assert image.width == 3 * 140  # three tiles: the first job's two, the second's first
        rgb = image.convert("RGB")
        assert rgb.getpixel((70, 100)) == (0x11, 0x00, 0x00)
        assert rgb.getpixel((350, 100)) == (0x00, 0x22, 0x00)


def test_the_data_version_read_a_page_at_a_time_is_the_sha256_of_every_job_and_output(
    jobs_dir: Path, tmp_path: Path, instance, small_pages: None
) -> None:
    write_job_file(jobs_dir, "five", [1, 2, 3, 4, 5])

    with serving(FakeComfy()) as comfy:
        first = render(instance, "five", comfy, tmp_path / "store")
        again = render(instance, "five", comfy, tmp_path / "store")

    # The sha256 of every job's id, prompt_id and state and its outputs, by job id: the
    # value of a partition read whole, so a store rendered before keeps its version.
    store = Store(tmp_path / "store")
    files = store.partition_files("five")
    digest = hashlib.sha256()
    for record in sorted(store.jobs("five"), key=lambda r: r.job_id):
        digest.update(f"{record.job_id} {record.prompt_id} {record.state}\n".encode())
        for file in files.get(record.job_id, []):
            digest.update(f"  {file.path} {file.sha256}\n".encode())
    store.close()
    assert data_version(first) == digest.hexdigest()
    assert data_version(again) == data_version(first)  # nothing changed, nothing rebuilt
