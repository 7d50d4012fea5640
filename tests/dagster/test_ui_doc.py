"""docs/ui.md says what the UI shows: the demo's job files, the job table's columns in
their order, and which partitions films has."""

from __future__ import annotations

import re
from pathlib import Path

from comfy_assets.farm.metadata import JOB_COLUMNS, MODEL_JOB_COLUMNS, WIDE_JOB_COLUMNS
from comfy_assets.farm.partitions import partition_key_for
from comfy_assets.jobs.parse import load_job_file

REPO = Path(__file__).resolve().parents[2]
UI = (REPO / "docs" / "ui.md").read_text()
DEMO_FILES = sorted((REPO / "data" / "jobs").glob("*.jsonl"))


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_it_names_every_job_file_the_demo_renders() -> None:
    intro = one_line(UI.split("##", 1)[0])
    for path in DEMO_FILES:
        assert f"`{partition_key_for(path)}`" in intro, path.name
    assert f"{len(DEMO_FILES)} job files" in intro.replace("four", "4")


def test_it_lists_the_job_table_columns_in_their_order() -> None:
    text = one_line(UI)
    listed = text.split("**job_table**", 1)[1].split("plus models", 1)[0]
    listed = re.sub(r"\([^()]*\)", "", listed.split("columns", 1)[1])
    names = [name.strip(" ,.") for name in re.split(r",| and ", listed) if name.strip(" ,.")]
    shown = [c for c in JOB_COLUMNS if c not in (*MODEL_JOB_COLUMNS, *WIDE_JOB_COLUMNS)]
    assert names == shown


def test_it_says_which_job_files_are_partitions_of_films() -> None:
    films = one_line(UI.split("## films", 1)[1].split("##", 1)[0])
    for path in DEMO_FILES:
        shots = any(job.shot is not None for job in load_job_file(path).jobs)
        key = partition_key_for(path)
        if shots:
            assert re.search(rf"Partitions: [^.]*\b{key}\b", films), key
        else:
            assert re.search(rf"\b{key}\b[^.]* not there", films), key
