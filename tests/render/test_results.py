"""The results table: a row per job, one column per `set` key, files with short hashes."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from comfy_assets.render.results import (
    JobResults,
    combine_results,
    write_csv,
)


@dataclass
class Rec:
    job_id: str
    line: int = 1
    shot: int | None = None
    state: str = "succeeded"
    server: str | None = "gpu0"
    attempts: int = 1
    seconds: float | None = 0.5
    reason: str | None = None
    set: dict | None = None
    take: int = 1
    inputs: tuple = ()


@dataclass
class F:
    path: str
    sha256: str
    bytes: int = 10
    node_id: str | None = None


def rec(job_id: str, values: dict, **kw) -> Rec:
    return Rec(job_id=job_id, set=values, **kw)


def test_a_row_per_job_with_a_column_per_set_key() -> None:
    records = [
        rec("a", {"1.color": 255, "1.width": 64}),
        rec(
            "b",
            {"1.color": 0, "1.height": 96},
            state="failed_fatal",
            reason="IndexError",
            server="gpu1",
            attempts=1,
        ),
    ]
    files = {"a": [F("solid_00001_.png", "ab" * 32), F("inverted_00001_.png", "cd" * 32)]}

    table = JobResults.of(records, files).table()

    assert table.columns == [
        "job_id",
        "line",
        "shot",
        "1.color",
        "1.width",
        "1.height",
        "take",
        "inputs",
        "state",
        "server",
        "failed_on",
        "attempts",
        "seconds",
        "files",
        "reason",
    ]
    assert [row.get("job_id") for row in table.rows] == ["a", "b"]
    assert (
        table.rows[0]["files"] == "inverted_00001_.png:cdcdcdcdcdcd solid_00001_.png:abababababab"
    )
    assert table.rows[1]["state"] == "failed_fatal"
    assert table.rows[1]["reason"] == "IndexError"
    assert table.rows[1]["files"] == ""


def test_csv_keeps_integers_when_a_key_is_missing_in_some_rows(tmp_path: Path) -> None:
    table = JobResults.of([rec("a", {"1.width": 64}), rec("b", {"1.color": 3})], {}).table()
    path = write_csv(table, tmp_path / "p" / "results.csv")

    text = path.read_text().splitlines()

    assert text[0] == (
        "job_id,line,shot,1.width,1.color,take,inputs,state,server,failed_on,attempts,seconds,files,reason"
    )
    assert text[1] == "a,1,,64,,1,,succeeded,gpu0,,1,0.5,,"
    assert text[2] == "b,1,,,3,1,,succeeded,gpu0,,1,0.5,,"
    assert [p.name for p in path.parent.iterdir()] == ["results.csv"]  # no temp file left


def test_job_ids_order_the_rows_and_show_missing_jobs() -> None:
    records = [rec("a", {"1.color": 1}), rec("old", {"1.color": 2}), rec("b", {"1.color": 3})]

    table = JobResults.of(records, {}, job_ids=["b", "a", "c"]).table()

    assert [row.get("job_id") for row in table.rows] == ["b", "a", "c"]
    assert [row.get("state") for row in table.rows] == ["succeeded", "succeeded", "missing"]


def test_a_storyboard_sorts_by_shot_and_every_row_names_its_line(tmp_path: Path) -> None:
    records = [
        rec("a", {"1.color": 1}, line=2, shot=3),
        rec("b", {"1.color": 2}, line=3, shot=1),
        rec("c", {"1.color": 3}, line=4),
    ]
    path = write_csv(JobResults.of(records, {}).table(), tmp_path / "p" / "results.csv")

    frame = pd.read_csv(path).sort_values("shot")

    assert frame["job_id"].tolist() == ["b", "a", "c"]  # the job without a shot last
    assert frame["line"].tolist() == [3, 2, 4]
    assert path.read_text().splitlines()[3] == "c,4,,3,1,,succeeded,gpu0,,1,0.5,,"


def test_list_values_are_written_as_json() -> None:
    table = JobResults.of([rec("a", {"5.size": [1, 2]})], {}).table()
    assert table.rows[0]["5.size"] == "[1, 2]"


def test_combine_adds_a_partition_column(tmp_path: Path) -> None:
    a = write_csv(JobResults.of([rec("x", {"1.color": 1})], {}).table(), tmp_path / "a.csv")
    b = write_csv(JobResults.of([rec("y", {"2.fps": 24.0})], {}).table(), tmp_path / "b.csv")

    combined = combine_results({"images": a, "story": b})

    assert [row.get("partition") for row in combined.rows] == ["images", "story"]
    assert [row.get("job_id") for row in combined.rows] == ["x", "y"]
    assert combined.rows[0]["2.fps"] == ""
    assert combined.rows[1]["2.fps"] == "24.0"


def test_a_carriage_return_in_a_cell_keeps_its_row_whole(tmp_path: Path) -> None:
    # A reason from a server's Windows traceback: "\r\n" between its lines.
    records = [rec("a", {"1.color": 1}, reason="Traceback\r\n  line 1\rend"), rec("b", {})]
    path = write_csv(JobResults.of(records, {}).table(), tmp_path / "p" / "results.csv")

    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    combined = combine_results({"p": path})

    assert [row["job_id"] for row in rows] == ["a", "b"]
    assert rows[0]["reason"] == "Traceback\n  line 1\nend"
    assert [row.get("job_id") for row in combined.rows] == ["a", "b"]
    assert pd.read_csv(path)["job_id"].tolist() == ["a", "b"]
