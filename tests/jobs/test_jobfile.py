"""Job files: what is accepted, every error reported with file, line and field."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest

from comfy_assets.jobs import workflows
from comfy_assets.jobs.model import NAMESPACE, JobFileError, LineError, canonical_json
from comfy_assets.jobs.parse import job_from_dict, load_job_file
from comfy_assets.jobs.workflows import MAX_WORKFLOW_BYTES, WorkflowCache
from tests.conftest import IMAGE_WORKFLOW, VIDEO_WORKFLOW

ROOT = Path(__file__).resolve().parents[2]
ID1 = "2f6a3c1e-5b7d-4e8f-9a0b-1c2d3e4f5a6b"
ID2 = "7c8d9e0f-1a2b-4c3d-8e4f-5a6b7c8d9e0f"


def write(folder: Path, *lines: dict | str, name: str = "jobs.jsonl") -> Path:
    path = folder / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def errors_of(path: Path) -> list[LineError]:
    with pytest.raises(JobFileError) as err:
        load_job_file(path)
    return err.value.errors


def job(id_: str = ID1, **fields: object) -> dict:
    return {"id": id_, "workflow": "image.json", **fields}


def test_the_sample_workflow_files_are_the_recorded_ones():
    for name, workflow in (("image.json", IMAGE_WORKFLOW), ("video_shot.json", VIDEO_WORKFLOW)):
        assert json.loads((ROOT / "data" / "workflows" / name).read_text()) == workflow
    recorded = json.loads((ROOT / "data" / "recorded" / "video.json").read_text())
    posted = next(
        x["request"]["body"]["prompt"]
        for x in recorded["exchanges"]
        if x["kind"] == "http" and x["label"] == "POST /prompt"
    )
    assert posted == VIDEO_WORKFLOW


def test_a_good_file_resolves_set_into_a_copy_of_the_workflow(workflow_dir):
    path = write(
        workflow_dir,
        job(set={"1.color": 255, "3.filename_prefix": "red"}, shot=2, duration_s=4),
        "",
        {"id": ID2, "workflow": "video_shot.json", "optional": True},
    )
    jf = load_job_file(path)
    assert [j.id for j in jf.jobs] == [ID1, ID2]
    first, second = jf.jobs
    assert first.line == 1 and second.line == 3  # the blank line is skipped but counted
    assert first.workflow["1"]["inputs"]["color"] == 255
    assert first.workflow["3"]["inputs"]["filename_prefix"] == "red"
    assert first.workflow["2"] == IMAGE_WORKFLOW["2"]
    assert (first.shot, first.duration_s, first.optional) == (2, 4.0, False)
    assert isinstance(first.duration_s, float)
    assert (second.shot, second.duration_s, second.optional) == (None, None, True)
    assert second.workflow == VIDEO_WORKFLOW
    assert first.set == {"1.color": 255, "3.filename_prefix": "red"}
    assert jf.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (jf.policy, jf.header.duration_tolerance) == ("delivery", 0.1)
    # The file on disk is untouched.
    assert json.loads((workflow_dir / "image.json").read_text()) == IMAGE_WORKFLOW


def test_prompt_id_is_uuid5_of_job_id_and_workflow_hash(workflow_dir):
    jf = load_job_file(write(workflow_dir, job(set={"1.color": 7})))
    j = jf.jobs[0]
    expected_sha = hashlib.sha256(
        json.dumps(j.workflow, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert j.workflow_sha256 == expected_sha
    assert j.prompt_id == str(uuid.uuid5(NAMESPACE, f"{ID1}:{expected_sha}"))
    assert j.prompt_id == j.prompt_id.lower()


def test_same_inputs_give_the_same_prompt_id_and_a_changed_input_a_new_one(workflow_dir):
    a = load_job_file(write(workflow_dir, job(set={"1.color": 7}), name="a.jsonl")).jobs[0]
    again = load_job_file(write(workflow_dir, job(set={"1.color": 7}), name="b.jsonl")).jobs[0]
    changed = load_job_file(write(workflow_dir, job(set={"1.color": 8}), name="c.jsonl")).jobs[0]
    other_job = load_job_file(
        write(workflow_dir, job(ID2, set={"1.color": 7}), name="d.jsonl")
    ).jobs[0]
    assert a.prompt_id == again.prompt_id
    assert changed.prompt_id != a.prompt_id
    assert other_job.prompt_id != a.prompt_id


def test_an_edit_to_the_workflow_file_changes_the_prompt_id(workflow_dir):
    path = write(workflow_dir, job())
    before = load_job_file(path).jobs[0].prompt_id
    edited = json.loads((workflow_dir / "image.json").read_text())
    edited["4"]["inputs"]["filename_prefix"] = "negative"
    (workflow_dir / "image.json").write_text(json.dumps(edited))
    assert load_job_file(path).jobs[0].prompt_id != before


def test_key_order_and_whitespace_of_the_workflow_do_not_change_the_prompt_id(workflow_dir):
    path = write(workflow_dir, job())
    before = load_job_file(path).jobs[0].prompt_id
    reordered = {k: IMAGE_WORKFLOW[k] for k in reversed(list(IMAGE_WORKFLOW))}
    (workflow_dir / "image.json").write_text(json.dumps(reordered, indent=7))
    assert load_job_file(path).jobs[0].prompt_id == before


def test_an_inline_workflow_is_accepted(tmp_path):
    jf = load_job_file(write(tmp_path, {"id": ID1, "workflow": VIDEO_WORKFLOW}))
    assert jf.jobs[0].workflow == VIDEO_WORKFLOW


def test_a_header_sets_the_film_policy(workflow_dir):
    path = write(
        workflow_dir,
        "",
        {"header": {"policy": "draft", "duration_tolerance": 0.25}},
        job(),
    )
    jf = load_job_file(path)
    assert (jf.policy, jf.header.duration_tolerance) == ("draft", 0.25)
    assert [j.line for j in jf.jobs] == [3]


def test_models_are_the_sorted_unique_loader_inputs(tmp_path):
    workflow = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sdxl.safetensors"}},
        "2": {
            "class_type": "LoraLoader",
            "inputs": {"lora_name": "ink.safetensors", "model": ["1", 0], "strength": 1.0},
        },
        "3": {
            "class_type": "DualCLIPLoader",
            "inputs": {"clip_name1": "t5.safetensors", "clip_name2": "clip_l.safetensors"},
        },
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "5": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sdxl.safetensors"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["3", 0]}},
    }
    (tmp_path / "wf.json").write_text(json.dumps(workflow))
    line = {"id": ID1, "workflow": "wf.json", "set": {"2.lora_name": "paper.safetensors"}}
    j = load_job_file(write(tmp_path, line)).jobs[0]
    assert j.models == (
        "ae.safetensors",
        "clip_l.safetensors",
        "paper.safetensors",
        "sdxl.safetensors",
        "t5.safetensors",
    )


def test_the_sample_workflows_load_no_models(workflow_dir):
    jf = load_job_file(write(workflow_dir, job(), {"id": ID2, "workflow": "video_shot.json"}))
    assert [j.models for j in jf.jobs] == [(), ()]


@pytest.mark.parametrize(
    "line, field, message",
    [
        ("{not json", "json", "not JSON"),
        ("[1, 2]", "json", "expected a JSON object, got an array"),
        ({"workflow": "image.json"}, "id", "missing"),
        (job(id_=7), "id", "expected a UUID string"),
        (job(id_="job-1"), "id", 'not a lowercase hyphenated UUID: "job-1"'),
        (job(id_="2f6a3c1e5b7d4e8f9a0b1c2d3e4f5a6b"), "id", "not a lowercase hyphenated UUID"),
        (job(id_=ID1.upper()), "id", "UUID must be lowercase"),
        ({"id": ID1}, "workflow", "missing"),
        (job(workflow="nope.json"), "workflow", "workflow file not found"),
        (job(workflow=3), "workflow", "expected a file path or an object"),
        (job(workflow={"nodes": [], "links": []}), "workflow", "is a UI workflow"),
        (job(workflow={"1": {"inputs": {}}}), "workflow", "node '1' has no class_type"),
        (job(set={"color": 1}), "set.color", "expected '<node id>.<input name>'"),
        (job(set={"9.color": 1}), "set.9.color", "unknown node '9' (workflow has 1, 2, 3, 4)"),
        (job(set={"1.colour": 1}), "set.1.colour", "node '1' (EmptyImage) has no input 'colour'"),
        (job(set={"1.color": ["2", 0]}), "set.1.color", "is a link"),
        (job(set={"2.image": 5}), "set.2.image", "is linked to node '1'"),
        (job(set=[1]), "set", "expected an object"),
        (job(shot="3"), "shot", "expected an integer"),
        (job(shot=-1), "shot", "expected an integer from 0 to 2147483647"),
        (job(shot=2**31), "shot", "expected an integer from 0 to 2147483647, got 2147483648"),
        (job(shot=10**30), "shot", "expected an integer from 0 to 2147483647"),
        (job(duration_s=0), "duration_s", "expected a number of seconds > 0"),
        (job(duration_s="4"), "duration_s", "expected a number of seconds > 0"),
        (job(optional="yes"), "optional", 'expected true or false, got "yes"'),
        (job(optional=None), "optional", "expected true or false, got null"),
        (job(shot=True), "shot", "expected an integer from 0 to 2147483647, got true"),
        (job(shot=1.5), "shot", "expected an integer from 0 to 2147483647, got 1.5"),
        (job(duration_s=False), "duration_s", "expected a number of seconds > 0, got false"),
        (job(workflow=None), "workflow", "expected a file path or an object, got null"),
        (job(worklfow="image.json"), "worklfow", "unknown field (did you mean 'workflow'?)"),
        (f'{{"id": "{ID1}", "workflow": "image.json", "id": "{ID2}"}}', "id", "repeated"),
    ],
)
def test_each_bad_line_names_file_line_and_field(workflow_dir, line, field, message):
    path = write(workflow_dir, job(ID2), line)
    errors = errors_of(path)
    assert len(errors) == 1, errors
    e = errors[0]
    assert (e.path, e.line, e.field) == (str(path), 2, field)
    assert message in e.message
    assert str(e) == f"{path}:2: {field}: {e.message}"


def test_a_workflow_path_to_a_device_a_fifo_a_folder_or_a_huge_file_is_refused_unread(
    workflow_dir,
):
    os.mkfifo(workflow_dir / "fifo.json")  # nobody writes to it: an open that waits hangs
    (workflow_dir / "folder.json").mkdir()
    with (workflow_dir / "huge.json").open("wb") as f:
        f.truncate(MAX_WORKFLOW_BYTES + 1)  # sparse: no disk spent
    lines = [
        job(id_=str(uuid.UUID(int=n)), workflow=name)
        for n, name in enumerate(["/dev/zero", "fifo.json", "folder.json", "huge.json"], 1)
    ]
    errors = errors_of(write(workflow_dir, *lines))
    assert [(e.line, e.field) for e in errors] == [(n, "workflow") for n in (1, 2, 3, 4)]
    assert all(e.message.endswith("is not a regular file") for e in errors[:3]), errors
    assert errors[3].message.endswith(f"is over the limit of {MAX_WORKFLOW_BYTES} bytes")


def test_an_inline_workflow_has_the_limit_of_a_workflow_file(workflow_dir):
    def inline(prefix_chars: int) -> dict:
        workflow = json.loads((workflow_dir / "image.json").read_text())
        workflow["3"]["inputs"]["filename_prefix"] = "p" * prefix_chars
        return workflow

    # The compact JSON of the workflow is the limit less its other characters.
    rest = len(canonical_json(inline(0)))
    fits, over = job(workflow=inline(MAX_WORKFLOW_BYTES - rest)), job(ID2, workflow=inline(0))
    over["workflow"]["3"]["inputs"]["filename_prefix"] = "p" * (MAX_WORKFLOW_BYTES - rest + 1)
    (e,) = errors_of(write(workflow_dir, fits, over))
    assert (e.line, e.field) == (2, "workflow")
    assert e.message == (
        f"inline workflow is {MAX_WORKFLOW_BYTES + 1} bytes as compact JSON, over the limit "
        f"of {MAX_WORKFLOW_BYTES} bytes of a workflow file"
    )


def test_a_job_file_that_is_a_device_or_a_fifo_is_refused_unread(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")
    for path in (Path("/dev/zero"), tmp_path / "fifo.jsonl"):
        with pytest.raises(JobFileError) as raised:
            load_job_file(path)
        (e,) = raised.value.errors
        assert (e.path, e.line, e.field) == (str(path), 0, "file")
        assert e.message == "cannot read: it is not a regular file"


def test_a_ui_export_gets_the_export_api_hint(workflow_dir):
    ui = {"last_node_id": 4, "nodes": [{"id": 1, "type": "EmptyImage"}], "links": []}
    (workflow_dir / "ui.json").write_text(json.dumps(ui))
    (e,) = errors_of(write(workflow_dir, job(workflow="ui.json")))
    assert e.field == "workflow"
    assert e.message.endswith("is a UI workflow, not API format (export it with 'Export (API)')")
    assert "ui.json" in e.message


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_a_line_nested_too_deeply_is_an_error_of_its_line(workflow_dir, depth):
    # 1,000 levels and more: json's decoder raises RecursionError; 65: our own bound.
    deep = "[" * depth + "]" * depth
    line = f'{{"id": "{ID1}", "workflow": "image.json", "set": {{"1.color": {deep}}}}}'
    errors = errors_of(write(workflow_dir, job(ID2), line))
    assert [str(e) for e in errors] == [
        f"{workflow_dir / 'jobs.jsonl'}:2: json: not usable JSON: nested more than 64 levels "
        "deep (objects and arrays)"
    ]


def test_a_workflow_nested_too_deeply_is_reported(workflow_dir):
    deep = "[" * 5000 + "]" * 5000
    (workflow_dir / "deep.json").write_text(
        f'{{"1": {{"class_type": "X", "inputs": {{"a": {deep}}}}}}}'
    )
    (e,) = errors_of(write(workflow_dir, job(workflow="deep.json")))
    assert (e.line, e.field) == (1, "workflow")
    assert e.message.endswith(
        "deep.json is not usable JSON: nested more than 64 levels deep (objects and arrays)"
    )


def test_a_line_64_levels_deep_is_read(workflow_dir):
    value = 0
    for _ in range(62):  # the line, "set", then 62 arrays: 64 levels
        value = [value]
    (j,) = load_job_file(write(workflow_dir, job(set={"1.color": value}))).jobs
    assert j.set["1.color"] == value


def test_bytes_that_are_not_utf8_are_reported_on_their_line(workflow_dir):
    path = workflow_dir / "jobs.jsonl"
    first = json.dumps(job(ID2)).encode()
    path.write_bytes(first + b'\n{"id": "' + ID1.encode() + b'", "workflow": "im\xff\xfe"}\n')
    (e,) = errors_of(path)
    assert str(e) == f"{path}:2: file: not UTF-8 at byte 63 of the line: invalid start byte"


def test_a_bom_does_not_move_the_column_of_a_byte_that_is_not_utf8(workflow_dir):
    path = workflow_dir / "jobs.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "\xff"}\n')
    (e,) = errors_of(path)
    assert str(e) == f"{path}:1: file: not UTF-8 at byte 9 of the line: invalid start byte"


def test_a_workflow_that_is_not_json_is_reported(workflow_dir):
    (workflow_dir / "broken.json").write_text("{")
    (e,) = errors_of(write(workflow_dir, job(workflow="broken.json")))
    assert "broken.json is not JSON" in e.message


def test_a_repeated_id_names_the_first_line(workflow_dir):
    errors = errors_of(write(workflow_dir, job(), job(ID2), "", job()))
    assert [(e.line, e.field) for e in errors] == [(4, "id")]
    assert f"{ID1} repeated; first on line 1" in errors[0].message


def test_every_error_of_every_line_is_listed_at_once(workflow_dir):
    path = write(
        workflow_dir,
        job(id_="X", shot="1"),
        job(ID2),
        "{oops",
        job(ID1, set={"1.nope": 1}, optional=1),
    )
    with pytest.raises(JobFileError) as err:
        load_job_file(path)
    got = [(e.line, e.field) for e in err.value.errors]
    assert got == [(1, "id"), (1, "shot"), (3, "json"), (4, "optional"), (4, "set.1.nope")]
    lines = str(err.value).splitlines()
    assert len(lines) == 5
    assert lines[0].startswith(f"{path}:1: id: ")
    assert lines[2].startswith(f"{path}:3: json: not JSON")


def test_a_header_that_is_not_first_is_an_error(workflow_dir):
    (e,) = errors_of(write(workflow_dir, job(), {"header": {"policy": "draft"}}))
    assert (e.line, e.field) == (2, "header")
    assert "first non-blank line" in e.message


@pytest.mark.parametrize(
    "header, field",
    [
        ({"policy": "final"}, "header.policy"),
        ({"duration_tolerance": "10%"}, "header.duration_tolerance"),
        ({"duration_tolerance": 2}, "header.duration_tolerance"),
        ({"polcy": "draft"}, "header.polcy"),
    ],
)
def test_a_bad_header_is_an_error(workflow_dir, header, field):
    (e,) = errors_of(write(workflow_dir, {"header": header}, job()))
    assert (e.line, e.field) == (1, field)


def test_a_missing_job_file_is_a_job_file_error(tmp_path):
    (e,) = errors_of(tmp_path / "absent.jsonl")
    assert (e.line, e.field) == (0, "file")
    assert "cannot read" in e.message


@pytest.mark.parametrize(
    "text",
    ["", "\n\n  \n", '{"header": {"policy": "draft"}}\n', '\n{"header": {}}\n\n'],
    ids=["zero-bytes", "blank-lines", "header-only", "header-between-blanks"],
)
def test_a_file_without_jobs_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(JobFileError) as err:
        load_job_file(path)
    assert [(e.path, e.line, e.field, e.message) for e in err.value.errors] == [
        (str(path), 0, "file", "no jobs in file")
    ]
    assert str(err.value) == f"{path}:0: file: no jobs in file"


def test_a_file_whose_only_line_is_bad_reports_that_line_not_no_jobs(tmp_path):
    (e,) = errors_of(write(tmp_path, "{oops"))
    assert (e.line, e.field) == (1, "json")


# Each line is written raw: json.dumps would refuse to write these numbers.
@pytest.mark.parametrize(
    "set_text, field, shown",
    [
        ('{"1.color": NaN}', "set.1.color", "got NaN"),
        ('{"1.color": Infinity}', "set.1.color", "got Infinity"),
        ('{"1.color": -Infinity}', "set.1.color", "got -Infinity"),
        ('{"1.color": 1e400}', "set.1.color", "got 1e400"),
        ('{"1.color": -1e400}', "set.1.color", "got -1e400"),
        ('{"1.color": [1, {"a": [NaN]}]}', "set.1.color", "holds NaN"),
        ('{"1.color": {"deep": 1e999}}', "set.1.color", "holds 1e999"),
    ],
)
def test_a_non_finite_set_value_names_line_and_field(workflow_dir, set_text, field, shown):
    line = f'{{"id": "{ID1}", "workflow": "image.json", "set": {set_text}}}'
    path = write(workflow_dir, job(ID2), line)
    (e,) = errors_of(path)
    assert (e.path, e.line, e.field) == (str(path), 2, field)
    assert shown in e.message
    assert "finite" in e.message


@pytest.mark.parametrize(
    "line, field",
    [
        (f'{{"id": "{ID1}", "workflow": "image.json", "duration_s": NaN}}', "duration_s"),
        (f'{{"id": "{ID1}", "workflow": "image.json", "shot": Infinity}}', "shot"),
        (f'{{"id": "{ID1}", "workflow": "image.json", "extra": -Infinity}}', "extra"),
        (
            f'{{"id": "{ID1}", "workflow": {{"1": {{"class_type": "X", "inputs": '
            '{"v": NaN}}}}',
            "workflow",
        ),
        ('{"header": {"duration_tolerance": NaN}}', "header.duration_tolerance"),
    ],
)
def test_a_nan_or_infinity_literal_in_any_field_is_an_error(workflow_dir, line, field):
    path = write(workflow_dir, line, job(ID2))
    (e,) = errors_of(path)
    assert (e.line, e.field) == (1, field)
    assert "finite" in e.message


def test_a_workflow_file_holding_nan_is_an_error(workflow_dir):
    (workflow_dir / "nan.json").write_text(
        '{"1": {"class_type": "EmptyImage", "inputs": {"width": NaN}}}'
    )
    (e,) = errors_of(write(workflow_dir, job(workflow="nan.json")))
    assert e.field == "workflow"
    assert "nan.json node '1' holds NaN" in e.message


def test_finite_floats_still_pass(workflow_dir):
    line = f'{{"id": "{ID1}", "workflow": "image.json", "set": {{"1.color": 1.5e300}}}}'
    (only,) = load_job_file(write(workflow_dir, line)).jobs
    assert only.workflow["1"]["inputs"]["color"] == 1.5e300


def test_a_queued_job_with_a_nan_float_is_rejected(workflow_dir):
    with pytest.raises(JobFileError) as err:
        job_from_dict(
            job(set={"1.color": float("nan")}), base_dir=workflow_dir, source="queue", line=1
        )
    assert [(e.path, e.line, e.field) for e in err.value.errors] == [("queue", 1, "set.1.color")]
    assert "got NaN" in err.value.errors[0].message


def test_a_repeated_shot_is_an_error_on_the_later_line_naming_the_first(workflow_dir):
    path = write(
        workflow_dir,
        job(shot=3),
        job(ID2, shot=4),
        "",
        job("0b5a7c9e-3d1f-4a2b-8c6d-7e8f9a0b1c2d", shot=3),
    )
    (e,) = errors_of(path)
    assert (e.line, e.field) == (4, "shot")
    assert e.message == "3 repeated; first on line 1"


def test_jobs_without_shots_and_distinct_shots_are_fine(workflow_dir):
    jf = load_job_file(write(workflow_dir, job(shot=0), job(ID2)))
    assert [j.shot for j in jf.jobs] == [0, None]


def test_ten_thousand_jobs_share_one_workflow_file_read_once(workflow_dir, monkeypatch):
    lines = [
        job(str(uuid.UUID(int=i, version=4)), set={"1.color": i}, shot=i) for i in range(10_000)
    ]
    path = write(workflow_dir, *lines)
    reads: list[str] = []
    original = workflows.read_regular_file

    def counting_read(file: Path, max_bytes: int | None = None) -> bytes:
        reads.append(file.name)
        return original(file, max_bytes)

    monkeypatch.setattr(workflows, "read_regular_file", counting_read)
    jf = load_job_file(path)
    assert len(jf.jobs) == 10_000
    assert reads == ["image.json"]
    assert len({j.prompt_id for j in jf.jobs}) == 10_000
    # Each job owns its copy: changing one does not change another.
    jf.jobs[0].workflow["1"]["inputs"]["width"] = 1
    assert jf.jobs[1].workflow["1"]["inputs"]["width"] == 64


def test_job_from_dict_validates_like_a_file_line(workflow_dir):
    j = job_from_dict(job(set={"1.color": 9}), base_dir=workflow_dir, source="queue:jobs", line=5)
    file_job = load_job_file(write(workflow_dir, job(set={"1.color": 9}))).jobs[0]
    assert j.prompt_id == file_job.prompt_id
    assert j.line == 5
    with pytest.raises(JobFileError) as err:
        job_from_dict(job(set={"1.colour": 9}), base_dir=workflow_dir, source="queue:jobs", line=5)
    assert [(e.path, e.line, e.field) for e in err.value.errors] == [
        ("queue:jobs", 5, "set.1.colour")
    ]


def test_job_from_dict_rejects_a_non_object(workflow_dir):
    with pytest.raises(JobFileError, match="queue:1: job: expected a JSON object"):
        job_from_dict("hello", base_dir=workflow_dir, source="queue", line=1)


def test_canonical_json_is_sorted_and_compact():
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == '{"a":[1,{"c":3,"d":2}],"b":1}'


def test_job_files_loaded_with_one_workflow_cache_read_a_shared_workflow_once(workflow_dir):
    class Counting(WorkflowCache):
        reads = 0

        def _load(self, path: Path):  # type: ignore[override]
            Counting.reads += 1
            return super()._load(path)

    first = write(workflow_dir, job(ID1), name="a.jsonl")
    second = write(workflow_dir, job(ID2), name="b.jsonl")
    cache = Counting()
    a, b = load_job_file(first, cache), load_job_file(second, cache)
    assert Counting.reads == 1
    assert a.jobs[0].workflow == b.jobs[0].workflow


def test_control_characters_of_a_field_name_are_shown_not_sent_to_the_terminal(workflow_dir):
    path = write(workflow_dir, job(**{"x\x1b]0;pwned\x07": 1, "set": {"1.\x1b[31mRED": 1}}))
    with pytest.raises(JobFileError) as err:
        load_job_file(path)
    said = str(err.value)
    assert 'json: the key "x\\u001b]0;pwned\\u0007" holds a control character (U+001B)' in said
    assert 'set: the key "1.\\u001b[31mRED" holds a control character (U+001B)' in said
    assert not any(c in said for c in "\x1b\x07")
