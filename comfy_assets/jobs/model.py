"""What a job file holds once validated: jobs, the header, and the errors of a bad file.

Each job gets an idempotency key: ``prompt_id = uuid5(NAMESPACE, f"{id}:{workflow_sha256}")``
where ``workflow_sha256`` hashes the canonical JSON of the resolved workflow. The same job
with the same inputs always gets the same prompt_id; any changed input gives a new one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# Fixed forever: changing it changes every prompt_id and so re-renders everything.
NAMESPACE = uuid.UUID("d20cb511-11c0-5807-a7e6-7f81477668c7")

Policy = Literal["delivery", "draft"]

POLICIES: tuple[str, ...] = ("delivery", "draft")

UUID_PATTERN = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class LineError:
    """One problem in a job file: ``path:line: field: message`` (line is 1-based)."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


class JobFileError(ValueError):
    """A job file (or a queued job) was rejected; ``errors`` lists every problem found.

    ``str()`` gives all of them, one ``path:line: field: message`` per line.
    """

    def __init__(self, errors: list[LineError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Header:
    """Film policy of a job file. ``duration_tolerance`` is a fraction (0.1 = 10 %)."""

    policy: Policy = "delivery"
    duration_tolerance: float = 0.1


@dataclass(frozen=True)
class Job:
    """One validated job.

    ``workflow`` is the resolved API-format workflow (this job's own deep copy, ``set``
    applied); ``workflow_sha256`` hashes its canonical JSON; ``prompt_id`` is the
    idempotency key sent to ComfyUI. ``line`` is the 1-based line in its file (or the
    position given by the queue). ``duration_s`` is expected seconds of video output.
    ``models`` are the sorted unique model file names the workflow loads (for affinity).
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


def prompt_id_for(job_id: str, workflow_sha256: str) -> str:
    """The idempotency key of ``job_id`` with that resolved workflow (lowercase UUID)."""
    return str(uuid.uuid5(NAMESPACE, f"{job_id}:{workflow_sha256}"))
