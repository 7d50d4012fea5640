"""results.csv built from what changed (render/segments.py): after changes to jobs in some
segments, a write reads those segments again and the file's rows are those a whole-table
write gives, in a folder and in an object store."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from comfy_assets.jobs.model import Job
from comfy_assets.jobs.parse import job_from_dict
from comfy_assets.render import segments
from comfy_assets.render.results import JobResults, write_csv, write_results
from comfy_assets.store import AttemptEntry, OutputFile, Store, Via

SHA = "cd" * 32


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "SEGMENT_JOBS", 3)


def make_job(folder: Path, i: int, **set_values: object) -> Job:
    obj = {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"test-segments:{i}")),
        "workflow": "image.json",
        "set": {"1.color": i, **set_values},
    }
    return job_from_dict(obj, base_dir=folder, source="test", line=i + 1)


def whole_table(store: Store, partition: str, tmp_path: Path, job_ids=None) -> str:
    """results.csv as one write of the whole table makes it."""
    table = JobResults.read(store, partition, job_ids).table()
    return write_csv(table, tmp_path / "whole" / "results.csv").read_text()


def results_text(store: Store, partition: str) -> str:
    with store.file_store.open_file(f"{partition}/results.csv") as handle:
        return handle.read().decode()


def rows_of(text: str) -> dict[str, str]:
    return {line.split(",")[0]: line for line in text.splitlines()[1:]}


def done(store: Store, job: Job, name: str) -> None:
    assert store.claim(job.id, "w1") == "claimed"
    store.transition(job.id, "submitted", owner="w1", via=Via(server="gpu0", attempt=1))
    store.transition(job.id, "rendering", via=Via(server="gpu0", attempt=1), number=1)
    store.mark_done(job.id, "w1", files=[OutputFile(name, SHA, 10, node_id="9", key="images")])


def dead(store: Store, job: Job) -> None:
    assert store.claim(job.id, "w1") == "claimed"
    store.transition(job.id, "submitted", owner="w1", via=Via(server="gpu1", attempt=1))
    store.dead_letter(job.id, "w1", "out of memory", via=Via(server="gpu1", attempt=1))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first line of each segment read from the store by lines, or the first job's
    line read by ids."""
    seen: list[int] = []
    real = Store.read_segment

    def spy(self: Store, partition: str, **kwargs: object):
        read = real(self, partition, **kwargs)
        lines = kwargs.get("lines")
        seen.append(lines[0] if lines else read.records[0].line if read.records else 0)
        return read

    monkeypatch.setattr(Store, "read_segment", spy)
    return seen


def test_a_write_after_changes_reads_only_their_segments(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    changes_in_two_segments(store, workflow_dir, tmp_path, reads)


def test_segments_on_postgresql(
    own_pg_url: str, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    with Store(tmp_path / "pg", own_pg_url) as store:
        changes_in_two_segments(store, workflow_dir, tmp_path, reads)


def changes_in_two_segments(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(10)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    assert sorted(reads) == [1, 4, 7, 10]  # four segments of three jobs
    first = results_text(store, "p")
    assert first == whole_table(store, "p", tmp_path)

    reads.clear()
    done(store, jobs[1], "a.png")  # segment 0
    dead(store, jobs[7])  # segment 2
    where, table = write_results(store, "p")
    assert sorted(reads) == [1, 7]
    text = results_text(store, "p")
    assert text == whole_table(store, "p", tmp_path)
    changed = {k for k, v in rows_of(text).items() if rows_of(first)[k] != v}
    assert changed == {jobs[1].id, jobs[7].id}
    assert "succeeded" in rows_of(text)[jobs[1].id] and "a.png:" in rows_of(text)[jobs[1].id]
    assert "failed_fatal" in rows_of(text)[jobs[7].id]
    assert len(table) == 10 and table.states == {"failed_fatal": 1, "pending": 8, "succeeded": 1}

    reads.clear()
    write_results(store, "p", sample=False)  # nothing changed since the changes were seen
    assert reads == []
    assert results_text(store, "p") == text


def test_a_requeued_dead_letter_shows_pending_again(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    dead(store, jobs[4])
    write_results(store, "p")
    assert "failed_fatal" in rows_of(results_text(store, "p"))[jobs[4].id]

    reads.clear()
    assert store.requeue(jobs[4].id)
    write_results(store, "p", sample=False)
    assert reads == [4]
    row = rows_of(results_text(store, "p"))[jobs[4].id]
    assert "pending" in row and "out of memory" not in row
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_a_model_column_and_a_new_set_key_change_the_header_of_every_row(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    assert results_text(store, "p").splitlines()[0].count("models") == 0

    reads.clear()
    late = make_job(workflow_dir, 7, **{"1.width": 32})  # a new line, a new set key
    store.register_jobs("p", [late])
    assert store.claim(jobs[6].id, "w1") == "claimed"
    store.record_attempt(
        jobs[6].id,
        AttemptEntry(1, "transient", "gpu0", seconds=1.0, models=("sd15.safetensors",)),
    )
    write_results(store, "p", sample=False)
    assert sorted(reads) == [7]  # segments 0 and 1 are not read again
    text = results_text(store, "p")
    header = text.splitlines()[0].split(",")
    assert header[:5] == ["job_id", "line", "shot", "1.color", "1.width"]
    assert header[header.index("server") + 1 : header.index("server") + 3] == [
        "models",
        "model_loaded",
    ]
    assert all(len(line.split(",")) == len(header) for line in text.splitlines())
    assert "sd15.safetensors" in rows_of(text)[jobs[6].id]
    assert text == whole_table(store, "p", tmp_path)


def test_a_job_files_ids_order_the_rows_and_show_a_missing_job(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(8)]
    store.register_jobs("p", jobs[:7])
    ids = [j.id for j in jobs]
    _, table = write_results(store, "p", ids)
    assert results_text(store, "p") == whole_table(store, "p", tmp_path, ids)
    assert "missing" in rows_of(results_text(store, "p"))[jobs[7].id]
    assert len(table) == 8 and [r["job_id"] for r in table.rows] == ids[:3]

    reads.clear()
    store.register_jobs("p", [jobs[7]])
    write_results(store, "p", ids, sample=False)
    assert reads == [7]  # the last segment: its missing job registered
    assert results_text(store, "p") == whole_table(store, "p", tmp_path, ids)

    reads.clear()
    write_results(store, "p", sample=False)  # by lines: the same segments, nothing read
    assert reads == []
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_segments_in_an_object_store(workflow_dir: Path, tmp_path: Path, s3_store) -> None:
    with Store(tmp_path / "db", file_store=s3_store) as store:
        jobs = [make_job(workflow_dir, i) for i in range(8)]
        store.register_jobs("p", jobs)
        write_results(store, "p")
        done(store, jobs[5], "b.png")
        where, _ = write_results(store, "p")
        assert where == f"{s3_store.where}/files/p/results.csv"
        text = results_text(store, "p")
        assert "succeeded" in rows_of(text)[jobs[5].id]
        assert text == whole_table(store, "p", tmp_path)
    assert not (tmp_path / "db" / "p").exists()  # nothing of results on this disk


def test_a_segment_removed_by_hand_is_read_again(
    store: Store, workflow_dir: Path, tmp_path: Path
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    (tmp_path / "store" / "p" / ".results" / "1.csv").unlink()
    (tmp_path / "store" / "p" / "results.csv").unlink()
    write_results(store, "p")
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)
    assert len(rows_of(results_text(store, "p"))) == 7


def test_a_job_moved_to_another_line_is_shown_once(
    store: Store, workflow_dir: Path, tmp_path: Path
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    moved = job_from_dict(
        {"id": jobs[0].id, "workflow": "image.json", "set": {"1.color": 0}},
        base_dir=workflow_dir,
        source="test",
        line=9,
    )
    store.register_jobs("p", [moved])  # the file edited: its first job now on line 9
    write_results(store, "p")
    text = results_text(store, "p")
    assert [line.split(",")[0] for line in text.splitlines()[1:]].count(jobs[0].id) == 1
    assert text.splitlines()[-1].startswith(f"{jobs[0].id},9,")
    assert text == whole_table(store, "p", tmp_path)


def test_a_store_made_before_the_indexes_gets_them_when_opened(tmp_path: Path) -> None:
    with Store(tmp_path / "old") as store, store.engine.begin() as conn:
        for name in ("ix_comfy_jobs_partition_updated", "ix_comfy_jobs_partition_line"):
            conn.exec_driver_sql(f"DROP INDEX {name}")
    with Store(tmp_path / "old") as store, store.engine.connect() as conn:
        plan = conn.exec_driver_sql(
            "EXPLAIN QUERY PLAN SELECT job_id FROM comfy_jobs WHERE partition = 'p'"
            " AND updated_at >= 0"
        ).fetchall()
    assert "ix_comfy_jobs_partition_updated" in str(plan)


@pytest.mark.parametrize(
    "index",
    [
        "[]",
        "null",
        '{"format": 1, "segment_jobs": 3, "segments": {}}',
        '{"format": 1, "segment_jobs": 3, "as_of": "x", "segments": {}}',
        '{"format": 1, "segment_jobs": 3, "as_of": 0, "segments": []}',
        '{"format": 1, "segment_jobs": 3, "as_of": 0, "segments": {"a": {}}}',
        '{"format": 1, "segment_jobs": 3, "as_of": 0, "segments": {"0": null}}',
        '{"format": 1, "segment_jobs": 3, "as_of": 0, "segments": {"0": {"bogus": 1}}}',
    ],
)
def test_a_segment_index_not_of_its_shape_makes_the_segments_again(
    store: Store, workflow_dir: Path, tmp_path: Path, index: str
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    (tmp_path / "store" / "p" / ".results" / "segments.json").write_text(index)
    done(store, jobs[1], "a.png")
    write_results(store, "p")
    assert "succeeded" in rows_of(results_text(store, "p"))[jobs[1].id]
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


@pytest.mark.parametrize("content", [b"garbage\n", b"\xff\xfe\n", b""])
def test_a_segment_edited_by_hand_without_the_model_columns_is_read_again(
    store: Store, workflow_dir: Path, tmp_path: Path, content: bytes
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    assert store.claim(jobs[6].id, "w1") == "claimed"
    store.record_attempt(
        jobs[6].id,
        AttemptEntry(1, "transient", "gpu0", seconds=1.0, models=("sd15.safetensors",)),
    )
    write_results(store, "p")  # segment 0 has no model columns: it is rewritten to them
    (tmp_path / "store" / "p" / ".results" / "0.csv").write_bytes(content)
    done(store, jobs[4], "a.png")
    write_results(store, "p")
    assert "succeeded" in rows_of(results_text(store, "p"))[jobs[4].id]
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_a_results_csv_cut_by_hand_is_joined_again_though_nothing_changed(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    write_results(store, "p")
    results = tmp_path / "store" / "p" / "results.csv"
    results.write_text(results.read_text()[:80])
    reads.clear()
    write_results(store, "p", sample=False)
    assert reads == []  # joined from the segments kept
    assert len(rows_of(results_text(store, "p"))) == 7
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_a_results_csv_cut_by_hand_in_an_object_store_is_joined_again(
    workflow_dir: Path, tmp_path: Path, s3_store
) -> None:
    with Store(tmp_path / "db", file_store=s3_store) as store:
        jobs = [make_job(workflow_dir, i) for i in range(7)]
        store.register_jobs("p", jobs)
        write_results(store, "p")
        s3_store.write_file("p/results.csv", b"job_id\n", "text/csv")
        write_results(store, "p", sample=False)
        assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_a_write_by_lines_after_one_of_a_file_with_a_line_deleted_shows_its_job(
    store: Store, workflow_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "SETTLE_S", 0.0)  # the registration is long past
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    ids = [j.id for j in jobs if j.line != 3]  # `run` of the file with line 3 deleted
    write_results(store, "p", ids)
    assert jobs[2].id not in rows_of(results_text(store, "p"))
    write_results(store, "p")  # a worker's write: every job of the partition
    assert jobs[2].id in rows_of(results_text(store, "p"))
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)


def test_a_worker_after_a_run_of_a_file_with_a_header_shows_a_change_once(
    store: Store, workflow_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "SETTLE_S", 0.0)  # the registration is long past
    jobs = [make_job(workflow_dir, i + 1) for i in range(7)]  # line 1: the header
    store.register_jobs("p", jobs)
    write_results(store, "p", [j.id for j in jobs])  # `run`: by the file's ids
    write_results(store, "p")  # a worker's: by lines
    done(store, jobs[2], "a.png")
    write_results(store, "p")
    text = results_text(store, "p")
    assert [line.split(",")[0] for line in text.splitlines()[1:]] == [j.id for j in jobs]
    assert "succeeded" in rows_of(text)[jobs[2].id]
    assert text == whole_table(store, "p", tmp_path)


def test_the_segments_of_a_file_with_a_header_serve_a_write_by_lines(
    store: Store, workflow_dir: Path, tmp_path: Path, reads: list[int]
) -> None:
    jobs = [make_job(workflow_dir, i + 1) for i in range(7)]  # line 1: the header
    store.register_jobs("p", jobs)
    ids = [j.id for j in jobs]
    write_results(store, "p", ids)  # `run`: by the file's ids, segments of lines 1-3, ...
    assert results_text(store, "p") == whole_table(store, "p", tmp_path, ids)
    reads.clear()
    write_results(store, "p", sample=False)  # a worker's: the same segments, none read
    assert reads == []
    assert results_text(store, "p") == whole_table(store, "p", tmp_path)
    write_results(store, "p", ids, sample=False)
    assert reads == []


def test_a_worker_after_a_run_of_a_file_with_a_line_deleted_and_the_rest_moved_up(
    store: Store, workflow_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "SETTLE_S", 0.0)  # the registrations are long past
    jobs = [make_job(workflow_dir, i) for i in range(7)]
    store.register_jobs("p", jobs)
    edited = (
        [jobs[0], jobs[1]]
        + [
            job_from_dict(
                {"id": job.id, "workflow": "image.json", "set": {"1.color": i + 3}},
                base_dir=workflow_dir,
                source="test",
                line=i + 3,  # line 3 deleted: each later job a line up
            )
            for i, job in enumerate(jobs[3:])
        ]
    )
    store.register_jobs("p", edited)
    write_results(store, "p", [j.id for j in edited])  # `run` of the edited file
    write_results(store, "p")  # a worker's: every job, the deleted line's too
    text = results_text(store, "p")
    assert jobs[2].id in rows_of(text)
    assert text == whole_table(store, "p", tmp_path)
