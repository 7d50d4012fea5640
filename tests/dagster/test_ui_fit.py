"""What the Dagster UI shows fits a 1600-pixel page and names things as a person does:
the job table without empty columns and with short cells, a shot's tile by its shot."""

from __future__ import annotations

from types import SimpleNamespace

from comfy_assets.farm.metadata import JOB_CELL_CHARS, job_table, jobs_frame, tile_label

JOB_IDS = ["e2f87063-605c-536f-bb57-ee613428fb53", "4d200798-c3ed-5022-9995-ba4043a62535"]
SHA = "1a2b3c4d5e6f" + "0" * 52


def record(job_id: str, line: int, state: str, reason: str | None = None) -> SimpleNamespace:
    """A job record as the store gives it, of an image-to-image job: no shot."""
    return SimpleNamespace(
        job_id=job_id,
        line=line,
        shot=None,
        take=1,
        inputs=[{"key": "1.image", "path": f"pictures/dawn/key{line}.png", "sha256": SHA}],
        state=state,
        server="gpu0",
        attempts=1,
        seconds=0.25,
        reason=reason,
    )


def test_the_job_table_drops_empty_columns_and_keeps_its_cells_short() -> None:
    records = [record(JOB_IDS[0], 1, "succeeded"), record(JOB_IDS[1], 2, "succeeded")]

    shown = job_table(jobs_frame(records, JOB_IDS))

    columns = [c.name for c in shown.schema.columns]
    assert columns == ["job", "line", "take", "state", "server", "attempts", "seconds", "inputs"]
    first = shown.records[0].data
    assert first["job"] == "e2f87063"
    assert first["inputs"] == "1.image=pictures/dawn/key1.png@1a2b3c4d"


def test_a_long_reason_is_cut_in_the_table_and_whole_in_the_frame() -> None:
    reason = "attempt 1 failed on gpu2, the only server that can run it: " + "x" * 200
    records = [record(JOB_IDS[0], 1, "failed_fatal", reason), record(JOB_IDS[1], 2, "pending")]
    frame = jobs_frame(records, JOB_IDS)

    shown = job_table(frame)

    cell = shown.records[0].data["reason"]
    assert len(cell) == JOB_CELL_CHARS["reason"] and cell.endswith("…")
    assert reason.startswith(cell[:-1])
    assert frame["reason"][0] == reason  # results.csv has it whole
    assert "shot" not in [c.name for c in shown.schema.columns]


def test_a_shots_tile_names_its_shot_not_comfyuis_counter_file() -> None:
    assert tile_label(JOB_IDS[0], 1, "shot_00005_.mp4") == "shot 1 · job e2f87063"
    assert tile_label(JOB_IDS[0], 1, "shot_00005_.png", 2, 3) == (
        "shot 1 · job e2f87063\noutput 2 of 3"
    )
    # A job without a shot has no other name for its file.
    assert tile_label(JOB_IDS[0], None, "solid_00001_.png") == "job e2f87063\nsolid_00001_.png"
