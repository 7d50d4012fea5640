"""The results table of a partition: built from result-store records, written as
``<store>/<partition>/results.csv`` by ``write_results`` (the one writer: the ``run``
command, the ``render_results`` asset and the worker all call it).

One row per job: ``job_id``, ``line`` (its line in the job file), ``shot`` (its shot
number, empty for none), one column per ``set`` key of the job file (named as in the
file, ``"<node id>.<input name>"``, so they never clash with the fixed columns; a value
over ``MAX_CELL_CHARS`` is cut, its length said), then
``take``, ``inputs`` (each input file as ``key=path@sha256:<hex>``, or for a file of an
upstream job ``key=job <id> node <n> #<index>@sha256:<hex>``, joined with ``"; "``),
``state``, ``server``, ``failed_on`` (the servers its failed attempts ran on, in order,
space-separated: where a dead letter failed; since it was last requeued or its inputs
changed, as ``attempts`` counts them), ``attempts``, ``seconds``, ``files``
(``name:sha256[:12]`` joined with spaces) and ``reason``. In a partition whose jobs load models, ``models``
(the job's model files, space-separated) and ``model_loaded`` (whether the server of its
last try had to load one: true/false, empty before any try) follow ``server``.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from comfy_assets.comfy.types import excerpt
from comfy_assets.store import FileRecord, JobRecord, Store
from comfy_assets.store.files import FileStore
from comfy_assets.store.files.local import file_location, writing

FIXED_BEFORE = ["job_id", "line", "shot"]
FIXED_AFTER = [
    "take",
    "inputs",
    "state",
    "server",
    "failed_on",
    "attempts",
    "seconds",
    "files",
    "reason",
]
MODEL_COLUMNS = ["models", "model_loaded"]  # after "server", when jobs load models
RESULTS_CSV = "results.csv"
# A job of the job file with no record in the store (it never got registered).
MISSING_STATE = "missing"


@dataclass(frozen=True)
class ResultsTable:
    """A results table: ``columns`` in order, and ``rows``, each a dict of column name to
    value (an int, float, bool or str; None or a column the row lacks is an empty cell).
    Plain rows, not a DataFrame: ``run`` and the worker write the CSV without loading
    pandas (a large part of a process's start-up); the Dagster assets make a DataFrame of
    it for their metadata (``farm.metadata.results_metadata``). ``total``: the table's
    row count when ``rows`` are its first rows only (``len`` is the count either way);
    ``states``: every row's state counted, when known."""

    columns: list[str]
    rows: list[dict[str, Any]]
    # The table's rows, when ``rows`` holds only its first ones (``write_results``).
    total: int | None = None
    # Its rows by state, all of them counted (``write_results``), or None when not known.
    states: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.rows) if self.total is None else self.total


# The store's job record, whose fields the table shows (``set``: the job's "node.input"
# overrides; ``inputs``: ``store.register.inputs_json``'s items).
JobRow: TypeAlias = JobRecord


class ModelTryRow(Protocol):
    """A try of a job that loads models (``store.ModelLoadRecord``); read-only, as a
    frozen record's fields are."""

    @property
    def job_id(self) -> str: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def loaded(self) -> bool: ...


# One output file of a job (``path`` relative to the job's folder), as the store has it.
FileRow: TypeAlias = FileRecord


def files_cell(files: Iterable[FileRow]) -> str:
    """``name:sha256[:12]`` of each output, space-separated, in path order."""
    return " ".join(f"{f.path}:{f.sha256[:12]}" for f in sorted(files, key=lambda f: f.path))


# Hex digits of a sha256, and characters of a job id, in a short cell (the UI's table).
SHORT_SHA256 = 12
SHORT_JOB_ID = 8


def inputs_cell(
    inputs: Sequence[Mapping[str, Any]],
    files: Mapping[str, Iterable[FileRow]],
    *,
    short: bool = False,
) -> str:
    """Each input of a job, ``key=path@sha256:<hex>`` (a file of an upstream job: its
    ``job <id> node <n> #<index>``, with the sha256 of that file once it is written, from
    ``files``), joined with ``"; "``. ``short``: the sha256's first SHORT_SHA256 hex
    digits and the upstream job id's first SHORT_JOB_ID characters, as in log lines."""
    sha_chars = SHORT_SHA256 if short else None
    id_chars = SHORT_JOB_ID if short else None
    cells = []
    for item in inputs:
        if "path" in item:
            cells.append(f"{item['key']}={item['path']}@sha256:{item['sha256'][:sha_chars]}")
            continue
        node, index = str(item["node"]), int(item["index"])
        written = sorted(
            (f for f in files.get(str(item["job"]), ()) if f.node_id == node),
            key=lambda f: str(f.path),
        )
        sha = written[index].sha256[:sha_chars] if index < len(written) else "not written yet"
        upstream = str(item["job"])[:id_chars]
        cells.append(f"{item['key']}=job {upstream} node {node} #{index}@sha256:{sha}")
    return "; ".join(cells)


# The most characters a ``set`` value (or a job's models) keeps in its cell; a longer one
# is cut, its length said: far above any prompt a person writes, far below the 131,072
# characters Python's csv module reads in one field, so every reader reads every row.
MAX_CELL_CHARS = 10_000


def _cell(value: Any) -> Any:
    # Lists and objects (say a prompt list) go in as JSON so the CSV cell round-trips.
    cell = json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else value
    if isinstance(cell, str) and len(cell) > MAX_CELL_CHARS:
        return excerpt(cell, MAX_CELL_CHARS)
    return cell


def last_model_tries(tries: Iterable[ModelTryRow]) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Each job's models and whether its last try loaded one, from its tries in order."""
    return {t.job_id: (tuple(t.models), t.loaded) for t in tries}


@dataclass(frozen=True)
class JobResults:
    """A partition's jobs as the store has them, the one model both views show:
    ``table`` (results.csv, every column) and ``farm.metadata.job_frame`` (the UI's job
    table, its columns cut for the UI). ``job_ids``: the rows, in order; ``records``: the
    store's job record of each (a job without one is ``missing``); ``files``: each job's
    output files (by job id); ``models``: each job's models and whether its last try
    loaded one (``last_model_tries``); ``failed_on``: the servers each job failed on
    (``Store.failed_on``)."""

    job_ids: list[str]
    records: Mapping[str, JobRow]
    files: Mapping[str, Iterable[FileRow]]
    models: Mapping[str, tuple[tuple[str, ...], bool]]
    failed_on: Mapping[str, Sequence[str]]

    @classmethod
    def of(
        cls,
        records: Sequence[JobRow],
        files: Mapping[str, Iterable[FileRow]],
        job_ids: Sequence[str] | None = None,
        models: Mapping[str, tuple[tuple[str, ...], bool]] | None = None,
        failed_on: Mapping[str, Sequence[str]] | None = None,
    ) -> JobResults:
        """The model of ``records``: ``job_ids`` (the job file's ids in line order)
        selects and orders the rows, a job of the file without a record making a row with
        state ``missing`` so a gap is visible; without it every record is a row, in the
        given order. ``files`` maps job id to its output files; ``models``
        (``last_model_tries``), when not empty, adds the ``models`` and ``model_loaded``
        columns; ``failed_on``: the servers each job failed on (``Store.failed_on``)."""
        order = list(job_ids) if job_ids is not None else [record.job_id for record in records]
        return cls(
            order,
            {record.job_id: record for record in records},
            files,
            models or {},
            failed_on or {},
        )

    @classmethod
    def read(cls, store: Store, partition: str, job_ids: Sequence[str] | None = None) -> JobResults:
        """``partition``'s jobs, read from ``store`` once. ``job_ids`` (a job file's, in
        line order) selects and orders the rows, and a record of a job no longer in the
        file (a deleted line) is left out; without it every job registered in the
        partition is a row, in line order. Raises StoreUnavailable."""
        records = store.jobs(partition)
        if job_ids is not None:
            wanted = set(job_ids)
            records = [record for record in records if record.job_id in wanted]
        else:
            records = sorted(records, key=lambda record: (record.line, record.job_id))
        by_job = store.partition_files(partition)
        files = {record.job_id: by_job.get(record.job_id, []) for record in records}
        models = last_model_tries(store.model_loads(partition))
        return cls.of(records, files, job_ids, models, store.failed_on(partition))

    def cells(self, job_id: str, *, short: bool = False) -> dict[str, Any]:
        """The columns every view shows of one job: ``job_id``, ``line``, ``shot``,
        ``take``, ``inputs`` (``inputs_cell``; ``short`` as there), ``state``, ``server``,
        ``failed_on``, ``attempts``, ``seconds`` and ``reason``; only ``job_id`` and
        ``state`` (``missing``) for a job without a record."""
        record = self.records.get(job_id)
        if record is None:
            return {"job_id": job_id, "state": MISSING_STATE}
        return {
            "job_id": job_id,
            "line": record.line,
            "shot": record.shot,
            "take": record.take,
            "inputs": inputs_cell(record.inputs, self.files, short=short),
            "state": str(record.state),
            "server": record.server,
            "failed_on": " ".join(self.failed_on.get(job_id, ())),
            "attempts": record.attempts,
            "seconds": None if record.seconds is None else round(record.seconds, 3),
            "reason": record.reason,
        }

    def table(self) -> ResultsTable:
        """The results table (results.csv): every column, a ``set`` key's each, the
        ``files`` and, when any job loads models, the ``models`` and ``model_loaded``."""
        set_columns: list[str] = []
        rows: list[dict[str, Any]] = []
        for job_id in self.job_ids:
            row = self.cells(job_id)
            record = self.records.get(job_id)
            if record is not None:
                values = record.set or {}
                for key in values:
                    if key not in set_columns:
                        set_columns.append(key)
                row |= {key: _cell(value) for key, value in values.items()}
                row["files"] = files_cell(self.files.get(job_id, ()))
            rows.append(row)
        columns = FIXED_BEFORE + set_columns + FIXED_AFTER
        if self.models:
            at = columns.index("server") + 1
            columns[at:at] = MODEL_COLUMNS
            for row in rows:
                found = self.models.get(row["job_id"])
                if found is not None:
                    row["models"], row["model_loaded"] = _cell(" ".join(found[0])), found[1]
        return ResultsTable(columns, rows)


def results_csv_path(root: Path, partition: str) -> Path:
    """Where a partition's results CSV is: ``<store root>/<partition>/results.csv``."""
    return Path(root) / partition / RESULTS_CSV


def results_key(partition: str) -> str:
    """The store file key of a partition's results CSV: ``<partition>/results.csv``."""
    return f"{partition}/{RESULTS_CSV}"


def results_location(store: Store, partition: str) -> str:
    """Where ``write_results`` writes ``partition``'s results CSV, for a line: its path
    in a folder store, its object's URL in an object store (``FileStore.file_location``)."""
    return file_location(store.file_store, results_key(partition))


def write_results(
    store: Store, partition: str, job_ids: Sequence[str] | None = None, *, sample: bool = True
) -> tuple[str, ResultsTable]:
    """Write ``partition``'s results CSV as the store has it now; returns where it is
    (``results_location``) and the table: its columns, its row count (``len``) and, with
    ``sample``, its first rows (a segment's, ``render.segments.SEGMENT_JOBS``; none
    without). ``job_ids`` (a job file's, in line order) selects and orders the rows, and
    a record of a job no longer in the file (a deleted line) is left out; without it
    every job registered in the partition is a row, in line order (the order of
    ``job_ids`` for a file whose jobs all got there). Only the rows of jobs changed since
    the last write are read from the store (``render.segments``); no more than a
    segment's rows are held at once. Raises OSError if the CSV cannot be written,
    StoreUnavailable, FileStoreUnavailable, FileStoreFull, FileStoreRefused."""
    from comfy_assets.render.segments import write_segmented  # it builds on this module

    return write_segmented(store, partition, job_ids, sample=sample)


def write_table(files: FileStore, key: str, table: ResultsTable) -> str:
    """Write ``table`` as the store's file ``key`` (``write_csv``, then stored whole where
    the store is not this disk); returns where it is (``file_location``). Raises OSError,
    FileStoreUnavailable, FileStoreFull."""
    with tempfile.TemporaryDirectory(prefix="comfy-assets-csv-") as scratch:
        with writing(files, [key], Path(scratch)) as [path]:
            write_csv(table, path)
    return file_location(files, key)


def write_csv(table: ResultsTable, path: Path) -> Path:
    """Write ``table`` to ``path`` atomically (temp file + rename): readers never see half.
    UTF-8, a header line, a line feed after each line, cells quoted only where they must be
    (the csv module's minimal quoting), an empty cell for None. A carriage return in a
    cell (a reason from a server's Windows traceback) is written as a line feed: the
    csv module would leave such a cell unquoted, and readers would end the row there.
    Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(table.columns)
            writer.writerows(
                [csv_cell(row.get(name)) for name in table.columns] for row in table.rows
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a results table is for everyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def csv_cell(value: Any) -> Any:
    """``value`` as ``write_csv`` writes it: a carriage return made a line feed."""
    if isinstance(value, str) and "\r" in value:
        return value.replace("\r\n", "\n").replace("\r", "\n")
    return value


def combined_columns(tables: Mapping[str, Path]) -> list[str]:
    """The columns of ``tables`` (``{partition: results CSV}``) one after another: a
    leading ``partition``, then the union of their headers in order of first appearance
    (partition order); with no tables, the fixed columns. Raises OSError."""
    columns = ["partition"]
    for partition in sorted(tables):
        with tables[partition].open(encoding="utf-8", newline="") as handle:
            header = next(csv.reader(handle), [])
        columns += [name for name in header if name not in columns]
    if not tables:
        columns = ["partition", *FIXED_BEFORE, *FIXED_AFTER]
    return columns


def partition_rows(partition: str, path: Path) -> Iterator[dict[str, Any]]:
    """The rows of the results CSV at ``path`` as {column: cell}, with ``partition``,
    read a row at a time. Raises OSError, and ValueError naming the file and line of a
    row whose cells are not as many as its header's."""
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        for cells in reader:
            if not cells:  # a blank line
                continue
            if len(cells) != len(header):
                raise ValueError(
                    f"{path}:{reader.line_num}: {len(cells)} cells, its header has {len(header)}"
                )
            yield {"partition": partition, **dict(zip(header, cells, strict=True))}


def combine_results(tables: Mapping[str, Path]) -> ResultsTable:
    """Concatenate each partition's results CSV (``{partition: path}``, in partition
    order), with a leading ``partition`` column; every cell is the CSV's text.

    Columns are the union, in order of first appearance (``combined_columns``); a
    partition without a ``set`` key has an empty cell there. Raises OSError, and
    ValueError naming the file and line of a row whose cells are not as many as its
    header's.
    """
    columns = combined_columns(tables)
    rows = [
        {name: row.get(name, "") for name in columns}
        for partition in sorted(tables)
        for row in partition_rows(partition, tables[partition])
    ]
    return ResultsTable(columns, rows)
