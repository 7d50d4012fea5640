"""Job lines with input files, inputs from other jobs and takes: what each job's identity
covers, and every hostile input refused at validation with file:line:field."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest

from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import (
    INPUT_SUBFOLDER,
    NAMESPACE,
    InputChanged,
    InputFile,
    InputFromJob,
    JobFile,
    JobFileError,
    LineError,
    canonical_json,
    prompt_id_for,
)
from comfy_assets.jobs.parse import job_from_dict, load_job_file
from tests.support import WORKFLOWS, job_id, opened_files

# LoadImage -> ImageInvert -> SaveImage: a workflow that renders the inverse of its input.
INVERT = {
    "10": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
    "11": {"class_type": "ImageInvert", "inputs": {"image": ["10", 0]}},
    "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": "inv"}},
}
A, B, C, D = (job_id(i, "inputs") for i in range(4))


def shots_folder(tmp_path: Path) -> Path:
    """``tmp_path/shots`` holding ``invert.json`` and ``pics/a.png`` (5 bytes)."""
    folder = tmp_path / "shots"
    (folder / "pics").mkdir(parents=True)
    (folder / "invert.json").write_text(json.dumps(INVERT))
    (folder / "pics" / "a.png").write_bytes(b"AAAAA")
    return folder


def line(id_: str, **fields: object) -> dict:
    return {"id": id_, "workflow": "invert.json", **fields}


def write(folder: Path, *lines: dict) -> Path:
    path = folder / "jobs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def errors_of(path: Path, rules: InputRules | None = None) -> list[LineError]:
    with pytest.raises(JobFileError) as err:
        load_job_file(path, rules=rules)
    return err.value.errors


def by_id(job_file: JobFile) -> dict:
    return {j.id: j for j in job_file.jobs}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- input files ---------------------------------------------------------------------------


def test_an_input_file_is_hashed_and_named_by_its_content_in_the_workflow(tmp_path):
    folder = shots_folder(tmp_path)
    (folder / "pics" / "Key Frame.PNG").write_bytes(b"\x89PNG picture")
    path = write(folder, line(A, inputs={"10.image": "pics/Key Frame.PNG"}, shot=1))
    job = load_job_file(path).jobs[0]

    digest = sha(b"\x89PNG picture")
    assert job.inputs == (InputFile("10.image", "10", "image", "pics/Key Frame.PNG", digest, 12),)
    (item,) = job.inputs
    assert isinstance(item, InputFile)
    assert item.source == (folder / "pics" / "Key Frame.PNG").resolve()
    assert item.upload_name == f"{digest}.png"  # the extension lowercased, the name dropped
    assert item.read() == b"\x89PNG picture"
    placeholder = f"{INPUT_SUBFOLDER}/{digest}.png"
    assert job.workflow["10"]["inputs"]["image"] == placeholder
    assert job.workflow["11"] == INVERT["11"]
    assert job.workflow_sha256 == sha(canonical_json(job.workflow).encode())
    assert job.prompt_id == str(uuid.uuid5(NAMESPACE, f"{A}:{job.workflow_sha256}"))
    assert job.depends_on == () and job.take == 1
    # The workflow file on disk is untouched.
    assert json.loads((folder / "invert.json").read_text()) == INVERT


@pytest.mark.parametrize(
    ("path", "suffix"),
    [("a.png", ".png"), ("a.tar.GZ", ".gz"), ("noext", ""), ("a.pn-g", ""), ("a.abcdefghi", "")],
)
def test_an_upload_name_keeps_only_a_short_plain_extension(path, suffix):
    item = InputFile("1.image", "1", "image", path, "ab" * 32, 3)
    assert item.upload_name == "ab" * 32 + suffix


def test_two_inputs_with_the_same_base_name_and_other_bytes_never_share_a_name(tmp_path):
    folder = shots_folder(tmp_path)
    for name, data in (("sh010", b"first"), ("sh020", b"second"), ("sh030", b"first")):
        (folder / name).mkdir()
        (folder / name / "key.png").write_bytes(data)
    path = write(
        folder,
        line(A, inputs={"10.image": "sh010/key.png"}),
        line(B, inputs={"10.image": "sh020/key.png"}),
        line(C, inputs={"10.image": "sh030/key.png"}),
    )
    a, b, c = load_job_file(path).jobs
    image = [j.workflow["10"]["inputs"]["image"] for j in (a, b, c)]
    assert image[0] != image[1] and image[0] == image[2]  # the same bytes, the same name
    assert a.workflow_sha256 != b.workflow_sha256 and a.workflow_sha256 == c.workflow_sha256
    # The same job line with the other picture is another job.
    path.write_text(json.dumps(line(A, inputs={"10.image": "sh020/key.png"})) + "\n")
    assert load_job_file(path).jobs[0].prompt_id not in {a.prompt_id, b.prompt_id}


def test_changing_one_inputs_bytes_changes_that_jobs_prompt_id_only(tmp_path):
    folder = shots_folder(tmp_path)
    for name in ("1.png", "2.png", "3.png"):
        (folder / "pics" / name).write_bytes(name.encode())
    path = write(
        folder,
        line(A, inputs={"10.image": "pics/1.png"}),
        line(B, inputs={"10.image": "pics/2.png"}),
        line(C, inputs={"10.image": "pics/3.png"}),
        line(D, set={"12.filename_prefix": "none"}),
    )
    before = {j.id: j.prompt_id for j in load_job_file(path).jobs}
    assert load_job_file(path).jobs == list(by_id(load_job_file(path)).values())  # stable
    (folder / "pics" / "2.png").write_bytes(b"2.png, retouched")
    after = {j.id: j.prompt_id for j in load_job_file(path).jobs}
    assert [k for k in before if before[k] != after[k]] == [B]


def test_an_input_file_that_changes_after_validation_is_refused_when_read(tmp_path):
    folder = shots_folder(tmp_path)
    job = load_job_file(write(folder, line(A, inputs={"10.image": "pics/a.png"}))).jobs[0]
    (folder / "pics" / "a.png").write_bytes(b"BBBBB")
    (item,) = job.inputs
    assert isinstance(item, InputFile)
    with pytest.raises(InputChanged, match="10.image"):
        item.read()


def test_a_picture_shared_by_a_thousand_jobs_is_read_once_per_load(tmp_path):
    folder = shots_folder(tmp_path)
    lines = [
        line(job_id(i, "shared"), inputs={"10.image": "./pics/a.png" if i % 2 else "pics/a.png"})
        for i in range(1000)
    ]
    path = write(folder, *lines)
    with opened_files() as opened:
        job_file = load_job_file(path)
    picture = os.path.realpath(folder / "pics" / "a.png")
    assert opened.count(picture) == 1
    assert len({j.workflow_sha256 for j in job_file.jobs}) == 1
    with opened_files() as opened:
        load_job_file(path)
    assert opened.count(picture) == 1  # once per load: a new load reads it again


def test_an_input_file_exactly_at_the_size_limit_is_accepted(tmp_path):
    folder = shots_folder(tmp_path)
    path = write(folder, line(A, inputs={"10.image": "pics/a.png"}))
    job = load_job_file(path, rules=InputRules(max_input_bytes=5)).jobs[0]
    assert job.inputs[0].size == 5
    (error,) = errors_of(path, InputRules(max_input_bytes=4))
    assert (error.line, error.field) == (1, "inputs.10.image")
    assert (
        "over the limit of 4 bytes (--max-input-bytes, or COMFY_ASSETS_MAX_INPUT_BYTES in Dagster)"
        in error.message
    )


def test_a_link_out_of_the_folder_is_followed_only_when_allowed(tmp_path):
    folder = shots_folder(tmp_path)
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "plate.png").write_bytes(b"plate")
    (folder / "pics" / "plate.png").symlink_to(tmp_path / "library" / "plate.png")
    (folder / "pics" / "inside.png").symlink_to(folder / "pics" / "a.png")  # stays inside
    path = write(
        folder,
        line(A, inputs={"10.image": "pics/plate.png"}),
        line(B, inputs={"10.image": "pics/inside.png"}),
    )
    with opened_files() as opened:
        (error,) = errors_of(path)
    assert (error.line, error.field) == (1, "inputs.10.image")
    assert "is a link that leads out of the job file's folder" in error.message
    assert str((tmp_path / "library" / "plate.png").resolve()) not in opened

    plate, inside = load_job_file(path, rules=InputRules(follow_links=True)).jobs
    assert plate.inputs[0].source == (tmp_path / "library" / "plate.png").resolve()
    assert plate.inputs[0].sha256 == sha(b"plate")
    assert inside.inputs[0].sha256 == sha(b"AAAAA")


def test_job_from_dict_reads_inputs_relative_to_its_folder(tmp_path):
    folder = shots_folder(tmp_path)
    job = job_from_dict(
        line(A, inputs={"10.image": "pics/a.png"}, take=3), base_dir=folder, source="q"
    )
    assert job.inputs[0].sha256 == sha(b"AAAAA") and job.take == 3
    with pytest.raises(JobFileError) as err:
        job_from_dict(
            line(A, inputs={"12.images": {"job": B, "node": "12"}}), base_dir=folder, source="q"
        )
    assert [(e.line, e.field) for e in err.value.errors] == [(1, "inputs.12.images")]


# -- takes ---------------------------------------------------------------------------------


def test_a_job_line_without_inputs_or_take_keeps_the_prompt_id_it_always_had(tmp_path):
    (tmp_path / "image.json").write_text((WORKFLOWS / "image.json").read_text())
    old_line = {
        "id": "2f6a3c1e-5b7d-4e8f-9a0b-1c2d3e4f5a6b",
        "workflow": "image.json",
        "set": {"1.color": 255},
        "shot": 1,
    }
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps(old_line) + "\n")
    job = load_job_file(path).jobs[0]
    # Computed by the parser before inputs and takes existed.
    assert job.prompt_id == "f8cbc9e2-8a69-5f6d-9f2e-5f4b1bcabad6"
    assert job.inputs == () and job.take == 1
    path.write_text(json.dumps({**old_line, "take": 1}) + "\n")
    assert load_job_file(path).jobs[0].prompt_id == "f8cbc9e2-8a69-5f6d-9f2e-5f4b1bcabad6"


def test_a_take_is_part_of_the_prompt_id_and_not_of_the_workflow(tmp_path):
    folder = shots_folder(tmp_path)
    path = write(folder, line(A, inputs={"10.image": "pics/a.png"}), line(B))
    first = by_id(load_job_file(path))
    path = write(folder, line(A, inputs={"10.image": "pics/a.png"}, take=2), line(B))
    second = by_id(load_job_file(path))
    assert second[A].take == 2
    assert second[A].workflow_sha256 == first[A].workflow_sha256
    assert second[A].prompt_id == str(
        uuid.uuid5(NAMESPACE, f"{A}:{first[A].workflow_sha256}:take=2")
    )
    assert second[A].prompt_id == prompt_id_for(A, first[A].workflow_sha256, 2)
    assert second[A].prompt_id != first[A].prompt_id
    assert second[B].prompt_id == first[B].prompt_id


@pytest.mark.parametrize("take", [0, -1, True, 1.0, "2", None, 2**31])
def test_a_take_that_is_not_an_integer_from_1_is_an_error_of_its_line(tmp_path, take):
    folder = shots_folder(tmp_path)
    path = write(folder, line(A), line(B, take=take))
    (error,) = errors_of(path)
    assert (error.line, error.field) == (2, "take")
    assert error.message.startswith("expected an integer from 1 to 2147483647, got ")


# -- inputs from other jobs ----------------------------------------------------------------


def test_a_chained_job_names_its_upstream_prompt_id_whatever_the_line_order(tmp_path):
    folder = shots_folder(tmp_path)
    path = write(
        folder,
        line(C, inputs={"10.image": {"job": B, "node": "12", "index": 1}}),
        line(B, inputs={"10.image": {"job": A, "node": "12"}}),
        line(A, inputs={"10.image": "pics/a.png"}),
    )
    job_file = load_job_file(path)
    assert [j.id for j in job_file.jobs] == [C, B, A]  # line order
    jobs = by_id(job_file)
    assert jobs[B].inputs == (
        InputFromJob("10.image", "10", "image", A, "12", 0, jobs[A].prompt_id),
    )
    assert jobs[B].depends_on == (A,) and jobs[C].depends_on == (B,)
    assert jobs[B].workflow["10"]["inputs"]["image"] == (
        f"{INPUT_SUBFOLDER}/job-{jobs[A].prompt_id}-12-0"
    )
    assert jobs[C].workflow["10"]["inputs"]["image"] == (
        f"{INPUT_SUBFOLDER}/job-{jobs[B].prompt_id}-12-1"
    )


def test_a_new_take_or_new_bytes_upstream_render_its_dependants_again(tmp_path):
    folder = shots_folder(tmp_path)
    (folder / "pics" / "other.png").write_bytes(b"other")

    def prompt_ids(take: int, picture: str) -> dict[str, str]:
        path = write(
            folder,
            line(A, inputs={"10.image": picture}, take=take),
            line(B, inputs={"10.image": {"job": A, "node": "12"}}),
            line(C, inputs={"10.image": {"job": B, "node": "12"}}),
            line(D, inputs={"10.image": "pics/a.png"}),
        )
        return {j.id: j.prompt_id for j in load_job_file(path).jobs}

    first = prompt_ids(1, "pics/a.png")
    retake = prompt_ids(2, "pics/a.png")
    repaint = prompt_ids(1, "pics/other.png")
    for changed in (retake, repaint):
        assert [k for k in first if first[k] != changed[k]] == [A, B, C]
    assert prompt_ids(1, "pics/a.png") == first


# -- hostile inputs ------------------------------------------------------------------------


def test_every_hostile_input_is_refused_with_its_line_and_field_and_nothing_else(tmp_path):
    folder = shots_folder(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.png"
    secret.write_bytes(b"not yours")
    (folder / "pics" / "out.png").symlink_to(secret)
    (folder / "pics" / "big.png").write_bytes(b"x" * 65)
    os.mkfifo(folder / "pics" / "pipe.png")
    file_cases: list[tuple[object, str]] = [
        (str(secret), "is an absolute path"),
        ("../outside/secret.png", "has a '..' component"),
        ("pics/../pics/a.png", "has a '..' component"),
        ("pics\\a.png", "holds a backslash"),
        ("pics/out.png", "is a link that leads out of the job file's folder"),
        ("pics/none.png", "no such file"),
        ("pics", "a folder, not a regular file"),
        ("pics/pipe.png", "a special file, not a regular file"),
        ("pics/big.png", "over the limit of 64 bytes (--max-input-bytes"),
        ("pics/a\n.png", "holds a control character (U+000A)"),
        ("pics/a\x7f.png", "holds a control character (U+007F)"),
        ("pics/a\x85.png", "holds a control character (U+0085)"),
        ("", "got an empty string"),
        (5, "got an integer"),
    ]
    lines = [line(A, inputs={"10.image": "pics/a.png"})]  # line 1: good, and referred to
    expected: list[tuple[int, str, str]] = []
    for n, (value, message) in enumerate(file_cases):
        lines.append(line(job_id(n, "hostile"), inputs={"10.image": value}))
        expected.append((len(lines), "inputs.10.image", message))
    key_cases: list[tuple[dict, str, str]] = [
        ({"inputs": {"99.image": "pics/a.png"}}, "inputs.99.image", "unknown node '99'"),
        ({"inputs": {"10.picture": "pics/a.png"}}, "inputs.10.picture", "has no input"),
        ({"inputs": {"11.image": "pics/a.png"}}, "inputs.11.image", "is linked to node '10'"),
        ({"inputs": {"image": "pics/a.png"}}, "inputs.image", "expected '<node id>.<input"),
        (
            {"set": {"10.image": "x.png"}, "inputs": {"10.image": "pics/a.png"}},
            "inputs.10.image",
            "is also in 'set'",
        ),
        ({"inputs": ["pics/a.png"]}, "inputs", "expected an object, got an array"),
        ({"inputs": {"10.image": {"job": D, "node": "12"}}}, "inputs.10.image", "no job"),
        (
            {"inputs": {"10.image": {"job": A, "node": "99"}}},
            "inputs.10.image",
            f"job {A} (line 1) has no node '99' (its workflow has 10, 11, 12)",
        ),
        (
            {"inputs": {"10.image": {"job": A, "node": "12", "index": -1}}},
            "inputs.10.image",
            "in 'index', got -1",
        ),
        (
            {"inputs": {"10.image": {"job": A, "node": "12", "index": True}}},
            "inputs.10.image",
            "in 'index', got true",
        ),
        (
            {"inputs": {"10.image": {"job": A, "node": 12}}},
            "inputs.10.image",
            "expected a node id (a string) in 'node', got 12",
        ),
        (
            {"inputs": {"10.image": {"job": A, "node": "12", "frame": 3}}},
            "inputs.10.image",
            'unknown field "frame"',
        ),
    ]
    for n, (fields, name, message) in enumerate(key_cases):
        lines.append(line(job_id(n, "hostile-keys"), **fields))
        expected.append((len(lines), name, message))
    self_id = job_id(99, "hostile")
    lines.append(line(self_id, inputs={"10.image": {"job": self_id, "node": "12"}}))
    expected.append((len(lines), "inputs.10.image", "takes an input from its own job"))
    path = write(folder, *lines)

    with opened_files() as opened:
        errors = errors_of(path, InputRules(max_input_bytes=64))
    assert sorted((e.line, e.field) for e in errors) == sorted(
        (number, name) for number, name, _ in expected
    )
    assert [e.line for e in errors] == sorted(e.line for e in errors)  # in line order
    found = {(e.line, e.field): e for e in errors}
    for number, name, message in expected:
        error = found[(number, name)]
        assert message in error.message, (number, error)
        assert str(error).startswith(f"{path}:{number}: {name}: ")
    assert str(secret.resolve()) not in opened


def test_a_cycle_of_three_chained_jobs_is_an_error_of_each_of_its_lines(tmp_path):
    folder = shots_folder(tmp_path)
    path = write(
        folder,
        line(A, inputs={"10.image": "pics/a.png"}),
        line(B, inputs={"10.image": {"job": C, "node": "12"}}),
        line(C, inputs={"10.image": {"job": D, "node": "12"}}),
        line(D, inputs={"10.image": {"job": B, "node": "12"}}),
        line(job_id(9, "after"), inputs={"10.image": {"job": A, "node": "12"}}),
    )
    errors = errors_of(path)
    assert [str(e) for e in errors] == [
        f"{path}:2: inputs.10.image: a cycle of chained jobs: line 2 -> line 3 -> line 4 "
        "-> line 2 (each takes an input from the next)",
        f"{path}:3: inputs.10.image: a cycle of chained jobs: line 3 -> line 4 -> line 2 "
        "-> line 3 (each takes an input from the next)",
        f"{path}:4: inputs.10.image: a cycle of chained jobs: line 4 -> line 2 -> line 3 "
        "-> line 4 (each takes an input from the next)",
    ]


def test_a_knot_of_chained_jobs_names_all_its_lines(tmp_path):
    folder = shots_folder(tmp_path)
    both = {"10.image": {"job": B, "node": "12"}, "12.filename_prefix": {"job": C, "node": "12"}}
    path = write(
        folder,
        line(A, inputs=both),
        line(B, inputs={"10.image": {"job": A, "node": "12"}}),
        line(C, inputs={"10.image": {"job": A, "node": "12"}}),
    )
    errors = errors_of(path)
    assert sorted((e.line, e.field) for e in errors) == [
        (1, "inputs.10.image"),
        (1, "inputs.12.filename_prefix"),
        (2, "inputs.10.image"),
        (3, "inputs.10.image"),
    ]
    assert {e.message for e in errors} == {
        "a cycle of chained jobs: lines 1, 2, 3 take inputs from each other"
    }


def test_a_long_chain_resolves_without_recursion(tmp_path):
    folder = shots_folder(tmp_path)
    ids = [job_id(i, "long") for i in range(3000)]
    lines = [line(ids[0], inputs={"10.image": "pics/a.png"})]
    lines += [
        line(ids[i], inputs={"10.image": {"job": ids[i - 1], "node": "12"}}) for i in range(1, 3000)
    ]
    jobs = by_id(load_job_file(write(folder, *reversed(lines))))
    assert jobs[ids[-1]].inputs[0].upstream_prompt_id == jobs[ids[-2]].prompt_id  # type: ignore[union-attr]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file whatever its mode")
def test_an_unreadable_input_file_is_an_error_of_its_line(tmp_path):
    folder = shots_folder(tmp_path)
    (folder / "pics" / "a.png").chmod(0)
    (error,) = errors_of(write(folder, line(A, inputs={"10.image": "pics/a.png"})))
    assert (error.line, error.field) == (1, "inputs.10.image")
    assert "cannot read it: Permission denied" in error.message


def test_the_commands_default_input_size_is_the_parsers():
    from comfy_assets.cli.options import MAX_INPUT_BYTES as shown
    from comfy_assets.jobs.inputs import MAX_INPUT_BYTES

    assert shown == MAX_INPUT_BYTES
