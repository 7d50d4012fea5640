"""What a job file holds once validated: jobs, their input files, the header, and the
errors of a bad file.

Each job gets an idempotency key: ``prompt_id = uuid5(NAMESPACE, f"{id}:{workflow_sha256}")``
(``f"{id}:{workflow_sha256}:take={take}"`` for a take other than 1) where
``workflow_sha256`` hashes the canonical JSON of the resolved workflow. In that workflow
each input file's node input holds a placeholder naming its content (its sha256), and each
input from another job the upstream job's prompt_id, so the same job with the same input
bytes always gets the same prompt_id, and a changed input, a changed upstream job or a new
take gives a new one.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from comfy_assets.jobs.strict_json import CONTROL_CHARACTERS, quoted

# Fixed forever: changing it changes every prompt_id and so re-renders everything.
NAMESPACE = uuid.UUID("d20cb511-11c0-5807-a7e6-7f81477668c7")

Policy = Literal["delivery", "draft"]

POLICIES: tuple[str, ...] = ("delivery", "draft")

UUID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# The subfolder of a server's input folder where job inputs are uploaded.
INPUT_SUBFOLDER = "comfy_assets"

# The extensions kept in an upload name: short, lowercase letters and digits only, so the
# name never holds anything a server or a file system could read as a path.
_SUFFIX = re.compile(r"\.[a-z0-9]{1,8}")


@dataclass(frozen=True)
class LineError:
    """One problem in a job file: ``path:line: field: message`` (line is 1-based)."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        # A field's name is the file's own text: its control characters (an escape
        # sequence that recolours or retitles a terminal) are shown, not sent.
        return _visible(f"{self.path}:{self.line}: {self.field}: {self.message}")


def _visible(text: str) -> str:
    """``text`` with each control character written as Python escapes it (``\\x1b``)."""
    return CONTROL_CHARACTERS.sub(lambda m: repr(m.group(0))[1:-1], text)


class JobFileError(ValueError):
    """A job file (or a queued job) was rejected; ``errors`` lists every problem found.

    ``str()`` gives all of them, one ``path:line: field: message`` per line.
    """

    def __init__(self, errors: list[LineError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Header:
    """Film policy of a job file. ``duration_tolerance`` is a fraction (0.1 = 10 %).
    ``priority``: its batch's priority among those sharing the servers (higher first)."""

    policy: Policy = "delivery"
    duration_tolerance: float = 0.1
    priority: int = 0


# The priorities a batch may have: wide enough for any scheme, narrow enough for a
# 32-bit column.
MAX_PRIORITY = 1_000_000


def policy_problem(value: object) -> str | None:
    """Why ``value`` is not a film policy (``POLICIES``), in the words a job file's header
    and a queue message both use; None when it is one."""
    if value in POLICIES:
        return None
    return f'expected "delivery" or "draft", got {quoted(value)}'


def priority_problem(value: object) -> str | None:
    """Why ``value`` is not a batch priority (``is_priority``), in the words a job file's
    header and a queue message both use; None when it is one."""
    if is_priority(value):
        return None
    return f"expected an integer from -{MAX_PRIORITY} to {MAX_PRIORITY}, got {quoted(value)}"


def is_priority(value: object) -> bool:
    """True for an integer (not a bool) from -MAX_PRIORITY to MAX_PRIORITY."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and -MAX_PRIORITY <= value <= MAX_PRIORITY
    )


class InputChanged(ValueError):
    """An input file's bytes are no longer those validated (their sha256 differs)."""


@dataclass(frozen=True)
class InputFile:
    """A file a job uploads before its POST, into the node input ``node_id.input_name``.

    ``path`` is as written in the job line (relative to the job file); ``sha256`` (hex)
    and ``size`` (bytes) are those of the bytes validated. The bytes come from ``data``
    (a queue message's inline bytes), else from ``source`` (the absolute, resolved path
    to read at upload), else from ``opener`` (an object of the store, ``path`` its
    ``s3://`` URL). None takes part in equality: the same bytes from a file or from a
    message are the same input.
    """

    key: str
    node_id: str
    input_name: str
    path: str
    sha256: str
    size: int
    source: Path | None = field(default=None, compare=False)
    data: bytes | None = field(default=None, repr=False, compare=False)
    opener: Callable[[], BinaryIO] | None = field(default=None, repr=False, compare=False)

    @property
    def upload_name(self) -> str:
        """The file name to upload under: ``f"{sha256}{suffix}"``, the suffix being the
        path's extension lowercased when it is a dot and 1 to 8 letters or digits, else
        "". Derived from the content: the same bytes get the same name on every server,
        other bytes never share it."""
        suffix = PurePosixPath(self.path).suffix.lower()
        return self.sha256 + (suffix if _SUFFIX.fullmatch(suffix) else "")

    @property
    def placeholder(self) -> str:
        """What the job's resolved workflow holds in this node input until upload:
        ``f"{INPUT_SUBFOLDER}/{upload_name}"``."""
        return f"{INPUT_SUBFOLDER}/{self.upload_name}"

    def read(self) -> bytes:
        """The bytes: ``data``, else the contents of ``source``, else of the object
        ``opener`` opens. Raises ``InputChanged`` when their sha256 is not ``sha256``
        (the file changed since it was validated), ``OSError`` as reading raises it (a
        missing object: FileNotFoundError), ``ValueError`` when there is none of them."""
        if self.data is not None:
            data = self.data
        elif self.source is not None:
            data = self.source.read_bytes()
        elif self.opener is not None:
            with self.opener() as f:
                data = f.read(self.size + 1)  # one more byte tells an object that grew
        else:
            raise ValueError(f"input {self.key} ({self.path}) has neither bytes nor a file")
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.sha256:
            where = self.source or self.path if self.data is None else "its bytes"
            raise InputChanged(
                f"input {self.key} ({self.path}) changed since it was validated: "
                f"{where} has sha256 {digest}, not {self.sha256}"
            )
        return data


@dataclass(frozen=True)
class InputFromJob:
    """A node input fed by a file another job of the same job file writes: the
    ``index``-th file (0-based) of node ``node`` of job ``job``. ``upstream_prompt_id``
    is that job's prompt_id (set by the parser, which resolves upstream jobs first)."""

    key: str
    node_id: str
    input_name: str
    job: str
    node: str
    index: int = 0
    upstream_prompt_id: str = ""

    @property
    def placeholder(self) -> str:
        """What the job's resolved workflow holds in this node input until upload:
        ``f"{INPUT_SUBFOLDER}/job-{upstream_prompt_id}-{node}-{index}"``."""
        return f"{INPUT_SUBFOLDER}/job-{self.upstream_prompt_id}-{self.node}-{self.index}"


Input = InputFile | InputFromJob


@dataclass(frozen=True)
class Job:
    """One validated job.

    ``workflow`` is the resolved API-format workflow (this job's own deep copy, ``set``
    applied, each input's node input holding its placeholder); ``workflow_sha256``
    hashes its canonical JSON; ``prompt_id`` is the idempotency key sent to ComfyUI.
    ``line`` is the 1-based line in its file (or the position given by the queue).
    ``duration_s`` is expected seconds of video output. ``models`` are the sorted unique
    model file names the workflow loads (for affinity). ``inputs`` are the job's input
    files and inputs from other jobs, in the order of the job line; ``take`` (>= 1) is
    part of the prompt_id.
    """

    id: str
    line: int
    workflow: dict[str, Any] = field(compare=False, repr=False)
    workflow_sha256: str
    prompt_id: str
    set: dict[str, Any] = field(compare=False)
    shot: int | None = None
    duration_s: float | None = None
    optional: bool = False
    models: tuple[str, ...] = ()
    inputs: tuple[Input, ...] = ()
    take: int = 1

    @cached_property
    def depends_on(self) -> tuple[str, ...]:
        """The ids of the jobs this job takes inputs from: unique, sorted."""
        return tuple(sorted({i.job for i in self.inputs if isinstance(i, InputFromJob)}))


@dataclass(frozen=True)
class JobFile:
    """A loaded job file: ``sha256`` of its bytes, its header and its jobs in line order."""

    path: Path
    sha256: str
    header: Header
    jobs: list[Job]

    @property
    def policy(self) -> Policy:
        """The film policy: "delivery" (every shot required) or "draft"."""
        return self.header.policy


def is_job_id(text: str) -> bool:
    """True for a lowercase hyphenated UUID, the only form a job id takes."""
    return UUID_PATTERN.fullmatch(text) is not None


def canonical_json(obj: Any) -> str:
    """The JSON text that is hashed: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def prompt_id_for(job_id: str, workflow_sha256: str, take: int = 1) -> str:
    """The idempotency key of ``job_id`` with that resolved workflow and ``take``
    (lowercase UUID); take 1 keeps the key jobs had before takes existed."""
    if take == 1:
        return str(uuid.uuid5(NAMESPACE, f"{job_id}:{workflow_sha256}"))
    return str(uuid.uuid5(NAMESPACE, f"{job_id}:{workflow_sha256}:take={take}"))
