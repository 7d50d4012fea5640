"""Job files too big to hold: validated whole in one streaming pass (``scan_job_file``),
their jobs built again a chunk at a time as a batch takes them (``JobReader``).

The pass checks every line as ``load_job_file`` does, with the same errors by
file:line:field, but keeps no job: per job line it keeps its byte offset, its line number,
a hash of its bytes and its id (16 bytes), about 40 bytes a job; a workflow file is read
and parsed once whatever the number of jobs naming it, and not copied per job. Building a
job (its resolved workflow, sha256 and prompt_id) waits until a batch takes it: the
reader reads its line again, checks its bytes are those validated, and builds it as
``load_job_file`` would have. A file with a job taking an input from another job is
loaded whole instead (``load_job_file``): its prompt_ids follow its upstream jobs'.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from array import array
from binascii import unhexlify
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, overload

from comfy_assets.jobs.halves import can_halve, read_halves
from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import (
    UUID_PATTERN,
    Header,
    InputFromJob,
    Job,
    JobFile,
    JobFileError,
    LineError,
    Policy,
)
from comfy_assets.jobs.parse import (
    LineParser,
    input_file_line,
    load_job_file,
    note_repeats,
    open_job_file,
    version_of,
)
from comfy_assets.jobs.quick import QuickLines, Shape, Template, flat_object
from comfy_assets.jobs.regular_file import open_regular_file
from comfy_assets.jobs.workflows import WorkflowCache

BOM = b"\xef\xbb\xbf"


class JobFileChanged(OSError):
    """A line of a job file is no longer the line validated (the file was changed
    while its batch ran): names the file and the line. An OSError: like a read that
    failed, it stops the run, which says so and exits 1."""


@dataclass(eq=False)
class JobScan:
    """A validated job file whose jobs are built when taken (``reader``).

    ``count``: its jobs; ``storyboard``: whether any has a ``shot``; ``shots``: how many
    have one; ``input_files``: how many input files its lines name (a file named by two
    lines counted twice); ``sha256``: the version, as ``JobFile.sha256``."""

    path: Path
    sha256: str
    header: Header
    count: int
    storyboard: bool
    shots: int
    input_files: int
    parser: LineParser = field(repr=False)
    # Per job, in line order: byte offset of its line, line number, hash of its bytes.
    offsets: array[int] = field(repr=False)
    lines: array[int] = field(repr=False)
    digests: array[int] = field(repr=False)
    ids: bytes = field(repr=False)  # 16 bytes a job, in line order

    @property
    def policy(self) -> Policy:
        """The film policy of the header."""
        return self.header.policy

    def job_ids(self) -> JobIds:
        """The job ids, in line order (made when read: 16 bytes a job held)."""
        return JobIds(self.ids)

    def reader(self) -> JobReader:
        """A reader of the jobs from the first (close it after use)."""
        return JobReader(self)


class JobIds(Sequence[str]):
    """Job ids held as 16 bytes each (``ids``), read as the lowercase hyphenated UUIDs
    they were written as."""

    def __init__(self, ids: bytes) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids) // 16

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        start = 16 * (index % len(self))
        return str(uuid.UUID(bytes=self.ids[start : start + 16]))

    def __iter__(self) -> Iterator[str]:
        ids = self.ids
        for i in range(0, len(ids), 16):
            yield str(uuid.UUID(bytes=ids[i : i + 16]))


class JobReader:
    """Builds a scanned file's jobs again, in line order, a chunk at a time (``take``).
    Raises ``JobFileChanged`` when a line's bytes are not those validated."""

    def __init__(self, scan: JobScan) -> None:
        self.scan = scan
        self.next = 0  # index of the next job to build
        self._file: BinaryIO = open_regular_file(scan.path)

    def take(self, count: int) -> list[Job]:
        """The next ``count`` jobs (fewer at the end of the file, none after it)."""
        scan, parser = self.scan, self.scan.parser
        jobs: list[Job] = []
        while len(jobs) < count and self.next < scan.count:
            i = self.next
            number = scan.lines[i]
            self._file.seek(scan.offsets[i])
            raw = self._file.readline()
            if hash(raw) != scan.digests[i]:
                raise JobFileChanged(
                    f"{scan.path}:{number}: the line changed since it was validated"
                )
            body = raw[len(BOM) :] if number == 1 and raw.startswith(BOM) else raw
            errors = len(parser.errors)
            obj = parser.parse_line(body.decode("utf-8").strip(), number)
            job = None if obj is None else parser.job(obj, number)
            if not isinstance(job, Job) or len(parser.errors) > errors:
                del parser.errors[errors:]
                raise JobFileChanged(
                    f"{scan.path}:{number}: the line changed since it was validated"
                )
            jobs.append(job)
            self.next += 1
        return jobs

    def close(self) -> None:
        self._file.close()


def scan_job_file(
    path: Path, workflows: WorkflowCache | None = None, *, rules: InputRules | None = None
) -> JobScan | JobFile:
    """Validate the job file at ``path`` in one pass, keeping no job (``JobScan``); a
    file with a job taking an input from another job is loaded whole (``JobFile``).

    Raises ``JobFileError`` with the errors ``load_job_file`` gives, in the same order:
    every bad line, a missing or unreadable file, no job line, bytes that are not UTF-8,
    a repeated ``id`` or ``shot``."""
    path = Path(path)
    where = str(path)
    cache = workflows or WorkflowCache()

    def new_parser() -> LineParser:
        parser = LineParser(where, path.parent, cache, rules)
        parser.keep_workflows = False
        return parser

    with open_job_file(path) as handle:
        try:
            size = os.fstat(handle.fileno()).st_size
            # Two cores check a big file's halves at once; one with any problem is read
            # again in one pass, which says every error in order.
            found = (
                read_halves(where, handle, size, _Pass, new_parser()) if can_halve(size) else None
            )
            if found is None:
                handle.seek(0)
                found = _Pass(new_parser())
                found.read(handle)
        except _HasChained:
            return load_job_file(path, workflows, rules=rules)
        except OSError as e:
            raise JobFileError([LineError(where, 0, "file", f"cannot read: {e.strerror}")]) from e
    parser = found.parser
    errors = parser.errors
    if found.job_lines == 0:
        # An empty batch would wait forever for jobs that never come.
        parser.error(0, "file", "no jobs in file")
    repeats = found.repeated_ids()
    if repeats or found.shot_errors:
        errors = sorted(errors + repeats + found.shot_errors, key=lambda e: e.line)
    if errors:
        raise JobFileError(errors)
    return JobScan(
        path=path,
        sha256=version_of(found.digest, found.input_files),
        header=found.header,
        count=len(found.offsets),
        storyboard=found.storyboard,
        shots=len(found.seen_shots),  # a file with a shot repeated is not valid
        input_files=len(found.input_files),
        parser=parser,
        offsets=found.offsets,
        lines=found.lines,
        digests=found.digests,
        ids=bytes(found.ids),
    )


class _HasChained(Exception):
    """A job takes an input from another job: the file is loaded whole."""


class _Pass:
    """One pass over a job file's lines (``read``), and what it kept."""

    def __init__(self, parser: LineParser) -> None:
        self.parser = parser
        self.header = Header()
        self.digest: Any = hashlib.sha256()
        self.offsets = array("q")
        self.lines = array("q")
        self.digests = array("q")
        self.ids = bytearray()
        self.odd_ids: dict[str, int] = {}  # ids not in the canonical form, first line
        self.odd_errors: list[LineError] = []
        self.seen_shots: dict[int, int] = {}
        self.shot_errors: list[LineError] = []
        self.input_files: list[str] = []
        self.job_lines = 0  # non-blank lines that are not the header, valid or not
        self.storyboard = False
        self._id_lines = array("q")  # the line of each id in ``ids``
        self.blank = True  # no non-blank line read (from line 1) yet

    def read(
        self, handle: BinaryIO, *, start_line: int = 1, offset: int = 0, end: int | None = None
    ) -> None:
        """Check the lines of ``handle`` from its position, line ``start_line`` at byte
        ``offset``, up to byte ``end`` (a line boundary; None: the end of the file)."""
        parser = self.parser
        where = parser.source
        quick = QuickLines(parser)
        template: Template | None = None  # of the first shape that has one
        tried: set[Shape | None] = set()
        first = start_line == 1
        offsets, lines, digests = self.offsets, self.lines, self.digests
        ids, id_lines = self.ids, self._id_lines
        # Lines end at b"\n" alone, as load_job_file's split("\n"): JSON strings may hold
        # U+2028 and friends.
        for number, raw in enumerate(handle, start=start_line):
            start = offset
            if end is not None and start >= end:
                break
            offset += len(raw)
            self.digest.update(raw)
            if template is not None and (match := template(raw)) is not None:
                # The text of a valid line but for its id and set values, which it takes.
                first = False
                self.job_lines += 1
                ids += unhexlify(match[1].replace(b"-", b""))
                id_lines.append(number)
                offsets.append(start)
                lines.append(number)
                digests.append(hash(raw))
                continue
            body = raw[len(BOM) :] if number == 1 and raw.startswith(BOM) else raw
            try:
                text = body.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                # Only this error, as load_job_file, which decodes the whole file first.
                message = f"not UTF-8 at byte {e.start + 1} of the line: {e.reason}"
                raise JobFileError([LineError(where, number, "file", message)]) from e
            if not text:
                continue
            obj = flat_object(text)
            shape = None
            if obj is None:
                obj = parser.parse_line(text, number)
            elif "header" not in obj:
                shape = quick.shape(obj)
                if quick.valid(obj, shape):
                    # Like a valid line before it: its own values were checked, and are.
                    if template is None and shape not in tried:
                        tried.add(shape)
                        template = quick.template(obj, raw)
                    first = False
                    self.job_lines += 1
                    ids += bytes.fromhex(obj["id"].replace("-", ""))
                    id_lines.append(number)
                    if obj.get("shot") is not None:
                        self._note_shot(obj, number)
                        self.storyboard = True
                    offsets.append(start)
                    lines.append(number)
                    digests.append(hash(raw))
                    continue
            if isinstance(obj, dict) and "header" in obj:
                if first:
                    self.header = parser.header(obj, number) or self.header
                else:
                    parser.error(number, "header", "the header must be the first non-blank line")
                first = False
                continue
            first = False
            self.job_lines += 1
            if obj is not None and self._check(obj, number, shape, quick):
                offsets.append(start)
                lines.append(number)
                digests.append(hash(raw))
        self.blank = first

    def _check(
        self, obj: dict[str, Any], number: int, shape: Shape | None, quick: QuickLines
    ) -> bool:
        """Check the job line ``obj`` by ``LineParser``: True when it is valid."""
        parser = self.parser
        fields = parser.fields(obj, number, build=False)
        self._note_id(obj, number)
        if obj.get("shot") is not None:
            self._note_shot(obj, number)
        if fields is None:
            return False
        if fields.inputs:
            if any(isinstance(i, InputFromJob) for i in fields.inputs):
                raise _HasChained
            self.input_files += [input_file_line(fields.id, i) for i in fields.inputs]
        else:
            quick.learn(shape)
        if fields.shot is not None:
            self.storyboard = True
        return True

    def _note_shot(self, obj: dict[str, Any], number: int) -> None:
        parser = self.parser
        errors = len(parser.errors)
        note_repeats(parser, obj, number, None, self.seen_shots)
        # Repeated shots are said after the line's other errors, as load_job_file does.
        self.shot_errors += parser.errors[errors:]
        del parser.errors[errors:]

    def _note_id(self, obj: dict[str, Any], number: int) -> None:
        job_id = obj.get("id")
        if not isinstance(job_id, str):
            return
        if UUID_PATTERN.fullmatch(job_id):
            self.ids += bytes.fromhex(job_id.replace("-", ""))
            self._id_lines.append(number)
        elif job_id in self.odd_ids:
            first = self.odd_ids[job_id]
            message = f"{job_id} repeated; first on line {first}"
            self.odd_errors.append(LineError(self.parser.source, number, "id", message))
        else:
            self.odd_ids[job_id] = number

    def repeated_ids(self) -> list[LineError]:
        """An error for each line whose id an earlier line has, naming the first."""
        found = list(self.odd_errors)
        if not self.ids:
            return found
        import numpy as np  # here: every command imports this module, few use this

        halves = np.frombuffer(bytes(self.ids), dtype=">u8").reshape(-1, 2)
        order = np.lexsort((halves[:, 1], halves[:, 0]))  # stable: line order within an id
        ordered = halves[order]
        same = np.all(ordered[1:] == ordered[:-1], axis=1)
        if not same.any():
            return found
        lines = np.frombuffer(self._id_lines, dtype=np.int64)
        first = order[0]
        for k in range(1, len(order)):
            if not same[k - 1]:
                first = order[k]
                continue
            later = order[k]
            job_id = str(uuid.UUID(bytes=bytes(self.ids[16 * later : 16 * later + 16])))
            message = f"{job_id} repeated; first on line {lines[first]}"
            found.append(LineError(self.parser.source, int(lines[later]), "id", message))
        return found
