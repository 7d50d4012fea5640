"""A job's input files put on the server its prompt runs on, just before the POST.

A job line's ``inputs`` (a file beside the job file, or a file an earlier job of the file
wrote) stand in the job's workflow as content-derived placeholders (``jobs/model.py``).
Before the POST each one is uploaded with ``POST /upload/image`` to the server that holds
the slot (every server has its own input folder: data/recorded/README.md, fact 12), under
``comfy_assets/<sha256><suffix>``, once per server (``comfy/uploads.py``), and the prompt
names it the way the server answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, BinaryIO

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import ComfyError
from comfy_assets.comfy.uploads import Uploads
from comfy_assets.jobs.model import INPUT_SUBFOLDER, InputFile, InputFromJob, Job

_SUFFIX = re.compile(r"\.[a-z0-9]{1,8}")


class InputProblem(Exception):
    """An input that cannot be put on any server (its file changed or vanished since the
    job file was read, an upstream job wrote no such file): the job's failure is
    permanent. ``str()`` is the reason, naming the job line's input."""


class UploadFailed(Exception):
    """``POST /upload/image`` of one input failed: ``error`` (a ComfyError) says how, and
    so whether another attempt may succeed; ``label`` names the job line's input."""

    def __init__(self, label: str, error: ComfyError) -> None:
        super().__init__(f"{label}: {error}")
        self.label = label
        self.error = error


@dataclass(frozen=True)
class UpstreamFile:
    """A file an upstream job wrote, in the store's files: ``name`` for people (its
    path, or its location), its done record's ``sha256`` (hex) and ``size`` (bytes), and
    ``open``, which opens it for reading (raises OSError: FileNotFoundError when it is
    gone)."""

    name: str
    sha256: str
    size: int
    open: Callable[[], BinaryIO]

    def read(self) -> bytes:
        """Its bytes, at most one past its recorded size (more means it changed).
        Raises OSError."""
        with self.open() as f:
            return f.read(self.size + 1)


Locate = Callable[[InputFromJob], Awaitable[UpstreamFile]]


@dataclass
class Staged:
    """A job's inputs on one server: the ``workflow`` to post (placeholders replaced by
    the names the server answered), ``names`` (input key → that name) and ``fresh`` (keys
    uploaded by this call rather than known to be there)."""

    workflow: dict[str, Any]
    names: dict[str, str] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)


def input_label(inp: InputFile | InputFromJob) -> str:
    """How a reason names an input of the job line: ``input 10.image (keyframes/a.png)``
    or ``input 12.file (job 1a2b3c4d, node 9, file 0)``."""
    if isinstance(inp, InputFile):
        return f"input {inp.key} ({inp.path})"
    return f"input {inp.key} (job {inp.job}, node {inp.node}, file {inp.index})"


def inputs_of_nodes(job: Job, node_ids: Sequence[str]) -> str:
    """The labels of the job's inputs that feed any of ``node_ids``, joined for a reason
    ("" when none does)."""
    wanted = set(node_ids)
    return ", ".join(input_label(i) for i in job.inputs if i.node_id in wanted)


def upload_name(sha256: str, path: str) -> str:
    """The content-derived file name of bytes with ``sha256`` read from ``path``: the
    hash and the path's extension (lowercase, when it is a plain one)."""
    suffix = PurePosixPath(path).suffix.lower()
    return sha256 + (suffix if _SUFFIX.fullmatch(suffix) else "")


async def stage(
    job: Job, client: ComfyClient, server: str, uploads: Uploads, locate: Locate
) -> Staged:
    """Put every input of ``job`` on ``server`` and return the workflow to post there.

    Raises InputProblem (permanent: the reason names the input), UploadFailed (the
    upload's ComfyError decides), OSError of our disk only through InputProblem.
    """
    staged = Staged(workflow=job.workflow)
    if not job.inputs:
        return staged
    workflow = dict(job.workflow)
    for inp in job.inputs:
        label = input_label(inp)
        filename, read = await _source(inp, label, locate)
        try:
            name, fresh = await uploads.ensure(client, server, INPUT_SUBFOLDER, filename, read)
        except ComfyError as e:
            raise UploadFailed(label, e) from e
        node = dict(workflow[inp.node_id])
        node["inputs"] = {**node["inputs"], inp.input_name: name}
        workflow[inp.node_id] = node
        staged.names[inp.key] = name
        if fresh:
            staged.fresh.add(inp.key)
    staged.workflow = workflow
    return staged


async def _source(
    inp: InputFile | InputFromJob, label: str, locate: Locate
) -> tuple[str, Callable[[], Awaitable[bytes]]]:
    """(upload file name, reader of the bytes) of one input. Raises InputProblem."""
    if isinstance(inp, InputFile):

        async def read_file() -> bytes:
            try:
                return await asyncio.to_thread(inp.read)
            except (OSError, ValueError) as e:
                # ValueError: InputChanged, the bytes are no longer those validated.
                raise InputProblem(f"{label}: {_why(e)}; run the job file again") from e

        return inp.upload_name, read_file
    try:
        found = await locate(inp)
    except LookupError as e:
        raise InputProblem(f"{label}: {e}") from e

    async def read_upstream() -> bytes:
        try:
            data = await asyncio.to_thread(found.read)
        except OSError as e:
            raise InputProblem(f"{label}: cannot read {found.name}: {_why(e)}") from e
        if hashlib.sha256(data).hexdigest() != found.sha256:
            raise InputProblem(
                f"{label}: {found.name} changed in the store since job {inp.job} recorded it"
            )
        return data

    return upload_name(found.sha256, PurePosixPath(found.name).name), read_upstream


def _why(e: BaseException) -> str:
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    return str(e)
