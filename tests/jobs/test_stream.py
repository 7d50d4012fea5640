"""A job file validated in one streaming pass (``scan_job_file``) says what ``load_job_file``
says, and builds the same jobs a chunk at a time."""

from __future__ import annotations

import json

import pytest

from comfy_assets.jobs.model import JobFile, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobFileChanged, JobScan, scan_job_file
from tests.support import job_id, write_jobs


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
