"""A job file published to a queue without holding it (``comfy-assets enqueue``): validated
whole first, then its messages built a chunk at a time as they are published.

``scan_queue_file`` checks the file in the streaming pass of ``jobs/stream.py``
(``scan_job_file``: every error by file:line:field, as ``load_job_file`` gives them), then
the queue's own check, a message over ``--max-message-bytes``: when no message of the file
can be that big (``size_bound``, from its longest line and workflow) nothing more is read;
otherwise its jobs are read again a chunk at a time and each message's size is computed
(``size_problems``, without reading an input file). A file with a job taking an input from
another job is loaded whole by the scan and refused by ``queue_problems``. Any problem
raises before a message is built, so nothing is published for a file with one.
``QueueFile.messages`` then reads the jobs again, a chunk at a time, and yields their
bodies: what is held is the scan's arrays (about 40 bytes a job) and one chunk of jobs and
bodies.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from comfy_assets.jobs.inputs import InputRules
from comfy_assets.jobs.model import Job, JobFile, JobFileError, Policy
from comfy_assets.jobs.stream import JobScan, scan_job_file
from comfy_assets.jobs.workflows import WorkflowCache
from comfy_assets.service.messages import (
    MAX_MESSAGE_BYTES,
    job_bodies,
    queue_problems,
    size_problems,
)

# Jobs built at a time: a few hundred kilobytes of bodies for small workflows. An input
# file shared by the jobs of a chunk is read and encoded once per chunk.
CHUNK = 1000
# Bytes of a message besides its values (field names, quotes, braces, commas; the line
# and priority numbers, the policy), more than they take.
ENVELOPE = 512
# Bytes a value of a job line may take in its message per byte it takes in the line, and
# times it is written there: json.dumps writes a non-ASCII character as \uXXXX (6 bytes
# for 1 to 3 of UTF-8, 12 for 4) and a float such as 1e15 as 1000000000000000.0 (18 for
# 4); a ``set`` value is written in ``set`` and again in the workflow it changes.
PER_LINE_BYTE = 6
WRITTEN = 2


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
    workflows = WorkflowCache()
    source = scan_job_file(path, workflows, rules=rules)
    name = partition or path.stem
    if isinstance(source, JobFile):
        problems = queue_problems(source, max_bytes, name)
    elif source.input_files or size_bound(source, workflows, name) > max_bytes:
        problems = []
        for jobs in _chunks(source, CHUNK):
            problems += size_problems(str(path), jobs, source.policy, name, max_bytes)
    else:
        problems = []
    if problems:
        raise JobFileError(problems)
    rank = source.header.priority if priority is None else priority
    return QueueFile(source, name, rank)


def size_bound(scan: JobScan, workflows: WorkflowCache, partition: str) -> int:
    """Bytes no message of ``scan``'s jobs can exceed, under ``partition``, when its lines
    name no input file (whose bytes a message carries): the longest workflow read
    (``workflows``, which the scan read them into), plus each line's values written at
    most ``WRITTEN`` times, ``PER_LINE_BYTE`` bytes for each byte of the longest line (a
    line's length from its offset to the next job's, so counting any blank line or
    header between them), plus the partition so written and ``ENVELOPE``."""
    import numpy as np  # here: the CLI imports this module for every command

    starts = np.frombuffer(scan.offsets, dtype=np.int64)
    ends = np.append(starts[1:], os.stat(scan.path).st_size)
    longest = int((ends - starts).max())
    values = longest + len(partition.encode())
    return workflows.longest_text() + WRITTEN * PER_LINE_BYTE * values + ENVELOPE


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
