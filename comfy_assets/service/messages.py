"""Queue messages: one self-contained job each, as JSON.

``comfy-assets enqueue`` writes, per job of a validated job file::

    {"id": "<job id>", "workflow": {...the resolved API-format workflow...},
     "set": {...}, "shot": 3, "duration_s": 4.0, "optional": true, "policy": "draft",
     "partition": "storyboard", "line": 4, "take": 2, "priority": 10,
     "inputs": {"10.image": {"path": "keyframes/sh010.png", "sha256": "<hex>",
                             "size": 52311, "base64": "<the file's bytes>"}}}

(``shot``, ``duration_s`` and ``optional`` only when the job line has them, ``take``
when it is not 1, ``priority`` when it is not 0 (``enqueue --priority N``, else the
header's), ``inputs`` when the job has input files; ``policy``
is the job file's header policy; ``partition`` the file's partition, its stem unless
``enqueue --partition`` says otherwise; ``line`` the job's line in its file, so the
worker's results.csv lists the jobs in file order, as ``run``'s does.) The workflow is inline with ``set`` already applied,
and ``set`` is kept (for the results table); applying it again changes nothing, so a
worker on any host, in any folder, posts exactly the prompt that was validated, under
the prompt_id ``comfy-assets run`` computes for that job line.

Input files travel inline, their bytes in base64 beside their path (as written in the
job line, for names and the results table), sha256 and size. Inline, not a reference (a
URL, a path on a shared disk, an object store key), because a reference makes the worker
depend on reaching and being allowed to read a place the submitter chose, and the bytes
there can change or vanish between enqueue and render: the worker would have to check
them against a hash anyway, and could only dead-letter what changed. Inline bytes are
there whenever the message is, on any host, with no credentials and no other service.
The worker decodes them and recomputes their sha256: bytes that do not match it (a
truncated or hand-edited body, a bad encoder) or that are not base64 are refused, so the
bytes rendered are the bytes the prompt_id names (each input's sha256 is part of the
resolved workflow, and so of the prompt_id). The hash checks integrity, not authorship:
whoever may publish to the queue may already send any workflow. The price is size: base64
takes 4 bytes per 3, and a message is at most ``--max-message-bytes`` (4 MiB), so a job's
inputs fit in about 3 MiB; a job whose inputs do not is refused at enqueue with its file,
line and input (``queue_problems``): ``comfy-assets run`` and Dagster read inputs from
disk, with no such limit. A job taking an input from another job is refused at enqueue
too: a worker renders one message alone, and the upstream job's output is on whichever
server rendered it.

A message written by hand or by another program may name its workflow by a path. The
path is resolved only inside the worker's ``--workflows-dir``: an absolute path, a
``..`` that leads out, or a link that leads out is refused before anything is opened.
Inputs are inline only: a message naming an input by a path is refused. A body over
``max_bytes`` is refused before it is parsed. All are ``JobFileError``\\ s,
which the worker dead-letters with the error as the reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from comfy_assets.jobs import model
from comfy_assets.jobs.inputs import path_problem
from comfy_assets.jobs.model import (
    InputFile,
    Job,
    JobFile,
    JobFileError,
    LineError,
    Policy,
    policy_problem,
    priority_problem,
)
from comfy_assets.jobs.parse import job_from_dict
from comfy_assets.jobs.strict_json import loads_bounded, text_problems
from comfy_assets.store.base import folder_name

# A job with its workflow inline is a few KiB; a workflow with embedded data (a base64
# image input) can reach a few MiB. RabbitMQ itself accepts up to 16 MiB (4.x default).
MAX_MESSAGE_BYTES = 4 * 1024**2
WORKFLOWS_DIR = "--workflows-dir"
CHAINED = "chained inputs need `comfy-assets run` or Dagster: a worker renders one message alone"
INLINE_FIELDS = ("path", "sha256", "size", "base64")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class QueuedJob:
    """A validated message: its ``job``, the ``policy`` it was enqueued with (the job
    file's header policy) and its file's ``partition``, each None when the message names
    none; ``priority`` the one it was enqueued with (0 when none)."""

    job: Job
    policy: Policy | None = None
    partition: str | None = None
    priority: int = 0  # its batch's priority (``pool/priority.py``)


def job_message(job: Job, policy: Policy | None = None, partition: str | None = None) -> bytes:
    """The message body of ``job`` (see the module docstring): UTF-8 JSON, ASCII only,
    so any string round-trips. Reads each input file (``InputFile.read``: raises
    ``InputChanged`` when its bytes changed since validation, ``OSError``); raises
    ``ValueError`` for a job taking an input from another job (``queue_problems``
    reports those as errors of their line)."""
    return _body(job, policy, partition, lambda item: _base64(item.read()))


def message_size(job: Job, policy: Policy | None = None, partition: str | None = None) -> int:
    """The size in bytes of ``job_message(job, policy, partition)``, without reading
    any input file (base64 is 4 ASCII bytes per 3 bytes, rounded up)."""
    blank = _body(job, policy, partition, lambda item: "")
    files = [i for i in job.inputs if isinstance(i, InputFile)]  # chained ones are refused
    return len(blank) + sum(_base64_size(i.size) for i in files)


def file_messages(
    job_file: JobFile, partition: str | None = None, priority: int | None = None
) -> list[tuple[str, bytes]]:
    """``(job_id, body)`` of every job of a loaded job file, in file order, under
    ``partition`` (default: the file's stem, as ``comfy-assets run`` names it). Each
    input file is read and encoded once, however many jobs share it, but every body holds
    its own copy: the list takes about 4/3 of the bytes of every job's inputs (1,000 jobs
    sharing a 1 MiB picture: 1.3 GiB). ``priority``: the jobs' (None: the header's).
    Raises as ``job_message`` does. A file too big to hold: ``service/queue_file.py``."""
    name = partition or job_file.path.stem
    rank = job_file.header.priority if priority is None else priority
    return job_bodies(job_file.jobs, job_file.policy, name, rank)


def job_bodies(
    jobs: Iterable[Job], policy: Policy | None, partition: str | None, priority: int
) -> list[tuple[str, bytes]]:
    """``(job_id, body)`` of each of ``jobs``, in order, each input file read and encoded
    once for them all. Raises as ``job_message`` does."""
    encoded: dict[str, str] = {}

    def encode(item: InputFile) -> str:
        text = encoded.get(item.sha256)
        if text is None:
            text = encoded[item.sha256] = _base64(item.read())
        return text

    return [(job.id, _body(job, policy, partition, encode, priority)) for job in jobs]


def chained_problems(job_file: JobFile) -> list[LineError]:
    """Each input of ``job_file`` taken from another job, as an error of its line and
    field: a worker renders one job at a time, alone, so it cannot wait for another."""
    where = str(job_file.path)
    return [
        LineError(where, job.line, f"inputs.{item.key}", CHAINED)
        for job in job_file.jobs
        for item in job.inputs
        if isinstance(item, model.InputFromJob)
    ]


def queue_problems(
    job_file: JobFile, max_bytes: int, partition: str | None = None
) -> list[LineError]:
    """Why jobs of ``job_file`` cannot be queue messages, on their lines: each input
    taken from another job (field ``inputs.<key>``), and each message over ``max_bytes``
    bytes (``size_problems``). No input file is read."""
    where = str(job_file.path)
    name = partition or job_file.path.stem
    errors = chained_problems(job_file)
    jobs = (job for job in job_file.jobs if not job.depends_on)
    return errors + size_problems(where, jobs, job_file.policy, name, max_bytes)


def size_problems(
    where: str,
    jobs: Iterable[Job],
    policy: Policy | None,
    partition: str | None,
    max_bytes: int,
) -> list[LineError]:
    """Each job of ``jobs`` (of the file ``where``) whose message would be over
    ``max_bytes`` bytes, on its line: field ``message``, or ``inputs.<key>`` for each
    input file when the message would fit without them. Sizes come from
    ``message_size``: no input file is read. Jobs taking an input from another job are
    not for this (``chained_problems``)."""
    errors: list[LineError] = []
    for job in jobs:
        size = message_size(job, policy, partition)
        if size <= max_bytes:
            continue
        files = [i for i in job.inputs if isinstance(i, InputFile)]
        without = size - sum(_base64_size(i.size) for i in files)
        if without > max_bytes or not files:
            errors.append(
                LineError(
                    where,
                    job.line,
                    "message",
                    f"{size} bytes with its workflow inline, over the limit of {max_bytes} "
                    "bytes (--max-message-bytes): a worker would refuse it",
                )
            )
            continue
        for item in files:
            errors.append(
                LineError(
                    where,
                    job.line,
                    f"inputs.{item.key}",
                    f"{item.path} ({item.size} bytes, {_base64_size(item.size)} in base64) "
                    f"makes this job's message {size} bytes, over the limit of {max_bytes} "
                    "bytes (--max-message-bytes): a worker would refuse it; "
                    "`comfy-assets run` and Dagster read input files from disk",
                )
            )
    return errors


def _body(
    job: Job,
    policy: Policy | None,
    partition: str | None,
    encode: Callable[[InputFile], str],
    priority: int = 0,
) -> bytes:
    obj: dict[str, Any] = {"id": job.id, "workflow": job.workflow, "set": job.set}
    if priority:
        obj["priority"] = priority
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
    if job.take != 1:
        obj["take"] = job.take
    if job.inputs:
        inputs: dict[str, Any] = {}
        for item in job.inputs:
            if isinstance(item, model.InputFromJob):
                raise ValueError(f"job {job.id} input {item.key}: {CHAINED}")
            inputs[item.key] = {
                "path": item.path,
                "sha256": item.sha256,
                "size": item.size,
                "base64": encode(item),
            }
        obj["inputs"] = inputs
    return json.dumps(obj, separators=(",", ":")).encode()


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _base64_size(size: int) -> int:
    return 4 * ((size + 2) // 3)


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
    opened; a ``policy`` that is not "delivery" or "draft"; a NUL or a lone surrogate
    anywhere, a control character in a key: ``strict_json.text_problems``, found before
    anything else is checked).
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
    priority = 0
    line = 1
    errors: list[LineError] = []
    if isinstance(obj, dict):
        # Before the inline inputs become InputFiles: their paths are checked too.
        untakeable = text_problems(obj)
        if untakeable:
            raise JobFileError([LineError(source, 1, name, text) for name, text in untakeable])
        obj = dict(obj)
        partition = _envelope(obj, "partition", _partition_problem, source, errors, partition)
        priority = _envelope(obj, "priority", priority_problem, source, errors, priority)
        line = _envelope(obj, "line", _line_problem, source, errors, line)
        spec = obj.get("workflow")
        if isinstance(spec, str) and spec:
            problem = outside_problem(workflows_dir, spec)
            if problem is not None:
                # Nothing else is checked: the rest could only be read with the file.
                message = f"{json.dumps(spec)} is outside {WORKFLOWS_DIR} ({problem}); not opened"
                raise JobFileError([LineError(source, 1, "workflow", message)])
        if isinstance(obj.get("inputs"), dict):
            obj["inputs"] = _inline_inputs(obj["inputs"], source, errors)
        policy = _envelope(obj, "policy", policy_problem, source, errors, policy)
    try:
        job = job_from_dict(obj, base_dir=workflows_dir, source=source, line=line)
    except JobFileError as e:
        raise JobFileError([*e.errors, *errors]) from None
    if errors:
        raise JobFileError(errors)
    return QueuedJob(job, policy, partition, priority)


def _envelope(
    obj: dict[str, Any],
    name: str,
    problem_of: Callable[[Any], str | None],
    source: str,
    errors: list[LineError],
    default: Any,
) -> Any:
    """Take field ``name`` of a message's envelope out of ``obj``: its value when
    ``problem_of`` finds nothing wrong with it, else ``default`` with the problem added to
    ``errors`` (absent: ``default``)."""
    if name not in obj:
        return default
    given = obj.pop(name)
    problem = problem_of(given)
    if problem is None:
        return given
    errors.append(LineError(source, 1, name, problem))
    return default


def _partition_problem(value: Any) -> str | None:
    try:
        folder_name(value, "partition")
    except ValueError as e:
        return str(e)
    return None


def _line_problem(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return f"expected an integer >= 1, got {json.dumps(value)[:80]}"


def _inline_inputs(given: dict[str, Any], source: str, errors: list[LineError]) -> dict[str, Any]:
    """``inputs`` of a message with each inline file decoded and checked (an
    ``InputFile`` holding its bytes, for ``job_from_dict``); the problems of the others
    appended to ``errors`` (field ``inputs.<key>``), and those left out."""
    found: dict[str, Any] = {}
    for key, value in given.items():
        name = f"inputs.{key}"
        if isinstance(value, dict) and "job" in value and "base64" not in value:
            errors.append(LineError(source, 1, name, CHAINED))
            continue
        if not isinstance(value, dict):
            errors.append(
                LineError(
                    source,
                    1,
                    name,
                    "a queue message carries each input file inline "
                    '({"path", "sha256", "size", "base64"}), not a path to open',
                )
            )
            continue
        data = _inline_bytes(value)
        if isinstance(data, list):
            errors.extend(LineError(source, 1, name, problem) for problem in data)
            continue
        node_id, _, input_name = key.partition(".")
        found[key] = InputFile(
            key, node_id, input_name, value["path"], value["sha256"], value["size"], data=data
        )
    return found


def _inline_bytes(value: dict[str, Any]) -> bytes | list[str]:
    """The bytes of one inline input file, checked against its ``size`` and
    ``sha256``, or the list of what is wrong with it."""
    problems = [
        f"unknown field {json.dumps(k)[:80]} of an inline input (known: {', '.join(INLINE_FIELDS)})"
        for k in value
        if k not in INLINE_FIELDS
    ]
    problems += [f"no {k!r} in the inline input" for k in INLINE_FIELDS if k not in value]
    if problems:
        return problems
    path, sha, size, text = (value[k] for k in INLINE_FIELDS)
    if not isinstance(path, str):
        problems.append(f"'path': expected a string, got {json.dumps(path)[:80]}")
    else:
        problem = path_problem(path)
        if problem is not None:
            problems.append(f"'path': {problem}")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        problems.append(f"'sha256': expected 64 lowercase hex digits, got {json.dumps(sha)[:80]}")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        problems.append(f"'size': expected an integer >= 0, got {json.dumps(size)[:80]}")
    if not isinstance(text, str):
        problems.append(f"'base64': expected a string, got {json.dumps(text)[:80]}")
        return problems
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        problems.append(f"'base64': not base64: {e}")
        return problems
    if isinstance(size, int) and len(data) != size:
        problems.append(f"{len(data)} bytes once decoded, not the 'size' of {size}")
    digest = hashlib.sha256(data).hexdigest()
    if isinstance(sha, str) and digest != sha:
        problems.append(
            f"the bytes do not match their sha256: they hash to {digest}, "
            f"the message says {sha[:80]}; refused"
        )
    return problems or data
