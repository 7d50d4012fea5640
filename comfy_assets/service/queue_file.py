"""A job file published to a queue without holding it (``comfy-assets enqueue``): validated
whole first, then its messages built a chunk at a time as they are published.

``scan_queue_file`` checks the file in the streaming pass of ``jobs/stream.py``
(``scan_job_file``: every error by file:line:field, as ``load_job_file`` gives them), then
reads its jobs again a chunk at a time for the queue's own checks (``size_problems``: a
message over ``--max-message-bytes``, found without reading an input file); a file with a
job taking an input from another job is loaded whole by the scan and refused by
``queue_problems``. Any problem raises before a message is built, so nothing is published
for a file with one. ``QueueFile.messages`` then reads the jobs a third time, a chunk at a
time, and yields their bodies: what is held is one chunk of jobs and bodies, whatever the
file's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import Job, JobFile, JobFileError, Policy
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.service.messages import (
    MAX_MESSAGE_BYTES,
    job_bodies,
    queue_problems,
    size_problems,
)

# Jobs built at a time: a few hundred kilobytes of bodies for small workflows. An input
# file shared by the jobs of a chunk is read and encoded once per chunk.
CHUNK = 1000


@dataclass(frozen=True)
class QueueFile:
    """A job file validated for the queue (``scan_queue_file``): ``source`` its scan (or
    the file loaded whole), ``partition`` and ``priority`` those its messages carry."""

    source: JobScan | JobFile
    partition: str
    priority: int

    @property
    def count(self) -> int:
        """How many jobs (so messages) the file has."""
        source = self.source
        return source.count if isinstance(source, JobScan) else len(source.jobs)

    @property
    def policy(self) -> Policy:
        """The file's header policy, which every message carries."""
        return self.source.policy

    def messages(self, chunk: int = CHUNK) -> Iterator[tuple[str, bytes]]:
        """``(job_id, body)`` per job, in file order (``messages.job_bodies``), built
        ``chunk`` jobs at a time as they are taken. Raises ``JobFileChanged`` (an
        ``OSError``) when a line is no longer the one validated, ``InputChanged`` when an
        input file's bytes changed, ``OSError`` when one cannot be read: the messages
        yielded before stay yielded."""
        for jobs in _chunks(self.source, chunk):
            yield from job_bodies(jobs, self.policy, self.partition, self.priority)


def scan_queue_file(
    path: Path,
    max_bytes: int = MAX_MESSAGE_BYTES,
    partition: str | None = None,
    *,
    rules: InputRules | None = None,
    priority: int | None = None,
) -> QueueFile:
    """Validate the job file at ``path`` for the queue (input files under ``rules``,
    default ``InputRules()``), holding no more than a chunk of its jobs: messages under
    ``partition`` (default: the file's stem, as ``run`` names it) with ``priority`` (None:
    the header's). Raises ``JobFileError`` listing every problem on its line and field:
    those of ``load_job_file``, then an input taken from another job and a message over
    ``max_bytes`` bytes (no input file read for these); ``JobFileChanged`` when the file
    changes between its passes."""
    path = Path(path)
    source = scan_job_file(path, rules=rules)
    name = partition or path.stem
    if isinstance(source, JobFile):
        problems = queue_problems(source, max_bytes, name)
    else:
        problems = []
        for jobs in _chunks(source, CHUNK):
            problems += size_problems(str(path), jobs, source.policy, name, max_bytes)
    if problems:
        raise JobFileError(problems)
    rank = source.header.priority if priority is None else priority
    return QueueFile(source, name, rank)


def _chunks(source: JobScan | JobFile, size: int) -> Iterator[list[Job]]:
    """The jobs of ``source`` in file order, ``size`` at a time."""
    if isinstance(source, JobFile):
        for start in range(0, len(source.jobs), size):
            yield source.jobs[start : start + size]
        return
    reader = source.reader()
    try:
        while jobs := reader.take(size):
            yield jobs
    finally:
        reader.close()
