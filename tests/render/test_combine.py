"""all_results.csv written a row at a time (render/combine.py): the same bytes as the
table combined in memory, and a bad row named by its file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy_assets.render.combine import write_combined
from comfy_assets.render.results import combine_results, write_csv
from comfy_assets.store.files import file_store_for


def test_all_results_has_every_partitions_rows_under_the_union_of_columns(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.csv").write_text(
        'job_id,line,1.color,state\nx,1,3,succeeded\ny,2,"a\nb",pending\n'
    )
    (tmp_path / "b.csv").write_text("job_id,line,2.fps,state\nz,1,24.0,failed_fatal\n")
    tables = {"story": tmp_path / "b.csv", "images": tmp_path / "a.csv"}
    files = file_store_for(tmp_path / "store")
    written = write_combined(files, "all_results.csv", tables)
    text = (tmp_path / "store" / "all_results.csv").read_text()
    expected = write_csv(combine_results(tables), tmp_path / "expected.csv").read_text()
    assert text == expected
    assert text.splitlines()[0] == "partition,job_id,line,1.color,state,2.fps"
    assert len(written) == 3 and written.rows[2]["2.fps"] == "24.0"


def test_a_row_with_too_few_cells_is_named_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("job_id,line,state\nx,1,succeeded\ny,2\n")
    files = file_store_for(tmp_path / "store")
    with pytest.raises(ValueError, match=r"a\.csv:3: 2 cells, its header has 3"):
        write_combined(files, "all_results.csv", {"images": tmp_path / "a.csv"})
    assert not (tmp_path / "store" / "all_results.csv").exists()
