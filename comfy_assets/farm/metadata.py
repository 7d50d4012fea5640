"""Dagster metadata built from our results: the ``valid`` check of the job files, tables with
a column schema, and small inline pictures (base64 PNG data URIs in markdown, the one way
open-source Dagster shows an image; metadata lives in the event log, so they stay small).
"""

from __future__ import annotations

import base64
import io
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeAlias
from urllib.parse import quote

import pandas as pd
from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    MetadataValue,
    TableColumn,
    TableRecord,
    TableSchema,
)
from PIL import Image

from comfy_assets.farm.partitions import JOB_FILES_ASSET, JOB_FILES_CHECK
from comfy_assets.film.contact import contact_sheet
from comfy_assets.film.make import StoredFilm
from comfy_assets.film.probe import VIDEO_SUFFIXES, MediaError
from comfy_assets.jobs.model import JobFileError
from comfy_assets.render.cost import ModelLoadCost
from comfy_assets.render.results import FileRow, JobResults, ResultsTable
from comfy_assets.store import FileRecord, JobRecord, Store
from comfy_assets.store.files import FileStore
from comfy_assets.store.files.local import file_location, file_sha256, output_copy, writing

# An asset's metadata entry, a subset of what Dagster takes (its RawMetadataValue, which
# the package does not export): a MetadataValue, or a plain value it wraps.
MetadataEntry: TypeAlias = (
    MetadataValue | TableSchema | dict[str, Any] | list[Any] | float | int | str | None
)
Metadata: TypeAlias = dict[str, MetadataEntry]

# Errors of one bad file shown by the ``valid`` check; the rest are counted.
MAX_ERRORS_PER_FILE = 50
# Rows of a results table its metadata's column types are read from.
SCHEMA_ROWS = 10_000
# Error lines in the check's description (all of them are in its metadata).
DESCRIBED_LINES = 20
# Rows of a table in metadata: enough to scroll a batch, small enough for the event log.
TABLE_ROWS = 200
# Characters of one table cell (a reason can be a long traceback line).
CELL_CHARS = 300


# How the problem of a watched folder that does not exist starts (``missing_folder``).
NO_FOLDER = "job folder "


def missing_folder(folder: Path) -> str:
    """The problem of a watched folder that does not exist (a typo in ``job_dirs``, or a
    folder not made yet): the farm could never see a job file there."""
    return f"{NO_FOLDER}{folder} does not exist: create it, or correct the farm's job_dirs"


def job_file_problems(exc: JobFileError) -> str:
    """Every error of a rejected job file, ``path:line: field: message`` one a line, cut
    after MAX_ERRORS_PER_FILE with a count of the rest."""
    lines = [str(error) for error in exc.errors] or [str(exc)]
    if len(lines) > MAX_ERRORS_PER_FILE:
        rest = len(lines) - MAX_ERRORS_PER_FILE
        lines = [*lines[:MAX_ERRORS_PER_FILE], f"… {rest} more errors in this file"]
    return "\n".join(lines)


def job_files_check_fields(problems: Sequence[str]) -> dict[str, Any]:
    """The fields of the ``valid`` check of ``job_files`` for ``problems`` (one entry a bad
    file or ambiguous name, its lines ``path:line: field: message``): passed when empty,
    else failed (ERROR) with every line of every problem on its own line in ``errors``."""
    # A markdown code block keeps one error a line, whatever characters the messages hold.
    lines = [line.replace("```", "'''") for problem in problems for line in problem.splitlines()]
    listing = "```\n" + "\n".join(lines) + "\n```"
    if not problems:
        description = "every job file in the watched folders is valid"
    else:
        # The UI renders the description as markdown without a click: the errors go there too.
        folders = sum(problem.startswith(NO_FOLDER) for problem in problems)
        bad = len(problems) - folders
        said = []
        if folders:
            said.append(f"{folders} watched folder{'s do' if folders > 1 else ' does'} not exist")
        if bad:
            said.append(
                f"{bad} job file{'s are' if bad > 1 else ' is'} not valid, not launched until fixed"
            )
        shown = lines[:DESCRIBED_LINES]
        more = len(lines) - len(shown)
        description = "\n".join(
            [f"{' and '.join(said)}:", "", "```", *shown, "```"]
            + ([f"… {more} more lines in the metadata's errors"] if more else [])
        )
    return {
        "passed": not problems,
        "severity": AssetCheckSeverity.ERROR,
        "description": description,
        "metadata": {
            "problems": len(problems),
            "errors": MetadataValue.md(listing if lines else "none"),
        },
    }


def job_files_check_evaluation(
    problems: Sequence[str], asset_key: AssetKey | None = None
) -> AssetCheckEvaluation:
    """The ``valid`` check's evaluation of the job files' asset ``asset_key``, as the
    sensor reports it (see job_files_check_fields)."""
    return AssetCheckEvaluation(
        asset_key=asset_key or AssetKey(JOB_FILES_ASSET),
        check_name=JOB_FILES_CHECK,
        **job_files_check_fields(problems),
    )


_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _missing(value: Any) -> bool:
    """None, NaN, pd.NA or an empty CSV cell (lists and objects are values)."""
    if isinstance(value, str):
        return value == ""
    return not isinstance(value, list | dict) and bool(pd.isna(value))


def _table_type(series: pd.Series) -> str:
    """int, float, bool or string: from the dtype, else from every value present (a CSV
    read as text, or a ``set`` column of JSON numbers) so numbers sort as numbers."""
    if pd.api.types.is_bool_dtype(series):
        return "bool"
    if pd.api.types.is_integer_dtype(series):
        return "int"
    if pd.api.types.is_float_dtype(series):
        return "float"
    values = [v for v in series if not _missing(v)]
    if not values:
        return "string"
    if all(isinstance(v, bool) for v in values):
        return "bool"
    texts = [str(v) for v in values if not isinstance(v, bool)]
    if len(texts) < len(values):
        return "string"
    if all(_INT.fullmatch(t) for t in texts):
        return "int"
    if all(_FLOAT.fullmatch(t) for t in texts):
        return "float"
    return "string"


def column_schema(frame: pd.DataFrame, descriptions: dict[str, str] | None = None) -> TableSchema:
    """A TableSchema of the frame's columns: int, float, bool or string, described from
    ``descriptions`` where given."""
    described = descriptions or {}
    return TableSchema(
        columns=[
            TableColumn(
                name=str(name), type=_table_type(frame[name]), description=described.get(name)
            )
            for name in frame.columns
        ]
    )


def _table_cell(value: Any, kind: str, chars: int = CELL_CHARS) -> str | int | float | bool | None:
    """A cell as the column's ``kind`` shows it: numbers as numbers (a CSV cell is text),
    text cut at ``chars`` characters."""
    if _missing(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if kind == "int" and not isinstance(value, bool):
        return int(value)
    if kind == "float" and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool | int | float):
        return value
    text = str(value)
    return text if len(text) <= chars else text[: chars - 1] + "…"


def table(
    frame: pd.DataFrame,
    schema: TableSchema,
    max_rows: int = TABLE_ROWS,
    widths: Mapping[str, int] | None = None,
) -> MetadataValue:
    """The first ``max_rows`` rows of ``frame`` as a Dagster table (sortable in the UI);
    ``widths``: the most characters of a column's text cells (else CELL_CHARS)."""
    kinds = {column.name: column.type for column in schema.columns}
    widths = widths or {}
    records = [
        TableRecord(
            {
                str(k): _table_cell(v, kinds.get(str(k), "string"), widths.get(str(k), CELL_CHARS))
                for k, v in row.items()
            }
        )
        for row in frame.head(max_rows).to_dict(orient="records")
    ]
    return MetadataValue.table(records=records, schema=schema)


def png_markdown(image: Image.Image, alt: str, max_px: int) -> str:
    """``image`` shrunk to fit ``max_px`` square as a markdown image (base64 PNG)."""
    image = image.copy()
    image.thumbnail((max_px, max_px))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG", optimize=True)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f"![{alt}](data:image/png;base64,{data})"


def png_file_markdown(path: Path, alt: str, max_px: int) -> str:
    """The PNG at ``path`` as png_markdown."""
    with Image.open(path) as image:
        return png_markdown(image, alt, max_px)


JOB_COLUMNS = {
    "job": "The job id's first 8 characters (as in log lines; the full id is in "
    "results.csv and in the dead_letters table).",
    "line": "Its line in the job file.",
    "shot": "Its shot number in a storyboard.",
    "take": "Its take (a new take renders the job again; earlier takes' files stay).",
    "state": "succeeded, degraded, failed_fatal (dead letter), pending, ...",
    "server": "The ComfyUI server that rendered it last.",
    "failed_on": "The servers its failed attempts ran on, in order (where a dead letter failed).",
    "attempts": "Attempts since its inputs last changed.",
    "seconds": "Wall time of the job, seconds.",
    "inputs": "Its input files: key=path@sha256 (the first 8 hex digits; or the upstream "
    "job, node and file); cut at 60 characters, in full in results.csv.",
    "reason": "Why it failed or degraded; cut at 60 characters, in full in results.csv.",
    "job_id": "The job's id (the job line's id).",
    "models": "The model files its workflow loads.",
    "model_loaded": "Its server had to load one of them for its last try.",
}
# Left out of the job table in the UI, so it fits a page: the full id is in results.csv.
WIDE_JOB_COLUMNS = ("job_id",)
# The longest cell of these columns of the job table in the UI, cut with "…" beyond (the
# full text is in results.csv): with the other columns, under 1600 pixels.
JOB_CELL_CHARS = {"inputs": 60, "reason": 60}
# An input's sha256 in the UI's job table: its first 8 hex digits, as a job id's.
_INPUT_SHA = re.compile(r"@sha256:([0-9a-f]{8})[0-9a-f]*")


def job_table(jobs: pd.DataFrame) -> MetadataValue:
    """The job table the UI shows of ``jobs`` (``jobs_frame``): without WIDE_JOB_COLUMNS
    and the columns empty in every row (no shots, no failure), an input's sha256 as its
    first 8 hex digits, cells of JOB_CELL_CHARS cut, so that it fits a 1600-pixel page."""
    shown = jobs.drop(columns=list(WIDE_JOB_COLUMNS))
    empty = [name for name in shown.columns if all(_missing(v) for v in shown[name])]
    shown = shown.drop(columns=[name for name in empty if name not in ("job", "state")])
    if "inputs" in shown.columns:
        shown["inputs"] = [
            v if _missing(v) else _INPUT_SHA.sub(r"@\1", str(v)) for v in shown["inputs"]
        ]
    return table(shown, column_schema(shown, JOB_COLUMNS), widths=JOB_CELL_CHARS)


# Jobs that load no model have no model columns (their batch's tables show none).
MODEL_JOB_COLUMNS = ("models", "model_loaded")


def jobs_frame(
    records: Sequence[Any],
    job_ids: Sequence[str],
    files: Mapping[str, Iterable[FileRow]] | None = None,
    models: dict[str, tuple[tuple[str, ...], bool]] | None = None,
    failed_on: Mapping[str, Sequence[str]] | None = None,
) -> pd.DataFrame:
    """One row per job id (in line order) from the store's job records; a job without a
    record is ``missing``. ``files``: each job's output files (for the sha256 of an input
    taken from an upstream job). Columns: JOB_COLUMNS, the model ones only with ``models``
    (``render.results.last_model_tries``) not empty; ``failed_on``: the servers each job
    failed on (``Store.failed_on``). ``job_frame`` of ``JobResults.of`` these."""
    return job_frame(JobResults.of(records, files or {}, job_ids, models, failed_on))


def job_frame(results: JobResults) -> pd.DataFrame:
    """The UI's view of ``results``: a row per job with JOB_COLUMNS (the job id cut to
    ``job`` too, the inputs' sha256 and upstream ids short; the model columns only when
    a job loads models)."""
    rows = []
    for job_id in results.job_ids:
        row = {"job": job_id[:8], **results.cells(job_id, short=True)}
        found = results.models.get(job_id)
        if found is not None and job_id in results.records:
            row["models"] = " ".join(found[0])
            row["model_loaded"] = found[1]
        rows.append(row)
    columns = [c for c in JOB_COLUMNS if results.models or c not in MODEL_JOB_COLUMNS]
    frame = pd.DataFrame(rows, columns=columns, dtype=object)
    for name in ("line", "shot", "take", "attempts"):
        frame[name] = frame[name].astype("Int64")
    frame["seconds"] = frame["seconds"].astype("Float64")
    return frame


# A partition's contact sheet: every output of its done jobs (shots in shot order, then
# jobs in line order, each job's outputs in its workflow's node order), up to SHEET_TILES.
# Four 140 px tiles a row: 560 px fit the metadata column of Dagster's UI (wider is cut).
SHEET_TILES = 60
SHEET_COLUMNS = 4
SHEET_TILE_PX = 140
PICTURE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp"}) | VIDEO_SUFFIXES


# The store file key of a partition's contact sheet of outputs (``<partition>/...``).
OUTPUTS_SHEET = "outputs.contact.png"
# How long a presigned link in an asset's metadata is good for: the event log keeps
# metadata for good and S3 signs a URL for a week at most, so the longest; a picture
# older than that shows as broken until the asset is materialized again.
METADATA_URL_EXPIRY_S = 7 * 24 * 3600


@dataclass(frozen=True)
class OutputsSheet:
    """A partition's contact sheet, stored as the store's file ``key``: ``shown`` of the
    ``outputs`` pictures and videos of ``jobs`` done jobs."""

    key: str
    shown: int
    outputs: int
    jobs: int

    def caption(self) -> str:
        """``40 outputs of 20 jobs``, or ``the first 60 of 84 outputs of 42 jobs``."""
        jobs = f"{self.jobs} job" + ("" if self.jobs == 1 else "s")
        if self.shown < self.outputs:
            return f"the first {self.shown} of {self.outputs} outputs of {jobs}"
        return f"{self.outputs} output" + ("" if self.outputs == 1 else "s") + f" of {jobs}"


def tile_label(job_id: str, shot: int | None, name: str, output: int = 1, outputs: int = 1) -> str:
    """A tile's label. A shot's: ``shot 3 · job 1a2b3c4d``, with ``output 2 of 3`` under
    it for a job of several outputs (its file's name is ComfyUI's counter, which says
    nothing of the shot); a job's without a shot: ``job 1a2b3c4d`` over the file's
    ``name``."""
    job = f"job {job_id[:8]}"
    if shot is None:
        return f"{job}\n{name}"
    return f"shot {shot} · {job}" + (f"\noutput {output} of {outputs}" if outputs > 1 else "")


def node_order(node_id: str | None) -> tuple[int, int, str]:
    """Workflow node ids in their numeric order ("3" before "10"), others after."""
    if node_id is not None and node_id.isdigit():
        return (0, int(node_id), "")
    return (1, 0, node_id or "")


def outputs_contact_sheet(
    store: Store,
    partition: str,
    picks: Sequence[tuple[JobRecord, Sequence[FileRecord]]],
    outputs: int,
    jobs: int,
) -> OutputsSheet | None:
    """Write the store's file ``<partition>/outputs.contact.png``: a contact sheet of the
    pictures and videos of ``picks`` (the first done jobs with any, in shot then line
    order, each with its pictures in its workflow's node order: ``node_order``), a
    video's middle frame, each tile labelled (``tile_label``); the first SHEET_TILES of
    them, said as of ``outputs`` pictures of ``jobs`` jobs. Outputs of a store whose
    files are not on this disk are copied to a scratch folder for it, and the sheet is
    stored once made. Returns None when no job has one. Raises MediaError for a broken
    file or one gone from the store, OSError, and what the file store raises."""
    tiles: list[tuple[str, FileRecord]] = []
    labels: list[str] = []
    for record, files in picks:
        for n, f in enumerate(files[: max(0, SHEET_TILES - len(tiles))], start=1):
            tiles.append((record.job_id, f))
            name = PurePosixPath(f.path).name
            labels.append(tile_label(record.job_id, record.shot, name, n, len(files)))
    if not tiles:
        return None
    file_store = store.file_store
    key = f"{partition}/{OUTPUTS_SHEET}"
    with tempfile.TemporaryDirectory(prefix="comfy-assets-sheet-") as scratch:
        clips = []
        for job_id, f in tiles:
            try:
                clips.append(output_copy(file_store, partition, job_id, f, Path(scratch, "in")))
            except FileNotFoundError as e:
                raise MediaError(Path(f.path), f"output of job {job_id} gone from the store") from e
        with writing(file_store, [key], Path(scratch, "out")) as [out]:
            contact_sheet(
                clips, out, columns=SHEET_COLUMNS, thumb_width=SHEET_TILE_PX, labels=labels
            )
    return OutputsSheet(key, len(clips), outputs, jobs)


def served_url(base: str, key: str, path: Path) -> str:
    """The URL of the store's file ``key`` (at ``path``) with the store's folder served at
    ``base``, with ``?v=`` and the first 12 hex digits of its sha256, so a browser shows
    the file as it is now rather than one it cached. Raises OSError."""
    digest = file_sha256(path).sha256[:12]
    return f"{base.rstrip('/')}/{quote(key)}?v={digest}"


def stored_url(files: FileStore, key: str, media: str | None) -> str | None:
    """The link the UI shows the store's file ``key`` by: a presigned URL where the store
    gives one (good for METADATA_URL_EXPIRY_S), else with the store's folder served at
    ``media`` (the resource's ``media_url``) ``served_url``, else None."""
    url = files.file_url(key, METADATA_URL_EXPIRY_S)
    path = files.file_path(key)
    if url is None and media is not None and path is not None:
        url = served_url(media, key, path)
    return url


def stored_picture(files: FileStore, key: str, alt: str, max_px: int, media: str | None) -> str:
    """The store's picture ``key`` as markdown (``picture_markdown``): a link by
    ``stored_url`` when there is one, else a thumbnail read from this disk. Raises
    FileNotFoundError for a store that gives neither, OSError."""
    url = stored_url(files, key, media)
    path = files.file_path(key)
    if url is None and path is None:
        raise FileNotFoundError(f"{files.location}/{key}: neither a link nor a path")
    return picture_markdown(path, alt, max_px, url)


def picture_markdown(path: Path | None, alt: str, max_px: int, url: str | None) -> str:
    """The picture at ``path`` as markdown: with its ``url``, a link of a few dozen
    characters that the UI shows inline, full size, without a click (a click on it opens
    the file); without one, a base64 thumbnail ``max_px`` square (the UI shows markdown
    over 1000 characters behind [Show Markdown]). Raises ValueError for neither."""
    if url is not None:
        return f"[![{alt}]({url})]({url})"
    if path is None:
        raise ValueError(f"picture {alt!r}: no URL and no path")
    return png_file_markdown(path, alt, max_px)


RESULTS_COLUMNS = {
    "job_id": "The job's id.",
    "line": "Its line in the job file.",
    "shot": "Its shot number in a storyboard (empty for none).",
    "state": "succeeded, degraded, failed_fatal (dead letter), pending, missing, ...",
    "server": "The ComfyUI server that rendered it last.",
    "attempts": "Attempts since its inputs last changed.",
    "seconds": "Wall time of the job, seconds.",
    "files": "Its outputs, name:sha256[:12], space-separated.",
    "reason": "Why it failed or degraded.",
    "partition": "The job file (partition) of the row.",
}


def results_metadata(results: ResultsTable, location: str) -> Metadata:
    """Row count, ``location`` (the whole CSV), the column schema, a preview and, when
    known, the rows by state: a size that does not grow with the table (the schema's
    types from its first ``SCHEMA_ROWS`` rows, ``results`` perhaps its first rows only)."""
    # object dtype keeps each value as it is (64 stays 64 where some rows lack a key).
    sample = results.rows[:SCHEMA_ROWS]
    frame = pd.DataFrame(sample, columns=results.columns, dtype=object)
    schema = column_schema(frame, RESULTS_COLUMNS)
    metadata: Metadata = {
        "dagster/row_count": len(results),
        "dagster/column_schema": schema,
        "path": MetadataValue.path(location),
        "preview": table(frame, schema),
    }
    if results.states is not None:
        metadata["states"] = MetadataValue.json(results.states)
    return metadata


def film_metadata(
    stored: StoredFilm,
    cost: dict[str, float | int | None] | None,
    sheet_px: int,
    files: FileStore,
    media: str | None = None,
) -> Metadata:
    """The film materialization's metadata: the contact sheet, the film, then the cost
    report as numbers. ``files``: the store the film is in; ``media``: the URL its folder
    is served at over HTTP, if it is. With a link to the film (``stored_url``: presigned
    in an object store, or by ``media``) the film is a link that plays it and the sheet
    is inline."""
    film = stored.result
    film_url = stored_url(files, stored.film_key, media)
    metadata: Metadata = {}
    if film_url is not None:
        metadata["film"] = MetadataValue.url(film_url)
    metadata["contact_sheet"] = MetadataValue.md(
        stored_picture(files, stored.sheet_key, "film contact sheet", sheet_px, media)
    )
    metadata |= {
        "path": MetadataValue.path(file_location(files, stored.film_key, resolved=True)),
        "duration_s": MetadataValue.float(float(film.concat.duration_s)),
        "shot_count": film.concat.clips,
        "degraded_shots": MetadataValue.json(film.gate.degraded),
        "placeholder_shots": MetadataValue.json(film.gate.placeholders),
        "policy": film.gate.mode,
        "draft": film.gate.draft,
        "concat_mode": film.concat.mode,
        "contact_sheet_path": MetadataValue.path(
            file_location(files, stored.sheet_key, resolved=True)
        ),
    }
    if film.concat.reason:
        metadata["concat_reason"] = film.concat.reason
    for key, value in (cost or {}).items():
        if value is None:  # a strategy that never finishes (every attempt failed)
            metadata[key] = MetadataValue.null()
        elif isinstance(value, int):
            metadata[key] = MetadataValue.int(value)
        else:
            metadata[key] = MetadataValue.float(float(value))
    return metadata


SERVER_COLUMNS = {
    "server": "The ComfyUI server.",
    "state": "ok, quarantined (until when, why) or trial (its next job decides).",
    "jobs_done": "Jobs of this partition it rendered.",
    "failures_server": "Failures it owns: jobs that failed there and rendered elsewhere, "
    "and infrastructure errors (every partition of the store).",
    "failures_job": "Failures there that were the job's own (every partition).",
    "quarantines": "Times it was quarantined (every partition).",
}


def servers_metadata(
    servers: Sequence[str], done: Mapping[str, int], health: Mapping[str, Any]
) -> Metadata:
    """The ``servers`` table of a partition: per server, its state and the failures it
    and the jobs own (``Store.server_health``), the partition's jobs it rendered
    (``done``: per server, its jobs succeeded or degraded)."""
    rows = []
    for name in dict.fromkeys([*servers, *done]):
        h = health.get(name)
        state = h.line().removeprefix(f"{name} ") if h is not None else "ok"
        rows.append(
            {
                "server": name,
                "state": state,
                "jobs_done": done.get(name, 0),
                "failures_server": h.failures_server if h is not None else 0,
                "failures_job": h.failures_job if h is not None else 0,
                "quarantines": h.quarantines if h is not None else 0,
            }
        )
    frame = pd.DataFrame(rows, columns=list(SERVER_COLUMNS))
    return {"servers": table(frame, column_schema(frame, SERVER_COLUMNS))}


def model_load_metadata(cost: ModelLoadCost) -> Metadata:
    """A partition's model loads (``render.cost.model_load_cost``): how many, the GPU
    seconds they took, and per server."""
    frame = pd.DataFrame(
        [
            {"server": server, "loads": loads, "gpu_seconds": seconds}
            for server, (loads, seconds) in cost.by_server.items()
        ],
        columns=["server", "loads", "gpu_seconds"],
    )
    described = {
        "server": "The ComfyUI server.",
        "loads": "Tries for which it had to load a model.",
        "gpu_seconds": "GPU seconds those loads took (estimated: render/cost.py).",
    }
    return {
        "model_loads": cost.loads,
        "model_load_gpu_seconds": MetadataValue.float(float(cost.gpu_seconds)),
        "model_loads_by_server": table(frame, column_schema(frame, described)),
    }
