"""all_results.csv: every partition's results.csv one after another, with a leading
``partition`` column, written a row at a time (millions of rows are never held at once)."""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comfy_assets.render.results import (
    ResultsTable,
    combined_columns,
    csv_cell,
    partition_rows,
)
from comfy_assets.store.files import FileStore
from comfy_assets.store.files.local import writing

# Rows kept for the table ``write_combined`` returns (its metadata's schema and preview).
SAMPLE_ROWS = 10_000


def write_combined(files: FileStore, key: str, tables: Mapping[str, Path]) -> ResultsTable:
    """Write the store's file ``key``: each partition's results CSV (``{partition:
    path}``, in partition order) with a leading ``partition`` column, every cell the
    CSV's text, as ``combine_results`` makes it, read and written a row at a time.
    Columns are the union, in order of first appearance (the headers are read first).
    Returns the columns, the row count (``len``) and the first ``SAMPLE_ROWS`` rows.
    Raises OSError, ValueError naming the file and line of a row whose cells are not
    as many as its header's, FileStoreUnavailable, FileStoreFull."""
    columns = combined_columns(tables)
    sample: list[dict[str, Any]] = []
    total = 0
    with tempfile.TemporaryDirectory(prefix="comfy-assets-csv-") as scratch:
        with writing(files, [key], Path(scratch)) as [path]:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
                    writer = csv.writer(handle, lineterminator="\n")
                    writer.writerow(columns)
                    for partition in sorted(tables):
                        for row in partition_rows(partition, tables[partition]):
                            writer.writerow([csv_cell(row.get(name, "")) for name in columns])
                            if len(sample) < SAMPLE_ROWS:
                                sample.append({name: row.get(name, "") for name in columns})
                            total += 1
                os.chmod(tmp, 0o644)  # mkstemp makes it private; a results table is for all
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return ResultsTable(columns, sample, total)
