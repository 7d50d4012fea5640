"""Queue messages of jobs with input files: the bytes travel inline and are checked by
their sha256, a message too large for its inputs or a chained job is refused at enqueue
with its file, line and input."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.jobs.model import InputFile, JobFileError
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.service.messages import (
    CHAINED,
    MAX_MESSAGE_BYTES,
    file_messages,
    job_message,
    message_size,
    parse_message,
    queue_problems,
)
from comfy_assets.service.sources import MemorySource
from comfy_assets.service.worker import Worker, job_messages
from fake_comfy import FakeComfy
from tests.jobs.test_jobfile_inputs import INVERT
from tests.support import fake_servers, fast_config, job_id, opened_files

A, B, C = (job_id(i, "message-inputs") for i in range(3))


def shots(tmp_path: Path, *lines: dict) -> Path:
    """``tmp_path/shots/jobs.jsonl`` of ``lines`` beside ``invert.json`` and three pictures
    (two named key.png, other bytes)."""
    folder = tmp_path / "shots"
    for name, data in (("sh010", b"\x89PNG first"), ("sh020", b"\x89PNG second\x00\xff")):
        (folder / name).mkdir(parents=True)
        (folder / name / "key.png").write_bytes(data)
    (folder / "invert.json").write_text(json.dumps(INVERT))
    path = folder / "jobs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def line(id_: str, **fields: object) -> dict:
    return {"id": id_, "workflow": "invert.json", **fields}


def tampered(body: bytes, change) -> bytes:
    obj = json.loads(body)
    change(obj["inputs"]["10.image"])
    return json.dumps(obj).encode()


def refused(body: bytes) -> list[tuple[str, str]]:
    with pytest.raises(JobFileError) as err:
        parse_message(body, workflows_dir=Path("/nonexistent"), source="q m1")
    return [(e.field, e.message) for e in err.value.errors]


def test_a_message_carries_its_inputs_bytes_and_rebuilds_the_same_job_anywhere(tmp_path):
    path = shots(
        tmp_path,
        line(A, inputs={"10.image": "sh010/key.png"}, shot=1),
        line(B, inputs={"10.image": "sh020/key.png"}, take=3),
        line(C, set={"12.filename_prefix": "plain"}),
    )
    job_file = load_job_file(path)
    elsewhere = tmp_path / "worker"  # a folder without the job file's pictures
    elsewhere.mkdir()
    for (message_id, body), job in zip(job_messages(path), job_file.jobs, strict=True):
        assert message_id == job.id and body.isascii()
        assert len(body) == message_size(job, job_file.policy, "jobs")
        queued = parse_message(body, workflows_dir=elsewhere, source="q")
        assert queued.job == job  # inputs, take, prompt_id
        assert queued.job.prompt_id == job.prompt_id
        assert queued.job.workflow == job.workflow
        for given, original in zip(queued.job.inputs, job.inputs, strict=True):
            assert isinstance(given, InputFile) and isinstance(original, InputFile)
            assert given.source is None and given.read() == original.read()
    a, b, c = (json.loads(body) for _, body in job_messages(path))
    assert a["inputs"] == {
        "10.image": {
            "path": "sh010/key.png",
            "sha256": job_file.jobs[0].inputs[0].sha256,
            "size": 10,
            "base64": base64.b64encode(b"\x89PNG first").decode(),
        }
    }
    assert b["take"] == 3 and "take" not in a
    assert "inputs" not in c and "take" not in c


def test_a_picture_shared_by_many_jobs_is_read_once_for_their_messages(tmp_path):
    path = shots(
        tmp_path, *(line(job_id(i, "m"), inputs={"10.image": "sh010/key.png"}) for i in range(50))
    )
    job_file = load_job_file(path)
    picture = os.path.realpath(path.parent / "sh010" / "key.png")
    with opened_files() as opened:
        messages = file_messages(job_file)
    assert opened.count(picture) == 1 and len(messages) == 50


def test_an_input_too_large_for_a_message_is_refused_at_enqueue_with_its_line(tmp_path, capsys):
    path = shots(
        tmp_path,
        line(A, inputs={"10.image": "sh010/key.png"}),
        line(B, inputs={"10.image": "sh020/big.png"}),
    )
    (path.parent / "sh020" / "big.png").write_bytes(b"\x00" * 3000)
    job_file = load_job_file(path)
    limit = message_size(job_file.jobs[1], job_file.policy, "jobs") - 1
    assert message_size(job_file.jobs[0], job_file.policy, "jobs") <= limit
    big = os.path.realpath(path.parent / "sh020" / "big.png")

    with opened_files() as opened:
        with pytest.raises(JobFileError) as err:
            job_messages(path, limit)
    (error,) = err.value.errors
    assert (error.path, error.line, error.field) == (str(path), 2, "inputs.10.image")
    assert error.message == (
        f"sh020/big.png (3000 bytes, 4000 in base64) makes this job's message {limit + 1} "
        f"bytes, over the limit of {limit} bytes (--max-message-bytes): a worker would "
        "refuse it; `comfy-assets run` and Dagster read input files from disk"
    )
    assert opened.count(big) == 1  # hashed at validation, never read for a message

    argv = ["enqueue", "--rabbitmq", "amqp://guest:guest@127.0.0.1:9/", "--queue", "q"]
    assert main([*argv, "--max-message-bytes", str(limit), "--jobs", str(path)]) == 2
    err_text = capsys.readouterr().err
    assert f"error: {path}: 1 problem(s), nothing enqueued" in err_text
    assert f"  {path}:2: inputs.10.image: sh020/big.png (3000 bytes" in err_text


def test_a_workflow_too_large_alone_is_still_an_error_of_the_message(tmp_path):
    path = shots(tmp_path, line(A, inputs={"10.image": "sh010/key.png"}))
    job = load_job_file(path).jobs[0]
    limit = message_size(job, "delivery", "jobs") - 100  # the inputs are 16 bytes of it
    (error,) = queue_problems(load_job_file(path), limit)
    assert (error.line, error.field) == (1, "message")


def test_a_chained_job_is_refused_at_enqueue_with_its_line_and_input(tmp_path):
    path = shots(
        tmp_path,
        line(A, inputs={"10.image": "sh010/key.png"}),
        line(B, inputs={"10.image": {"job": A, "node": "12"}}),
    )
    with pytest.raises(JobFileError) as err:
        job_messages(path)
    assert [str(e) for e in err.value.errors] == [f"{path}:2: inputs.10.image: {CHAINED}"]
    with pytest.raises(ValueError, match="chained inputs need"):
        job_message(load_job_file(path).jobs[1])
    assert queue_problems(load_job_file(path), MAX_MESSAGE_BYTES)[0].line == 2


def test_a_message_whose_bytes_are_not_those_it_names_is_refused(tmp_path):
    path = shots(tmp_path, line(A, inputs={"10.image": "sh010/key.png"}))
    ((_, body),) = job_messages(path)

    def flip(entry: dict) -> None:
        data = bytearray(base64.b64decode(entry["base64"]))
        data[0] ^= 1
        entry["base64"] = base64.b64encode(bytes(data)).decode()

    ((field, message),) = refused(tampered(body, flip))
    assert field == "inputs.10.image"
    assert message.startswith("the bytes do not match their sha256: they hash to ")

    ((field, message),) = refused(tampered(body, lambda e: e.update(base64="@@not base64")))
    assert field == "inputs.10.image" and message.startswith("'base64': not base64: ")

    cut = refused(tampered(body, lambda e: e.update(base64=e["base64"][:-4])))
    assert [f for f, _ in cut] == ["inputs.10.image", "inputs.10.image"]
    assert cut[0][1].startswith("9 bytes once decoded, not the 'size' of 10")

    ((field, message),) = refused(tampered(body, lambda e: e.update(path="../../etc/passwd")))
    assert message.startswith("'path': \"../../etc/passwd\" has a '..' component")

    ((field, message),) = refused(tampered(body, lambda e: e.update(extra=1)))
    assert message.startswith('unknown field "extra" of an inline input')


def test_a_message_naming_an_input_by_path_or_by_job_is_refused_unopened(tmp_path):
    path = shots(tmp_path, line(A, inputs={"10.image": "sh010/key.png"}))
    ((_, body),) = job_messages(path)
    obj = json.loads(body)
    obj["inputs"]["10.image"] = "sh010/key.png"
    with opened_files() as opened:
        ((field, message),) = refused(json.dumps(obj).encode())
    assert field == "inputs.10.image" and "carries each input file inline" in message
    assert not any(p.endswith("key.png") for p in opened)
    obj["inputs"]["10.image"] = {"job": B, "node": "12"}
    assert refused(json.dumps(obj).encode()) == [("inputs.10.image", CHAINED)]


async def test_a_worker_dead_letters_a_message_with_tampered_bytes_and_posts_nothing(
    tmp_path, store
):
    path = shots(
        tmp_path,
        line(A, inputs={"10.image": "sh010/key.png"}),
        line(B, inputs={"10.image": "sh020/key.png"}),
    )
    source = MemorySource("tampered")
    for message_id, body in job_messages(path):
        source.put(tampered(body, lambda e: e.update(sha256="0" * 64)), message_id)
    source.end()
    fake = FakeComfy(prompt_seconds=0.005)
    async with fake_servers(fake) as specs:
        worker = Worker(
            source,
            servers=specs,
            store=store,
            config=fast_config(attempts=1),
            workflows_dir=tmp_path / "empty",
        )
        await asyncio.wait_for(worker.run(), 60)
    assert len(source.dead) == 2 and len(source.acked) == 2
    for _, reason in source.dead:
        assert "inputs.10.image: the bytes do not match their sha256" in reason
    assert fake.stats["prompts"] == {}
