"""Strings no server or store takes (a NUL, a lone UTF-16 surrogate; a control character
in a key) are refused where a job comes in: a job file's line, a workflow file, a queue
message, an API request, each with its field named. JSON's \\u escapes write them, so
every line here is written with ``json.dumps`` (ASCII: the file itself is valid UTF-8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from comfy_assets.api.submission import Invalid, parse_submission
from comfy_assets.jobs.model import JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.messages import parse_message
from tests.api_support import data_uri, job_body

ID1 = "2f6a3c1e-5b7d-4e8f-9a0b-1c2d3e4f5a6b"
ID2 = "7c8d9e0f-1a2b-4c3d-8e4f-5a6b7c8d9e0f"
NUL = "a NUL character (U+0000)"
SURROGATE = "a lone UTF-16 surrogate (U+D800)"
INLINE = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}},
}


def _errors(folder: Path, line: dict[str, Any]) -> list[str]:
    """The errors of a job file whose first line is good and second is ``line``."""
    path = folder / "jobs.jsonl"
    good = {"id": ID2, "workflow": "image.json"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(JobFileError) as err:
        load_job_file(path)
    return [str(e) for e in err.value.errors]


def _inline(value: str, *, key: str = "filename_prefix") -> dict[str, Any]:
    workflow = json.loads(json.dumps(INLINE))
    workflow["2"]["inputs"][key] = value
    return workflow


@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {"set": {"3.filename_prefix": "a\x00b"}},
            f"set.3.filename_prefix: holds {NUL}, which neither",
        ),
        (
            {"set": {"3.filename_prefix": "a\ud800b"}},
            f"set.3.filename_prefix: holds {SURROGATE}, which neither",
        ),
        (
            {"set": {"3.filename_prefix": ["ok", {"deep": "\x00"}]}},
            f'set.3.filename_prefix: holds {NUL} at [1]["deep"], which neither',
        ),
        (
            {"set": {"3.filename_prefix\x00": "x"}},
            f'set: the key "3.filename_prefix\\u0000" holds {NUL}',
        ),
        (
            {"set": {"3.filename\x1b[2Jprefix": "x"}},
            'set: the key "3.filename\\u001b[2Jprefix" holds a control character (U+001B)',
        ),
        ({"inputs": {"1.image": "pic\ud800.png"}}, f"inputs.1.image: holds {SURROGATE}"),
        ({"inputs": {"1.ima\x00ge": "pic.png"}}, f'inputs: the key "1.ima\\u0000ge" holds {NUL}'),
        (
            {"workflow": _inline("a\x00b")},
            f'workflow: holds {NUL} at ["2"]["inputs"]["filename_prefix"], which neither',
        ),
        (
            {"workflow": _inline("x", key="filename\ud800")},
            f'workflow: the key "filename\\ud800" at ["2"]["inputs"] holds {SURROGATE}',
        ),
        ({"extra\x00": 1}, f'json: the key "extra\\u0000" holds {NUL}'),
    ],
)
def test_a_job_line_holding_what_no_server_or_store_takes_names_its_field(
    workflow_dir: Path, fields: dict[str, Any], expected: str
) -> None:
    (error,) = _errors(workflow_dir, {"id": ID1, "workflow": "image.json", **fields})
    assert error.startswith(f"{workflow_dir / 'jobs.jsonl'}:2: ")
    assert expected in error
    error.encode("utf-8")  # printable: nothing of the line's own characters in it


@pytest.mark.parametrize("char, words", [("\x00", NUL), ("\ud800", SURROGATE)])
def test_an_id_holding_a_nul_or_a_surrogate_is_refused_once(
    workflow_dir: Path, char: str, words: str
) -> None:
    (error,) = _errors(workflow_dir, {"id": ID1[:-1] + char, "workflow": "image.json"})
    assert f":2: id: holds {words}" in error


def test_a_workflow_file_holding_a_nul_is_refused_with_its_place(workflow_dir: Path) -> None:
    (workflow_dir / "nul.json").write_text(json.dumps(_inline("a\x00b")))
    (error,) = _errors(workflow_dir, {"id": ID1, "workflow": "nul.json"})
    assert f":2: workflow: workflow file {workflow_dir / 'nul.json'} holds {NUL} at " in error
    assert '["2"]["inputs"]["filename_prefix"]' in error


def test_text_with_newlines_tabs_and_astral_characters_passes(workflow_dir: Path) -> None:
    path = workflow_dir / "jobs.jsonl"
    line = {"id": ID1, "workflow": "image.json", "set": {"3.filename_prefix": "a\nb\t\U0001f600"}}
    path.write_text(json.dumps(line) + "\n")  # the emoji as a surrogate pair: one character
    (job,) = load_job_file(path).jobs
    assert job.workflow["3"]["inputs"]["filename_prefix"] == "a\nb\t\U0001f600"


def test_a_queue_message_holding_a_nul_is_refused_before_its_inputs_are_read(
    tmp_path: Path,
) -> None:
    body = {
        "id": ID1,
        "workflow": _inline("ok"),
        "set": {"2.filename_prefix": "a\ud800"},
        "inputs": {"1.image": {"path": "k\x00.png", "sha256": "0" * 64, "size": 1, "base64": ""}},
    }
    with pytest.raises(JobFileError) as err:
        parse_message(json.dumps(body).encode(), workflows_dir=tmp_path, source="q message 7")
    assert sorted((e.field, e.message.split(",")[0]) for e in err.value.errors) == [
        ("inputs.1.image", f'holds {NUL} at ["path"]'),
        ("set.2.filename_prefix", f"holds {SURROGATE}"),
    ]


def test_a_request_holding_a_surrogate_is_invalid_with_its_json_pointer() -> None:
    body = job_body(set={"1.color": 1, "3.filename_prefix": "\ud800"})
    body["inputs"] = {"1.ima\x00ge": data_uri(b"png")}
    body["webhook"] = "http://127.0.0.1:9/\x00"
    with pytest.raises(Invalid) as err:
        parse_submission(body, partition="api-alice", max_input_bytes=1024, max_message_bytes=2**20)
    fields = sorted((p.field, p.message.split(",")[0]) for p in err.value.problems)
    assert fields == [
        ("/inputs", f'the key "1.ima\\u0000ge" holds {NUL}'),
        ("/set/3.filename_prefix", f"holds {SURROGATE}"),
        ("/webhook", f"holds {NUL}"),
    ]
