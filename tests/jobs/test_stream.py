"""A job file validated in one streaming pass (``scan_job_file``) says what ``load_job_file``
says, and builds the same jobs a chunk at a time."""

from __future__ import annotations

import json
import threading

import pytest

from comfy_assets.jobs import halves
from comfy_assets.jobs.model import JobFile, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobFileChanged, JobScan, scan_job_file
from tests.support import job_id, write_jobs


@pytest.fixture(autouse=True, params=["one pass", "halves"])
def passes(request, monkeypatch):
    """Every test twice: files read in one pass, and every file of two lines or more
    checked in two halves at once (as big files are)."""
    if request.param == "halves":
        monkeypatch.setattr(halves, "HALVES_BYTES", 0)
        monkeypatch.setattr(halves, "alone", lambda: True)  # whatever threads earlier tests left
    return request.param


def errors_of(load, path) -> list[str]:
    with pytest.raises(JobFileError) as e:
        load(path)
    return [str(x) for x in e.value.errors]


def test_a_good_file_gives_the_jobs_and_version_load_job_file_gives(tmp_path):
    path = write_jobs(tmp_path, 2500, extra=[{"shot": i} if i % 2 else {} for i in range(2500)])
    loaded = load_job_file(path)
    scan = scan_job_file(path)
    assert isinstance(scan, JobScan)
    assert (scan.count, scan.sha256, scan.header) == (2500, loaded.sha256, loaded.header)
    assert scan.storyboard
    assert list(scan.job_ids()) == [j.id for j in loaded.jobs]
    assert scan.job_ids()[-1] == loaded.jobs[-1].id
    reader = scan.reader()
    got = reader.take(1000) + reader.take(1000) + reader.take(1000) + reader.take(1000)
    reader.close()
    assert [(j.id, j.line, j.prompt_id, j.shot, j.workflow) for j in got] == [
        (j.id, j.line, j.prompt_id, j.shot, j.workflow) for j in loaded.jobs
    ]


def test_every_error_is_said_as_load_job_file_says_it_in_the_same_order(tmp_path):
    path = write_jobs(tmp_path, 4)
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    bad = [
        json.dumps({"header": {"policy": "draft"}}),
        json.dumps({**first, "shot": 1}),
        "",
        "{not json",
        json.dumps({"id": "NOT-A-UUID", "workflow": "image.json"}),
        json.dumps({"id": "NOT-A-UUID", "workflow": "image.json"}),
        json.dumps({**first, "shot": 1, "set": {"9.seed": 1}}),
        json.dumps({"header": {}}),
        json.dumps({"id": job_id(7), "workflow": "image.json", "sets": {}}),
        json.dumps({"id": job_id(8), "workflow": "image.json", "set": {"1.color": 1}}).replace(
            "1}}", "NaN}}"
        ),
        json.dumps({"id": job_id(9), "workflow": "image.json"}).replace(
            '"workflow"', f'"id": "{job_id(9)}", "workflow"'
        ),
        json.dumps({"id": job_id(10), "workflow": "image.json", "set": {"1.col\x1bor": 1}}),
        json.dumps({"id": job_id(11), "workflow": "missing.json"}),
        json.dumps({"id": job_id(12), "workflow": "image.json", "set": {"2.image": 1}}),
        json.dumps({**first, "shot": 2}),
        lines[1],
    ]
    path.write_text("\n".join(bad) + "\n")
    expected = errors_of(load_job_file, path)
    assert len(expected) > 10
    assert errors_of(scan_job_file, path) == expected


@pytest.mark.parametrize(
    "content",
    [b"", b"\n  \n", b'{"header": {}}\n', b'{"id": 1}\n\xff\xfe\n', b"\xef\xbb\xbf\xff"],
    ids=["empty", "blank", "header only", "not utf-8", "bom then not utf-8"],
)
def test_a_file_without_jobs_or_not_utf8_is_said_as_load_job_file_says_it(tmp_path, content):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(content)
    assert errors_of(scan_job_file, path) == errors_of(load_job_file, path)


def test_a_missing_file_and_a_folder_are_said_as_load_job_file_says_them(tmp_path):
    for path in (tmp_path / "none.jsonl", tmp_path):
        assert errors_of(scan_job_file, path) == errors_of(load_job_file, path)


def test_a_file_with_chained_jobs_is_loaded_whole(tmp_path):
    path = write_jobs(tmp_path, 2)
    lines = path.read_text().splitlines()
    second = json.loads(lines[1])
    second["inputs"] = {"1.width": {"job": json.loads(lines[0])["id"], "node": "3"}}
    path.write_text(lines[0] + "\n" + json.dumps(second) + "\n")
    found = scan_job_file(path)
    assert isinstance(found, JobFile)
    assert [j.prompt_id for j in found.jobs] == [j.prompt_id for j in load_job_file(path).jobs]


def test_a_line_changed_after_validation_stops_the_reader_naming_it(tmp_path):
    path = write_jobs(tmp_path, 3)
    scan = scan_job_file(path)
    assert isinstance(scan, JobScan)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1].replace("1001", "1009"), lines[2]]) + "\n")
    reader = scan.reader()
    assert [j.id for j in reader.take(1)] == [job_id(0, "jobs.jsonl")]
    with pytest.raises(JobFileChanged, match=f"{path}:2: the line changed"):
        reader.take(1)
    reader.close()


def test_lines_shaped_as_a_valid_line_before_them_are_said_as_load_job_file_says_them(tmp_path):
    # The quick path checks only the values of a line shaped as a valid one: every bad
    # value, a repeated key however spaced, a repeated id or shot, is still said.
    path = write_jobs(tmp_path, 2)
    full = {"shot": 1, "duration_s": 2.5, "optional": True, "take": 2}
    good = [{"id": job_id(i), "workflow": "image.json", "set": {"1.color": i}} for i in range(3)]
    rich = [{**good[0], **full, "id": job_id(20 + i), "shot": 10 + i} for i in range(2)]
    bad = [
        {**rich[0], "id": job_id(30), "shot": -1},
        {**rich[0], "id": job_id(31), "shot": 10},
        {**rich[0], "id": job_id(32), "duration_s": 0},
        {**rich[0], "id": job_id(33), "optional": 1},
        {**rich[0], "id": job_id(34), "take": True},
        {**rich[0], "id": job_id(35), "take": 0},
        {**good[0], "id": job_id(36).upper()},
        {**good[0], "id": 36},
        {**good[1]},
        {**good[0], "id": job_id(37), "set": {"1.color": [1, 2]}},
        {**good[0], "id": job_id(38), "set": {"1.color": "12:00"}},
    ]
    text = [json.dumps(x) for x in good + rich + bad] + [
        json.dumps(good[2]).replace('{"1.color"', '{"1.color" :0, "1.color"'),
        json.dumps(good[2]).replace('"workflow"', '"id" : "a:b", "workflow"'),
        json.dumps(good[2]).replace("}}", '}, "set": {"1.color": 1}}'),
        json.dumps(good[2]).replace(": 2}", ": 1e400}"),
        json.dumps(good[2]).replace(": 2}", ": NaN}"),
        json.dumps(good[2]).replace(": 2}", ": 02}"),
        json.dumps(good[2]).replace(": 2}", ': "a\\u0000b"}'),
        json.dumps(good[2]).replace(": 2}", ": [2, 0]}"),
    ]
    path.write_text("\n".join(text) + "\n")
    expected = errors_of(load_job_file, path)
    assert len(expected) >= 18
    assert errors_of(scan_job_file, path) == expected


def test_a_good_file_of_repeated_shapes_gives_what_load_job_file_gives(tmp_path):
    extra = [{"take": 1 + i % 3, "optional": i % 2 == 0, "duration_s": 1 + i} for i in range(300)]
    path = write_jobs(tmp_path, 300, extra=extra)
    loaded = load_job_file(path)
    scan = scan_job_file(path)
    assert isinstance(scan, JobScan)
    assert list(scan.job_ids()) == [j.id for j in loaded.jobs]
    reader = scan.reader()
    got = reader.take(300)
    reader.close()
    assert [(j.take, j.optional, j.duration_s) for j in got] == [
        (j.take, j.optional, j.duration_s) for j in loaded.jobs
    ]


def test_halves_say_repeats_across_them_and_join_what_each_found(tmp_path, passes):
    extra = [{"shot": i} for i in range(400)]
    path = write_jobs(tmp_path, 400, extra=extra)
    loaded = load_job_file(path)
    scan = scan_job_file(path)
    assert isinstance(scan, JobScan)
    assert (scan.count, scan.shots, scan.sha256) == (400, 400, loaded.sha256)
    assert list(scan.job_ids()) == [j.id for j in loaded.jobs]
    reader = scan.reader()
    assert [j.line for j in reader.take(400)] == [j.line for j in loaded.jobs]
    reader.close()
    lines = path.read_text().splitlines()
    for repeated in (lines[3], lines[3].replace('"shot": 3', '"shot": 399')):
        path.write_text("\n".join(lines[:-1] + [repeated]) + "\n")
        expected = errors_of(load_job_file, path)
        assert expected
        assert errors_of(scan_job_file, path) == expected


def test_a_process_running_other_threads_reads_in_one_pass(passes):
    """A fork copies its calling thread alone: a Dagster run's process, which runs
    others, never forks for the second half."""
    if passes == "halves":
        pytest.skip("halves forced on")
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert not halves.can_halve(halves.HALVES_BYTES * 4)
    finally:
        release.set()
        other.join()
