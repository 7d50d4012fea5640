"""The values of a job line's ``inputs``: input files, read and hashed once per load, and
inputs from other jobs of the same file.

A file value is a path relative to the job file's folder. It is refused, with the reason,
when it is empty, absolute, holds a control character, a backslash or a ``..``
component, leads out of the job file's folder tree through a link (unless
``InputRules.follow_links``), is missing, is not a regular file, cannot be read, or is
larger than ``InputRules.max_input_bytes``. An upstream value is
``{"job": "<job id>", "node": "<node id>", "index": 0}`` (``index`` optional); whether the
job and its node exist is checked by the parser, which knows the whole file.

A value ``s3://BUCKET/KEY`` names an object of the store's object store, read with its
credentials (``InputRules.objects``, the store's ``FileStore``): refused when the store is
a folder or there is none, when the object is missing, cannot be read, or is larger than
``InputRules.max_input_bytes``. It is read and hashed once per load, like a file, and
read again at upload.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from comfy_assets.jobs.strict_json import CONTROL_CHARACTERS, kind_of, quoted

# Large enough for a 4K keyframe or a short clip, small enough that a typo naming a
# film file is caught before it is read and uploaded to every server.
MAX_INPUT_BYTES = 64 * 1024**2
# An index of the files one node wrote; the store keeps such numbers in 32 bits.
MAX_INDEX = 2**31 - 1
UPSTREAM_FIELDS = ("job", "node", "index")
_READ_CHUNK = 1024**2
# Dagster's names for the two rules (``farm.partitions.input_rules_from_env``); the commands'
# are ``--follow-input-links`` and ``--max-input-bytes`` (``cli.options``). A refusal
# names both, so whoever reads it finds the knob of the tool they ran.
FOLLOW_INPUT_LINKS_ENV = "COMFY_ASSETS_FOLLOW_INPUT_LINKS"
MAX_INPUT_BYTES_ENV = "COMFY_ASSETS_MAX_INPUT_BYTES"


# How a job line names an object of the store's object store.
OBJECT_SCHEME = "s3://"


class ObjectSource(Protocol):
    """What reads the objects an input may name (the store's ``FileStore``)."""

    def open_object(self, url: str) -> BinaryIO:
        """A binary stream of the object at ``url`` (``s3://BUCKET/KEY``). Raises
        FileNotFoundError for no such object, ValueError (FileStoreRefused) for a URL
        this store does not read (a folder store reads none)."""
        ...


@dataclass(frozen=True)
class InputRules:
    """What input files may be. ``max_input_bytes``: the largest file accepted (bytes);
    ``follow_links``: a link leading out of the job file's folder tree is followed
    instead of refused; ``objects``: what reads ``s3://`` inputs (None: they are
    refused)."""

    max_input_bytes: int = MAX_INPUT_BYTES
    follow_links: bool = False
    objects: ObjectSource | None = field(default=None, compare=False)
    # Where nothing reads objects (a Dagster sensor's tick, which has no store): an
    # ``s3://`` input is taken by its form, not read (``ReadInput.unread``); the run that
    # renders the file reads it through its store, or fails naming file, line and field.
    objects_later: bool = False


DEFAULT_RULES = InputRules()


def rules_of(args: object, objects: ObjectSource | None = None) -> InputRules:
    """The rules an ``argparse`` namespace gives with ``cli.options.add_input_options``;
    ``objects``: what reads ``s3://`` inputs (the store's files), if any."""
    return InputRules(
        max_input_bytes=int(getattr(args, "max_input_bytes", MAX_INPUT_BYTES)),
        follow_links=bool(getattr(args, "follow_input_links", False)),
        objects=objects,
    )


@dataclass(frozen=True)
class ReadInput:
    """An input read once: sha256 (hex) and size (bytes), and where its bytes are read
    again at upload: ``source``, the resolved absolute path of a file, or ``opener``,
    which opens an object of the store."""

    source: Path | None
    sha256: str
    size: int
    opener: Callable[[], BinaryIO] | None = field(default=None, compare=False)


def path_problem(spec: str) -> str | None:
    """Why the text of the input path ``spec`` is refused, or None. Looks at the text
    only (never the disk): empty, a control character, a backslash, absolute, ``..``."""
    if not spec:
        return "expected a file path relative to the job file, got an empty string"
    control = CONTROL_CHARACTERS.search(spec)
    if control is not None:
        # ASCII-only JSON: the character is shown escaped, never printed as is.
        shown = json.dumps(spec)[:80]
        return f"the path {shown} holds a control character (U+{ord(control[0]):04X})"
    if "\\" in spec:
        return f"the path {quoted(spec)} holds a backslash; write '/' between folders"
    if spec.startswith("/"):
        return f"{quoted(spec)} is an absolute path; write it relative to the job file's folder"
    if ".." in spec.split("/"):
        return f"{quoted(spec)} has a '..' component; an input stays inside the job file's folder"
    return None


class InputReader:
    """The input files of one load, relative to ``base_dir`` (the job file's folder):
    each path checked once and each resolved file read and hashed once, however many
    jobs name it. Keep one only for one load: it never looks at a file again."""

    def __init__(self, base_dir: Path, rules: InputRules) -> None:
        self.base_dir = base_dir
        self.rules = rules
        self._root: str | None = None
        self._by_spec: dict[str, ReadInput | str] = {}
        self._by_target: dict[str, ReadInput | str] = {}

    def get(self, spec: Any) -> ReadInput | str:
        """The file ``spec`` names, read and hashed, or why it is refused."""
        if not isinstance(spec, str):
            return (
                "expected a file path relative to the job file or "
                f'{{"job": "<job id>", "node": "<node id>"}}, got {kind_of(spec)}'
            )
        found = self._by_spec.get(spec)
        if found is None:
            found = self._by_spec[spec] = self._get(spec)
        return found

    def _get(self, spec: str) -> ReadInput | str:
        if spec.startswith(OBJECT_SCHEME):
            return self._object(spec)
        problem = path_problem(spec)
        if problem is not None:
            return problem
        if self._root is None:
            self._root = os.path.realpath(self.base_dir)
        root = self._root
        # No '..' and not absolute: only a link can lead out, and realpath follows them all.
        target = os.path.realpath(os.path.join(root, spec))
        if not self.rules.follow_links and os.path.commonpath([root, target]) != root:
            return (
                f"{quoted(spec)} is a link that leads out of the job file's folder "
                f"(to {target}); refused unless links may be followed (--follow-input-links, or "
                f"{FOLLOW_INPUT_LINKS_ENV}=1 in Dagster)"
            )
        found = self._by_target.get(target)
        if found is None:
            found = self._by_target[target] = self._read(target)
        if isinstance(found, str):
            return f"{quoted(spec)}: {found}"
        return found

    def _read(self, target: str) -> ReadInput | str:
        """Open ``target`` once: fstat on the open file (no race between a check and the
        read), O_NONBLOCK so that a FIFO is refused instead of waited on."""
        limit = self.rules.max_input_bytes
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return f"no such file ({target})"
        except OSError as e:
            return f"cannot read it: {e.strerror} ({target})"
        digest = hashlib.sha256()
        size = 0
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = "a folder" if stat.S_ISDIR(mode) else "a special file"
                return f"{kind}, not a regular file ({target})"
            # At most one byte over the limit: a file that grows is not read whole.
            while chunk := os.read(fd, min(_READ_CHUNK, limit + 1 - size)):
                digest.update(chunk)
                size += len(chunk)
                if size > limit:
                    break
        except OSError as e:
            return f"cannot read it: {e.strerror} ({target})"
        finally:
            os.close(fd)
        if size > limit:
            return (
                f"over the limit of {limit} bytes (--max-input-bytes, or {MAX_INPUT_BYTES_ENV} "
                f"in Dagster) ({target})"
            )
        return ReadInput(Path(target), digest.hexdigest(), size)

    def _object(self, url: str) -> ReadInput | str:
        """The object ``url`` names, read and hashed through ``rules.objects``, or why
        it is refused."""
        control = CONTROL_CHARACTERS.search(url)
        if control is not None:
            return f"the URL {json.dumps(url)[:80]} holds a control character"
        objects = self.rules.objects
        if objects is None and self.rules.objects_later:
            return _unread(url)
        if objects is None:
            return (
                f"{quoted(url)}: s3:// inputs are read only with an S3 store (--store "
                "s3://BUCKET/PREFIX), and there is none here"
            )
        limit = self.rules.max_input_bytes
        digest = hashlib.sha256()
        size = 0
        try:
            with objects.open_object(url) as f:
                # At most one byte over the limit: an object that is too big is not read whole.
                while chunk := f.read(min(_READ_CHUNK, limit + 1 - size)):
                    digest.update(chunk)
                    size += len(chunk)
                    if size > limit:
                        break
        except FileNotFoundError:
            return f"{quoted(url)}: no such object"
        except ValueError as e:  # the store reads no such URL (FileStoreRefused)
            return f"{quoted(url)}: {e}"
        except OSError as e:
            return f"{quoted(url)}: cannot read it: {e.strerror or e}"
        if size > limit:
            return (
                f"{quoted(url)}: over the limit of {limit} bytes (--max-input-bytes, or "
                f"{MAX_INPUT_BYTES_ENV} in Dagster)"
            )
        return ReadInput(None, digest.hexdigest(), size, opener=partial(objects.open_object, url))


def _unread(url: str) -> ReadInput | str:
    """An ``s3://BUCKET/KEY`` input taken by its form (``InputRules.objects_later``): its
    sha256 is the URL's, its size 0; refused when it names no key."""
    bucket, _, key = url[len(OBJECT_SCHEME) :].partition("/")
    if not bucket or not key or any(part in ("", ".", "..") for part in key.split("/")):
        return f"{quoted(url)}: not an object's URL (s3://BUCKET/KEY)"
    return ReadInput(None, hashlib.sha256(url.encode()).hexdigest(), 0)


def parse_upstream(value: dict[str, Any]) -> tuple[str, str, int] | list[str]:
    """``(job, node, index)`` of an upstream value ``{"job", "node", "index"?}``, or the
    list of its problems (unknown keys, a job or node that is not a non-empty string, an
    index that is not an integer from 0 to ``MAX_INDEX``)."""
    problems = [
        f"unknown field {quoted(k)} of an input from another job (known: job, node, index)"
        for k in value
        if k not in UPSTREAM_FIELDS
    ]
    job = value.get("job")
    if not isinstance(job, str) or not job:
        problems.append(f"expected a job id of this file in 'job', got {quoted(job)}")
    node = value.get("node")
    if not isinstance(node, str) or not node:
        problems.append(f"expected a node id (a string) in 'node', got {quoted(node)}")
    index = value.get("index", 0)
    if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index <= MAX_INDEX):
        problems.append(
            f"expected an integer from 0 to {MAX_INDEX} in 'index', got {quoted(index)}"
        )
    if problems or not isinstance(job, str) or not isinstance(node, str):
        return problems
    return job, node, index
