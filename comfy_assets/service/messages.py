"""Queue messages: one self-contained job each, as JSON.

``comfy-assets enqueue`` writes, per job of a validated job file::

    {"id": "<job id>", "workflow": {...the resolved API-format workflow...},
     "set": {...}, "shot": 3, "duration_s": 4.0, "optional": true, "policy": "draft",
     "partition": "storyboard", "line": 4}

(``shot``, ``duration_s`` and ``optional`` only when the job line has them; ``policy``
is the job file's header policy; ``partition`` the file's partition, its stem unless
``enqueue --partition`` says otherwise; ``line`` the job's line in its file, so the
worker's results.csv lists the jobs in file order, as ``run``'s does.) The workflow is inline with ``set`` already applied,
and ``set`` is kept (for the results table); applying it again changes nothing, so a
worker on any host, in any folder, posts exactly the prompt that was validated, under
the prompt_id ``comfy-assets run`` computes for that job line.

A message written by hand or by another program may name its workflow by a path. The
path is resolved only inside the worker's ``--workflows-dir``: an absolute path, a
``..`` that leads out, or a link that leads out is refused before anything is opened.
A body over ``max_bytes`` is refused before it is parsed. Both are ``JobFileError``\\ s,
which the worker dead-letters with the error as the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from comfy_assets.jobs.model import POLICIES, Job, JobFile, JobFileError, LineError, Policy
from comfy_assets.jobs.parse import job_from_dict
from comfy_assets.jobs.strict_json import loads_bounded
from comfy_assets.store.base import folder_name

# A job with its workflow inline is a few KiB; a workflow with embedded data (a base64
# image input) can reach a few MiB. RabbitMQ itself accepts up to 16 MiB (4.x default).
MAX_MESSAGE_BYTES = 4 * 1024**2
WORKFLOWS_DIR = "--workflows-dir"


@dataclass(frozen=True)
class QueuedJob:
    """A validated message: its ``job``, the ``policy`` it was enqueued with (the job
    file's header policy) and its file's ``partition``, each None when the message names
    none."""

    job: Job
    policy: Policy | None = None
    partition: str | None = None


def job_message(job: Job, policy: Policy | None = None, partition: str | None = None) -> bytes:
    """The message body of ``job`` (see the module docstring): UTF-8 JSON, ASCII only,
    so any string round-trips."""
    obj: dict[str, Any] = {"id": job.id, "workflow": job.workflow, "set": job.set}
    obj["line"] = job.line
    if partition is not None:
        obj["partition"] = partition
    if job.shot is not None:
        obj["shot"] = job.shot
    if job.duration_s is not None:
        obj["duration_s"] = job.duration_s
    if job.optional:
        obj["optional"] = True
    if policy is not None:
        obj["policy"] = policy
    return json.dumps(obj, separators=(",", ":")).encode()


def file_messages(job_file: JobFile, partition: str | None = None) -> list[tuple[str, bytes]]:
    """``(job_id, body)`` of every job of a loaded job file, in file order, under
    ``partition`` (default: the file's stem, as ``comfy-assets run`` names it)."""
    name = partition or job_file.path.stem
    return [(job.id, job_message(job, job_file.policy, name)) for job in job_file.jobs]


def oversized(
    job_file: JobFile, messages: list[tuple[str, bytes]], max_bytes: int
) -> list[LineError]:
    """One error per message of ``job_file`` over ``max_bytes`` bytes, on its job's line."""
    where = str(job_file.path)
    return [
        LineError(
            where,
            job.line,
            "message",
            f"{len(body)} bytes with its workflow inline, over the limit of {max_bytes} "
            "bytes (--max-message-bytes): a worker would refuse it",
        )
        for job, (_, body) in zip(job_file.jobs, messages, strict=True)
        if len(body) > max_bytes
    ]


def outside_problem(workflows_dir: Path, spec: str) -> str | None:
    """Why the workflow path ``spec`` is not inside ``workflows_dir``, or None when it
    is. Looks at the text and at links (``os.path.realpath``: lstat and readlink),
    never opens a file."""
    if PurePath(spec).is_absolute() or spec.startswith(("/", "\\")):
        return "an absolute path"
    depth = 0
    for part in spec.replace("\\", "/").split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return "'..' leads out of it"
        elif part not in ("", "."):
            depth += 1
    if "\x00" in spec:
        return None  # no file has that name: reading it fails, and says so
    base = os.path.realpath(workflows_dir)
    target = os.path.realpath(os.path.join(base, spec))
    if os.path.commonpath([base, target]) != base:
        return "a link leads out of it"
    return None


def parse_message(
    body: bytes,
    *,
    workflows_dir: Path,
    source: str,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> QueuedJob:
    """Validate one message body: a job (see the module docstring) as UTF-8 JSON.

    An inline workflow is used as is; a ``workflow`` path is resolved inside
    ``workflows_dir`` only. ``source`` names the message in errors. Raises
    ``JobFileError`` listing every problem (the checks of a job file's line, plus: a
    body over ``max_bytes`` bytes, not parsed; a path outside ``workflows_dir``, not
    opened; a ``policy`` that is not "delivery" or "draft").
    """
    if len(body) > max_bytes:
        raise JobFileError(
            [
                LineError(
                    source,
                    1,
                    "body",
                    f"{len(body)} bytes, over the limit of {max_bytes} bytes "
                    "(--max-message-bytes); not parsed",
                )
            ]
        )
    try:
        obj = loads_bounded(json.loads, body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JobFileError([LineError(source, 1, "body", f"not UTF-8: {e.reason}")]) from e
    except json.JSONDecodeError as e:
        raise JobFileError(
            [LineError(source, 1, "json", f"not JSON: {e.msg} at column {e.colno}")]
        ) from e
    except ValueError as e:  # an integer of more than 4300 digits, TooDeep
        raise JobFileError([LineError(source, 1, "json", f"not usable JSON: {e}")]) from e
    policy: Policy | None = None
    partition: str | None = None
    line = 1
    errors: list[LineError] = []
    if isinstance(obj, dict):
        obj = dict(obj)
        if "partition" in obj:
            given = obj.pop("partition")
            try:
                partition = folder_name(given, "partition")
            except ValueError as e:
                errors.append(LineError(source, 1, "partition", str(e)))
        if "line" in obj:
            given = obj.pop("line")
            if isinstance(given, int) and not isinstance(given, bool) and given >= 1:
                line = given
            else:
                errors.append(
                    LineError(
                        source, 1, "line", f"expected an integer >= 1, got {json.dumps(given)[:80]}"
                    )
                )
        spec = obj.get("workflow")
        if isinstance(spec, str) and spec:
            problem = outside_problem(workflows_dir, spec)
            if problem is not None:
                # Nothing else is checked: the rest could only be read with the file.
                message = f"{json.dumps(spec)} is outside {WORKFLOWS_DIR} ({problem}); not opened"
                raise JobFileError([LineError(source, 1, "workflow", message)])
        if "policy" in obj:
            given = obj.pop("policy")
            if given in POLICIES:
                policy = given
            else:
                shown = json.dumps(given, default=repr)[:80]
                errors.append(
                    LineError(source, 1, "policy", f'expected "delivery" or "draft", got {shown}')
                )
    try:
        job = job_from_dict(obj, base_dir=workflows_dir, source=source, line=line)
    except JobFileError as e:
        raise JobFileError([*e.errors, *errors]) from None
    if errors:
        raise JobFileError(errors)
    return QueuedJob(job, policy, partition)
