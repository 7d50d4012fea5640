"""results.csv built from what changed: a partition's rows in segments of ``SEGMENT_JOBS``
jobs in line order, each segment's CSV text kept as a store file
(``<partition>/.results/<n>.csv``, its rows without the header), and an index of them
(``<partition>/.results/segments.json``). A write reads from the store only the segments
whose jobs changed since they were rendered, then joins the segments' bytes under the
header into results.csv: a folder's file or an object stored whole, never all rows in
memory.

What changed: every change of a job's row sets its ``updated_at`` (the database's clock),
and its files, tries and failed servers are written with such a change. A write asks for
the jobs changed since ``SETTLE_S`` before the last write (an indexed look); a segment
keeps the ``updated_at`` of each of its jobs changed that recently when it was rendered,
so a job it already shows is not read again, while a change committed a little after
the time it carries is still seen. A job whose inputs name an upstream job's files makes
its segment depend on that job too.

Segments follow the rows: with the job file's ids, the n-th ``SEGMENT_JOBS`` of them;
without, the partition's jobs of lines ``n * SEGMENT_JOBS + 1`` to ``(n + 1) *
SEGMENT_JOBS`` (the same segments for a file of one job a line). Each keeps a digest of
its ids, so segments made one way serve the other where they hold the same jobs (one
made of ids keeps its rows' first and last line, and serves lines when its rows are
every job of its lines: a line deleted from the file leaves a job of the partition out
of the ids' segments, and those are read again by lines). Each
keeps its own columns (its ``set`` keys, the model columns if its jobs load models);
the header is their union in order, and a segment with fewer columns is written out with
empty cells where it lacks one, the same bytes a whole-table write gives.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from comfy_assets.render.results import (
    FIXED_AFTER,
    FIXED_BEFORE,
    MODEL_COLUMNS,
    JobResults,
    ResultsTable,
    csv_cell,
    last_model_tries,
    results_key,
)
from comfy_assets.store import Store
from comfy_assets.store.files import FileStore
from comfy_assets.store.files.local import file_location, writing

# Jobs per segment: a segment's rows are read and rendered together.
SEGMENT_JOBS = 10_000
# Seconds a change may take between the time it carries (``updated_at``) and its commit;
# a write asks for the changes from this long before the last write on.
SETTLE_S = 60.0
SEGMENTS_DIR = ".results"
INDEX_NAME = "segments.json"
INDEX_FORMAT = 1
# Bytes copied at a time from a segment into results.csv.
COPY_BYTES = 1 << 20
# Writes tried again when a segment's bytes are not those its index names (another
# process wrote it meanwhile).
RETRIES = 3


@dataclass
class Segment:
    """One segment as rendered: ``ids``: the sha256 of its job ids in row order (joined
    by line feeds); ``rows``; ``columns``: its own columns in order; ``digest``: the
    sha256 of its CSV bytes; ``seen``: the ``updated_at`` of each of its jobs changed
    within ``SETTLE_S`` of ``as_of`` (when it was read); ``upstream``: the ``updated_at``
    of each job of the partition whose files its inputs name; ``states``: its rows by
    state; ``by_ids``: read as a job file's ids, not lines, its rows then of lines
    ``id_lines`` (first, last; None with a job of no record)."""

    ids: str
    rows: int
    columns: list[str]
    digest: str
    as_of: float
    seen: dict[str, float] = field(default_factory=dict)
    upstream: dict[str, float] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)
    by_ids: bool = False
    id_lines: list[int] | None = None


@dataclass
class SegmentIndex:
    """The segments of a partition's results (``segments``: by number) as of the last
    write (``as_of``, the database's clock), and the header and segment digests that
    results.csv was last joined from (``joined``) and its size in bytes
    (``joined_bytes``: a results.csv of another size, cut or edited by hand, is joined
    again)."""

    as_of: float
    segments: dict[int, Segment]
    joined: str = ""
    joined_bytes: int | None = None


def segment_key(partition: str, n: int) -> str:
    """The store file key of segment ``n``: ``<partition>/.results/<n>.csv``."""
    return f"{partition}/{SEGMENTS_DIR}/{n}.csv"


def index_key(partition: str) -> str:
    """The store file key of the segment index: ``<partition>/.results/segments.json``."""
    return f"{partition}/{SEGMENTS_DIR}/{INDEX_NAME}"


def ids_digest(job_ids: Iterable[str]) -> str:
    """The sha256 of ``job_ids`` joined by line feeds."""
    return hashlib.sha256("\n".join(job_ids).encode()).hexdigest()


def read_index(files: FileStore, partition: str) -> SegmentIndex | None:
    """The partition's segment index, or None when there is none, or one of another
    format or segment size, or not of this shape (cut short by a crash, edited by hand):
    its segments are made again."""
    try:
        with files.open_file(index_key(partition)) as handle:
            data = json.loads(handle.read())
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # cut short by a crash: every segment is made again
    if not isinstance(data, dict):
        return None
    if data.get("format") != INDEX_FORMAT or data.get("segment_jobs") != SEGMENT_JOBS:
        return None
    as_of, stored, joined = data.get("as_of"), data.get("segments"), data.get("joined", "")
    if not isinstance(as_of, int | float) or isinstance(as_of, bool):
        return None
    if not isinstance(stored, dict) or not isinstance(joined, str):
        return None
    segments: dict[int, Segment] = {}
    for n, entry in stored.items():
        segment = _segment_of_entry(entry)
        if not (isinstance(n, str) and n.isdigit()) or segment is None:
            return None
        segments[int(n)] = segment
    size = data.get("joined_bytes")
    return SegmentIndex(float(as_of), segments, joined, size if isinstance(size, int) else None)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _segment_of_entry(entry: object) -> Segment | None:
    """The ``Segment`` an index entry stores, or None for one not of its shape."""
    # ``by_ids`` and ``id_lines`` are absent from an index written before they were kept.
    names = {f.name for f in fields(Segment)}
    if not isinstance(entry, dict) or set(entry) not in (names, names - {"by_ids", "id_lines"}):
        return None
    lines = entry.get("id_lines")
    if not isinstance(entry.get("by_ids", False), bool) or not (
        lines is None or (isinstance(lines, list) and all(isinstance(i, int) for i in lines))
    ):
        return None
    ids, rows, columns, digest = entry["ids"], entry["rows"], entry["columns"], entry["digest"]
    if not (isinstance(ids, str) and isinstance(digest, str) and isinstance(rows, int)):
        return None
    if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
        return None
    maps = [entry["seen"], entry["upstream"], entry["states"]]
    if not _is_number(entry["as_of"]) or not all(
        isinstance(m, dict) and all(_is_number(v) for v in m.values()) for m in maps
    ):
        return None
    return Segment(**entry)


def write_index(files: FileStore, partition: str, index: SegmentIndex) -> None:
    """Store ``index`` whole (``FileStore.write_file`` replaces it atomically)."""
    data = {
        "format": INDEX_FORMAT,
        "segment_jobs": SEGMENT_JOBS,
        "as_of": index.as_of,
        "joined": index.joined,
        "joined_bytes": index.joined_bytes,
        "segments": {str(n): asdict(s) for n, s in sorted(index.segments.items())},
    }
    files.write_file(index_key(partition), json.dumps(data).encode(), "application/json")


def header(segments: Iterable[Segment], models: bool) -> list[str]:
    """results.csv's columns: the fixed ones, each segment's ``set`` keys in order of
    first appearance, and the model columns after ``server`` when ``models``."""
    set_columns: dict[str, None] = {}
    fixed = {*FIXED_BEFORE, *FIXED_AFTER, *MODEL_COLUMNS}
    for segment in segments:
        set_columns |= {c: None for c in segment.columns if c not in fixed}
    columns = [*FIXED_BEFORE, *set_columns, *FIXED_AFTER]
    if models:
        at = columns.index("server") + 1
        columns[at:at] = MODEL_COLUMNS
    return columns


def csv_bytes(columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> bytes:
    """``rows`` as CSV lines (no header), the cells of ``columns`` as ``write_csv``
    writes them."""
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerows([csv_cell(row.get(name)) for name in columns] for row in rows)
    return out.getvalue().encode("utf-8")


class SegmentChanged(Exception):
    """A segment's stored bytes are not those its index names."""

    def __init__(self, n: int) -> None:
        super().__init__(f"segment {n} changed while being read")
        self.n = n


class SegmentsKeptChanging(OSError):
    """results.csv is not written: its segments changed under every try to join them."""


@dataclass
class Plan:
    """What one write reads: the segments' numbers in row order (``order``), whether
    they are the job file's ids ``SEGMENT_JOBS`` at a time (``by_ids``; else lines), and
    the numbers to read again (``dirty``)."""

    order: list[int]
    by_ids: bool
    dirty: set[int]
    span: tuple[int, int, int] | None = None  # by lines: ``Store.line_span`` when planned
    # By ids: the lines before the first job's (a header's): the ids' segments then
    # hold the lines of the segments by lines of the same number.
    shift: int = 0


def _chunk(job_ids: Sequence[str], n: int, shift: int) -> list[str]:
    """The job ids of segment ``n`` of a job file's ids, the first of them on line
    ``shift + 1``."""
    start, end = n * SEGMENT_JOBS - shift, (n + 1) * SEGMENT_JOBS - shift
    return list(job_ids[max(start, 0) : max(end, 0)])


def _shift(store: Store, job_ids: Sequence[str]) -> int:
    """The lines before the first of ``job_ids``' in the store (0 for none there)."""
    record = store.get(job_ids[0]) if job_ids else None
    return max(record.line - 1, 0) if record is not None else 0


def _plan(
    store: Store,
    partition: str,
    job_ids: Sequence[str] | None,
    index: SegmentIndex | None,
) -> Plan:
    """Which segments there are and which to read again (module docstring)."""
    old = index.segments if index is not None else {}
    changed = store.changed_jobs(partition, index.as_of - SETTLE_S) if index is not None else []
    # The segments each upstream job's files are shown in.
    shown_in: dict[str, list[int]] = {}
    for n, segment in old.items():
        for job_id in segment.upstream:
            shown_in.setdefault(job_id, []).append(n)
    dirty: set[int] = set()
    for change in changed:
        for n in shown_in.get(change.job_id, ()):
            if old[n].upstream.get(change.job_id) != change.updated_at:
                dirty.add(n)
    by_id = {c.job_id: c.updated_at for c in changed}

    def stale(n: int, job_id: str) -> bool:
        segment = old.get(n)
        return segment is None or segment.seen.get(job_id) != by_id[job_id]

    if job_ids is not None:
        shift = _shift(store, job_ids)
        order = list(range(_segment_of(shift + 1), _segment_of(shift + len(job_ids)) + 1))
        for n in order if job_ids else []:
            chunk = _chunk(job_ids, n, shift)
            was = old.get(n)
            if was is None or was.ids != ids_digest(chunk):
                dirty.add(n)
            elif by_id and any(i in by_id and stale(n, i) for i in chunk):
                dirty.add(n)
        return Plan(order if job_ids else [], True, dirty, shift=shift)
    numbers = set(old)
    span = store.line_span(partition)
    if span is not None:
        numbers |= set(range(_segment_of(span[0]), _segment_of(span[1]) + 1))
    numbers -= {n for n in numbers if n < 0}
    dirty |= _not_of_lines(store, partition, old)
    for change in changed:
        n = _segment_of(change.line)
        numbers.add(n)
        if stale(n, change.job_id):
            dirty.add(n)
    dirty |= numbers - set(old)
    return Plan(sorted(numbers), False, dirty, span)


def _segment_of(line: int) -> int:
    return (line - 1) // SEGMENT_JOBS


def _lines(n: int) -> tuple[int, int]:
    return n * SEGMENT_JOBS + 1, (n + 1) * SEGMENT_JOBS


def _id_lines(records: Sequence[Any], rows: int) -> list[int] | None:
    """The first and last line of a segment's rows read by ids, or None when a row has
    no record (a job missing from the store)."""
    if not records or len(records) != rows:
        return None
    lines = [r.line for r in records]
    return [min(lines), max(lines)]


def _not_of_lines(store: Store, partition: str, segments: dict[int, Segment]) -> set[int]:
    """The numbers of ``segments`` read by ids that do not show the jobs of their lines
    and no other (``Segment.by_ids``), to be read again by lines: a line deleted from
    the job file, or the file's jobs on lines another job of the partition has too,
    leave a job out of the ids' segments. Its rows' lines are those of ``n`` and as many
    as the partition's jobs of those lines (a count in the index on (partition, line))."""
    off: set[int] = set()
    for n, segment in segments.items():
        if not segment.by_ids:
            continue
        first, end = _lines(n)
        held = segment.id_lines
        if held is None or held[0] < first or held[1] > end:
            off.add(n)
            continue
        span = store.line_span(partition, (first, end))
        if span is None or span[2] != segment.rows:
            off.add(n)
    return off


@dataclass
class Rendered:
    """A segment read and rendered: its index entry and its rows (``ResultsTable``)."""

    segment: Segment
    table: ResultsTable
    text: bytes


def render_segment(
    store: Store,
    partition: str,
    n: int,
    ids: Sequence[str] | None,
    members: set[str] | None,
    as_of: float,
) -> Rendered:
    """Read segment ``n`` (the jobs ``ids``, or lines of ``n``) and render it.
    ``members``: the job file's ids, when an upstream job's files are shown only for
    jobs of the file (None: every job of the partition). Raises StoreUnavailable."""
    if ids is not None:
        read = store.read_segment(partition, job_ids=ids)
    else:
        read = store.read_segment(partition, lines=_lines(n))
    upstream = read.upstream
    files = read.files
    if members is not None:
        gone = set(upstream) - members
        files = {job_id: f for job_id, f in files.items() if job_id not in gone}
    results = JobResults.of(
        read.records, files, ids, last_model_tries(read.model_tries), read.failed_on
    )
    table = results.table()
    text = csv_bytes(table.columns, table.rows)
    row_ids = [row["job_id"] for row in table.rows]
    segment = Segment(
        ids=ids_digest(row_ids),
        rows=len(table.rows),
        columns=table.columns,
        digest=hashlib.sha256(text).hexdigest(),
        as_of=as_of,
        seen={r.job_id: r.updated_at for r in read.records if r.updated_at >= as_of - SETTLE_S},
        upstream=dict(upstream),
        states=dict(Counter(str(row["state"]) for row in table.rows)),
        by_ids=ids is not None,
        id_lines=_id_lines(read.records, len(table.rows)) if ids is not None else None,
    )
    return Rendered(segment, table, text)


def write_segmented(
    store: Store, partition: str, job_ids: Sequence[str] | None, *, sample: bool
) -> tuple[str, ResultsTable]:
    """``write_results`` (its docstring) from segments: the rows of the segments whose
    jobs changed are read again, results.csv joined from every segment. The table
    returned has the columns, the row count (``len``) and, with ``sample``, the rows of
    the first segment (none without)."""
    for attempt in range(RETRIES + 1):
        try:
            return _write(store, partition, job_ids, sample=sample)
        except SegmentChanged as e:
            index = read_index(store.file_store, partition)
            if index is not None:
                index.segments.pop(e.n, None)
                index.joined = ""
                write_index(store.file_store, partition, index)
            if attempt == RETRIES:
                raise SegmentsKeptChanging(
                    f"{results_key(partition)}: its segments kept changing while being "
                    f"joined ({RETRIES + 1} tries); another process writes them"
                ) from e
    raise AssertionError("unreachable")


def _write(
    store: Store,
    partition: str,
    job_ids: Sequence[str] | None,
    *,
    sample: bool,
    rebuilt: bool = False,
) -> tuple[str, ResultsTable]:
    files = store.file_store
    as_of = store.now()
    index = read_index(files, partition)
    plan = _plan(store, partition, job_ids, index)
    segments = {} if index is None else dict(index.segments)
    if plan.dirty & set(segments):
        # A crash before the new index is written leaves these read again, not trusted.
        for n in plan.dirty:
            segments.pop(n, None)
        write_index(files, partition, SegmentIndex(as_of, segments))
    members: set[str] | None = None
    first: ResultsTable | None = None
    for n in plan.order:
        if n not in plan.dirty:
            continue
        ids = _chunk(job_ids, n, plan.shift) if job_ids is not None else None
        rendered = render_segment(store, partition, n, ids, members, as_of)
        if job_ids is not None and rendered.segment.upstream:
            if members is None:
                members = set(job_ids)
            if set(rendered.segment.upstream) - members:
                rendered = render_segment(store, partition, n, ids, members, as_of)
        files.write_file(segment_key(partition, n), rendered.text, "text/csv")
        segments[n] = rendered.segment
        if n == plan.order[0]:
            first = rendered.table
    kept = set(plan.order)
    segments = {n: s for n, s in segments.items() if n in kept}
    if not plan.by_ids:
        # Jobs registered while the segments were read are counted too: only more rows
        # than jobs says a job is shown twice.
        span = store.line_span(partition) if plan.dirty else plan.span
        shown = sum(s.rows for s in segments.values())
        if not rebuilt and shown > (0 if span is None else span[2]):
            # A job moved to another line (its file edited): rows are shown twice.
            write_index(files, partition, SegmentIndex(as_of, {}))
            return _write(store, partition, job_ids, sample=sample, rebuilt=True)
    ordered = [segments[n] for n in plan.order]
    columns = header(ordered, store.loads_models(partition))
    joined = ids_digest([json.dumps(columns), *(s.digest for s in ordered)])
    key = results_key(partition)
    size = None if index is None else index.joined_bytes
    if index is None or index.joined != joined or size is None or _size(files, key) != size:
        size = _join(files, partition, key, columns, plan.order, segments)
    write_index(files, partition, SegmentIndex(as_of, segments, joined, size))
    rows: list[dict[str, Any]] = []
    if sample and plan.order:
        if first is None:
            n = plan.order[0]
            ids = _chunk(job_ids, n, plan.shift) if job_ids is not None else None
            first = render_segment(store, partition, n, ids, None, as_of).table
        rows = first.rows
    total = sum(s.rows for s in ordered)
    states: Counter[str] = Counter()
    for segment in ordered:
        states.update(segment.states)
    return file_location(files, key), ResultsTable(
        columns, rows, total, dict(sorted(states.items()))
    )


def _size(files: FileStore, key: str) -> int | None:
    """The bytes of the store file ``key``, or None when there is none."""
    path = files.file_path(key)
    if path is not None:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None
    return next((size for name, size in files.list_files(key) if name == key), None)


def _join(
    files: FileStore,
    partition: str,
    key: str,
    columns: list[str],
    order: Sequence[int],
    segments: dict[int, Segment],
) -> int:
    """Write results.csv: the header, then each segment's bytes in order (a segment with
    other columns rewritten to ``columns``); returns its size in bytes. Atomic: a temp
    file renamed, or stored whole. Raises SegmentChanged (a segment's bytes not those of ``segments``, or gone),
    OSError, and what the file store raises."""
    with tempfile.TemporaryDirectory(prefix="comfy-assets-csv-") as scratch:
        with writing(files, [key], Path(scratch)) as [path]:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(csv_bytes(columns, [dict(zip(columns, columns, strict=True))]))
                    for n in order:
                        segment = segments[n]
                        try:
                            source = files.open_file(segment_key(partition, n))
                        except FileNotFoundError as e:  # removed by hand: read it again
                            raise SegmentChanged(n) from e
                        with source:
                            if segment.columns == columns:
                                digest = _copy(source, out)
                            else:
                                digest = _reshape(source, out, segment, columns)
                        if digest != segment.digest:
                            raise SegmentChanged(n)
                os.chmod(tmp, 0o644)  # mkstemp makes it private; a results table is for all
                size = os.path.getsize(tmp)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return size


def _copy(source: BinaryIO, out: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := source.read(COPY_BYTES):
        digest.update(chunk)
        out.write(chunk)
    return digest.hexdigest()


def _reshape(source: BinaryIO, out: BinaryIO, segment: Segment, columns: list[str]) -> str:
    """Rows of ``source`` (columns ``segment.columns``) written with ``columns``: a cell
    it lacks is empty. The csv module reads back what it wrote, so the bytes are those of
    a row written with ``columns`` at first. Bytes not those of ``segment`` (edited or
    cut by hand) are not parsed: their digest is returned, nothing written."""
    data = source.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != segment.digest:
        return digest
    rows = csv.reader(io.StringIO(data.decode("utf-8"), newline=""))
    has = segment.columns
    out.write(csv_bytes(columns, (dict(zip(has, cells, strict=True)) for cells in rows)))
    return digest
