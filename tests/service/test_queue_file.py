"""``comfy-assets enqueue`` on a file of several chunks (``service/queue_file.py``): every
problem found before anything is published, wherever it is; the messages those of the file
loaded whole, in order; a file changed while it is published stops it, saying how to
finish."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import pytest

from comfy_assets.cli.main import main
from comfy_assets.jobs import halves
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.jobs.workflows import WorkflowCache
from comfy_assets.service import broker
from comfy_assets.service.messages import file_messages, message_size
from comfy_assets.service.queue_file import CHUNK, scan_queue_file, size_bound
from tests.service.test_messages_inputs import line, shots
from tests.support import job_id, write_jobs

JOBS = 2 * CHUNK + 500  # three chunks, the last a part one
# Nothing listens there: a command that connects fails with exit 1, not 2.
NOWHERE = "amqp://guest:guest@127.0.0.1:1/"


def test_the_messages_of_a_file_of_several_chunks_are_those_of_the_file_loaded_whole(tmp_path):
    path = write_jobs(tmp_path / "jobs", JOBS)
    found = scan_queue_file(path, partition="shots", priority=3)
    assert found.count == JOBS
    assert list(found.messages()) == file_messages(load_job_file(path), "shots", 3)


def test_a_message_too_big_in_the_last_chunk_is_refused_before_anything_is_published(
    tmp_path, capsys
):
    late = JOBS - 7
    extra = [{"set": {"1.color": 1000 + i}} for i in range(JOBS)]
    extra[late]["set"]["3.filename_prefix"] = "x" * 200
    path = write_jobs(tmp_path / "jobs", JOBS, extra=extra)
    job_file = load_job_file(path)
    limit = max(message_size(job, job_file.policy, "jobs") for job in job_file.jobs[:late])

    code = main(
        ["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)]
        + ["--max-message-bytes", str(limit)]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert f"error: {path}: 1 problem(s), nothing enqueued" in err
    assert f"{path}:{late + 1}: message: " in err


def test_an_input_changed_while_its_file_is_published_stops_enqueue_saying_how_to_finish(
    tmp_path, monkeypatch, capsys
):
    jobs = [line(job_id(i, "changed"), inputs={"10.image": "sh010/key.png"}) for i in range(JOBS)]
    path = shots(tmp_path, *jobs)
    published: list[str] = []

    async def publish(url: str, queue: str, messages: Iterable[tuple[str, bytes]]) -> int:
        for job, body in messages:
            if not published:  # the bytes change once the first chunk is built
                (path.parent / "sh010" / "key.png").write_bytes(b"\x89PNG other")
            assert json.loads(body)["id"] == job
            published.append(job)
        return len(published)

    monkeypatch.setattr(broker, "enqueue", publish)
    code = main(["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)])

    err = capsys.readouterr().err
    assert code == 1
    assert published == [job["id"] for job in jobs[:CHUNK]]
    assert f"error: {path}: " in err
    assert "messages RabbitMQ confirmed stay queued; enqueue the same file again" in err


def test_enqueue_stopped_by_ctrl_c_part_way_says_how_to_finish(tmp_path, monkeypatch, capsys):
    path = write_jobs(tmp_path / "jobs", JOBS)
    published: list[str] = []

    async def publish(url: str, queue: str, messages: Iterable[tuple[str, bytes]]) -> int:
        for job, _ in messages:
            if len(published) == CHUNK:
                raise KeyboardInterrupt
            published.append(job)
        return len(published)

    monkeypatch.setattr(broker, "enqueue", publish)
    with pytest.raises(KeyboardInterrupt):
        main(["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)])

    err = capsys.readouterr().err
    assert len(published) == CHUNK
    assert "messages RabbitMQ confirmed stay queued; enqueue the same file again" in err


def test_enqueue_stopped_by_sigterm_part_way_says_how_to_finish_and_exits_143(
    tmp_path, monkeypatch, capsys
):
    path = write_jobs(tmp_path / "jobs", JOBS)
    published: list[str] = []

    async def publish(url: str, queue: str, messages: Iterable[tuple[str, bytes]]) -> int:
        for job, _ in messages:
            if len(published) == CHUNK:
                os.kill(os.getpid(), signal.SIGTERM)  # a container stop, part way
            published.append(job)
        return len(published)

    monkeypatch.setattr(broker, "enqueue", publish)
    before = signal.getsignal(signal.SIGTERM)
    code = main(["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)])

    err = capsys.readouterr().err
    assert code == 143
    assert len(published) == CHUNK
    assert "messages RabbitMQ confirmed stay queued; enqueue the same file again" in err
    assert err.endswith("stopped by SIGTERM\n")
    assert signal.getsignal(signal.SIGTERM) is before  # given back


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_line_changed_between_the_check_and_the_publish_publishes_nothing_of_it(
    tmp_path, monkeypatch, capsys, where
):
    path = write_jobs(tmp_path / "jobs", JOBS)
    lines = path.read_text().splitlines(keepends=True)
    index = 0 if where == "first" else JOBS - 1
    published: list[str] = []

    async def publish(url: str, queue: str, messages: Iterable[tuple[str, bytes]]) -> int:
        edited = json.loads(lines[index])
        edited["set"]["1.color"] += 1  # the same length: only its bytes tell
        lines[index] = json.dumps(edited) + "\n"
        Path(path).write_text("".join(lines))
        published.extend(job for job, _ in messages)
        return len(published)

    monkeypatch.setattr(broker, "enqueue", publish)
    code = main(["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)])

    err = capsys.readouterr().err
    assert code == 1
    assert f"{path}:{index + 1}: the line changed since it was validated" in err
    assert len(published) == (0 if where == "first" else 2 * CHUNK)


def test_no_message_is_larger_than_the_bound_that_spares_enqueue_its_second_read(tmp_path):
    # Values that grow most when written again: non-ASCII text (\uXXXX), astral
    # characters (two escapes), a float written long (1e15 -> 1000000000000000.0).
    grow = ["é" * 40, "漢" * 40, "😀" * 40, 1e15, -1e-7]
    extra = [
        {"set": {"1.color": 1000 + i, "3.filename_prefix": grow[i % 3]}}
        if i % 5 < 3
        else {"set": {"1.color": grow[i % 5]}, "shot": i, "duration_s": 1e15}
        for i in range(50)
    ]
    path = write_jobs(tmp_path / "jobs", 50, extra=extra)
    workflows = WorkflowCache()
    scan = scan_job_file(path, workflows)
    assert isinstance(scan, JobScan)
    bound = size_bound(scan, workflows, "a-partition")
    sizes = [len(body) for _, body in scan_queue_file(path, partition="a-partition").messages()]
    assert max(sizes) <= bound


def test_a_workflow_named_only_in_the_second_half_of_a_big_file_counts_for_its_size(
    tmp_path, monkeypatch, capsys
):
    # Files of 16 MB and more are checked in two halves at once: here a small one is.
    monkeypatch.setattr(halves, "HALVES_BYTES", 0)
    monkeypatch.setattr(halves, "alone", lambda: True)  # whatever threads earlier tests left
    extra = [{"set": {"1.color": 1000 + i}} for i in range(40)]
    extra[-1]["workflow"] = "big.json"
    path = write_jobs(tmp_path / "jobs", 40, extra=extra)
    big = json.loads((path.parent / "image.json").read_text())
    big["3"]["inputs"]["filename_prefix"] = "x" * 5000
    (path.parent / "big.json").write_text(json.dumps(big))

    code = main(
        ["enqueue", "--rabbitmq", NOWHERE, "--queue", "q", "--jobs", str(path)]
        + ["--max-message-bytes", "4000"]
    )

    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}:40: message: " in err
