"""Frozen dataclasses for what ComfyUI answers, parsed from its JSON.

Every shape here is taken from data/recorded/ (ComfyUI v0.8.0). The ``from_json``
constructors raise ``KeyError``, ``TypeError``, ``ValueError`` or ``IndexError`` on a body
that is not the recorded shape; ``client.py`` turns those into ``UnexpectedAnswer``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["success", "error", "interrupted"]

# ComfyUI's tip appended to an OOM exception message (README fact 9).
_OOM_TIP = "this error means you ran out of memory on your gpu"
_OOM_TYPES = frozenset({"torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"})


@dataclass(frozen=True)
class Device:
    """One device of /system_stats ``devices``; VRAM in bytes (basics.json)."""

    name: str
    type: str
    vram_total: int
    vram_free: int
    index: int | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Device:
        index = d.get("index")
        return cls(
            name=str(d["name"]),
            type=str(d["type"]),
            vram_total=int(d["vram_total"]),
            vram_free=int(d["vram_free"]),
            index=None if index is None else int(index),
        )

    @property
    def label(self) -> str:
        """Short name without spaces: ``cpu`` or ``cuda:0``."""
        return self.type if self.index is None else f"{self.type}:{self.index}"


@dataclass(frozen=True)
class SystemStats:
    """GET /system_stats: ``system.comfyui_version`` and the devices (basics.json)."""

    comfyui_version: str
    devices: tuple[Device, ...]

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SystemStats:
        return cls(
            comfyui_version=str(body["system"]["comfyui_version"]),
            devices=tuple(Device.from_json(d) for d in body["devices"]),
        )


@dataclass(frozen=True)
class QueueEntry:
    """One item of /queue: ``[number, prompt_id, prompt, extra_data, outputs]``;
    ``client_id`` comes from ``extra_data`` and is None for an anonymous prompt
    (interrupt_reconnect.json, broadcast_and_missed.json). ``outputs_to_execute``: the
    output node ids the server will run (those validation kept), None if not given."""

    number: int
    prompt_id: str
    client_id: str | None
    outputs_to_execute: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, item: list[Any]) -> QueueEntry:
        extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        client_id = extra.get("client_id")
        return cls(
            number=int(item[0]),
            prompt_id=str(item[1]),
            client_id=None if client_id is None else str(client_id),
            outputs_to_execute=_node_ids(item[4]) if len(item) > 4 else None,
        )


def _node_ids(value: Any) -> tuple[str, ...] | None:
    """A list of node ids (``outputs_to_execute``), or None for anything else."""
    if not isinstance(value, list):
        return None
    return tuple(str(v) for v in value)


@dataclass(frozen=True)
class QueueState:
    """GET /queue: the running entry (at most one per server) and the pending heap."""

    running: tuple[QueueEntry, ...]
    pending: tuple[QueueEntry, ...]

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> QueueState:
        return cls(
            running=tuple(QueueEntry.from_json(i) for i in body["queue_running"]),
            pending=tuple(QueueEntry.from_json(i) for i in body["queue_pending"]),
        )

    @property
    def length(self) -> int:
        """Running plus pending entries."""
        return len(self.running) + len(self.pending)

    def find(self, prompt_id: str, number: int | None = None) -> QueueEntry | None:
        """The entry with this prompt_id (and run number, when given), running first."""
        for entry in (*self.running, *self.pending):
            if entry.prompt_id == prompt_id and (number is None or entry.number == number):
                return entry
        return None

    def find_any(self, prompt_ids: Sequence[str]) -> QueueEntry | None:
        """The first entry, running first, whose prompt_id is one of ``prompt_ids``."""
        wanted = set(prompt_ids)
        return next((e for e in (*self.running, *self.pending) if e.prompt_id in wanted), None)

    def contains(self, prompt_id: str, number: int | None = None) -> bool:
        """True when the prompt (optionally that run number) is running or pending."""
        return self.find(prompt_id, number) is not None

    def is_running(self, prompt_id: str) -> bool:
        return any(e.prompt_id == prompt_id for e in self.running)


BODY_EXCERPT = 300  # characters of a server's text kept in an error message

# A NUL (PostgreSQL's text refuses it) and a lone UTF-16 surrogate (no UTF-8 encoding:
# no row, file or terminal line can hold it), as a server's JSON may send them.
_UNWRITABLE = re.compile(r"[\x00\ud800-\udfff]")


def excerpt(text: str, limit: int = BODY_EXCERPT) -> str:
    """The start of a server's text, or of a value quoted in a reason, on one line (runs
    of whitespace, newlines among them, as one space), at most ``limit`` characters; a
    longer text is cut with its length said, ``aaaa… (52,428,800 characters)``, so a
    server's answer that echoes a 50 MB input makes a reason of a few hundred characters,
    not 50 MB of log lines, events and results.csv cells. A NUL or a lone surrogate is
    written as Python escapes it (``\\x00``, ``\\ud800``): every reason can be stored
    and printed. The one function that bounds such text."""
    size = len(text)
    # Only the head is split: a 50 MB text is not copied to be cut.
    head = " ".join(text[: limit + 1].split())
    if size > limit or len(head) > limit:
        head = f"{head[:limit]}… ({size:,} characters)"
    return _UNWRITABLE.sub(lambda m: ascii(m[0])[1:-1], head)


def format_node_errors(node_errors: Mapping[str, Any]) -> str:
    """``node_errors`` of POST /prompt as one readable line, e.g.
    ``node 1 (EmptyImage): Value -5 smaller than min of 1 [width]`` (validation_errors.json).
    """
    parts: list[str] = []
    for node_id, node in node_errors.items():
        node = node if isinstance(node, dict) else {}
        class_type = node.get("class_type", "?")
        errors = node.get("errors") or [{}]
        for err in errors:
            text = excerpt(str(err.get("message", "error")))
            details = err.get("details")
            if details:
                text += f" [{excerpt(str(details))}]"
            parts.append(f"node {node_id} ({class_type}): {text}")
    return "; ".join(parts)


@dataclass(frozen=True)
class PostResult:
    """POST /prompt 200. A non-empty ``node_errors`` means some outputs failed validation
    and were dropped while the rest was queued (validation_errors.json, README fact 6)."""

    prompt_id: str
    number: int
    node_errors: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PostResult:
        node_errors = body.get("node_errors") or {}
        if not isinstance(node_errors, dict):
            raise TypeError(f"node_errors is {type(node_errors).__name__}, not an object")
        return cls(
            prompt_id=str(body["prompt_id"]), number=int(body["number"]), node_errors=node_errors
        )


@dataclass(frozen=True)
class UploadedFile:
    """POST /upload/image 200: ``{"name", "subfolder", "type"}`` (upload.json). ``name`` is
    the name the server stored the file under, NOT always the name sent: another file of
    that name with other bytes makes it ``key (1).png``; ``subfolder`` and ``type`` come
    back as sent."""

    name: str
    subfolder: str
    type: str

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> UploadedFile:
        fields = (body["name"], body["subfolder"], body["type"])
        if not all(isinstance(f, str) for f in fields):
            raise TypeError("name, subfolder and type are not all strings")
        return cls(name=fields[0], subfolder=fields[1], type=fields[2])

    @property
    def prompt_name(self) -> str:
        """How a prompt names the file in LoadImage's ``image`` or LoadVideo's ``file``:
        ``subfolder/name`` (``name`` without a subfolder), followed by `` [temp]`` or
        `` [output]`` for those types (ComfyUI's folder_paths.annotated_filepath)."""
        path = f"{self.subfolder}/{self.name}" if self.subfolder else self.name
        return path if self.type == "input" else f"{path} [{self.type}]"


@dataclass(frozen=True)
class OutputFile:
    """One file a node wrote: ``outputs[node_id][key][i]`` of /history. ``type`` is
    ``output`` for saved files, ``temp`` for previews."""

    node_id: str
    key: str
    filename: str
    subfolder: str
    type: str


@dataclass(frozen=True)
class ExecutionErrorInfo:
    """``execution_error`` data, from the socket or /history messages (execution_error.json)."""

    node_id: str
    node_type: str
    exception_type: str
    exception_message: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ExecutionErrorInfo:
        # Bounded here, where they are read: reasons quote them.
        return cls(
            node_id=excerpt(str(data.get("node_id", ""))),
            node_type=excerpt(str(data.get("node_type", ""))),
            exception_type=excerpt(str(data.get("exception_type", ""))),
            exception_message=str(data.get("exception_message", "")),
        )

    @property
    def is_oom(self) -> bool:
        """Out of memory on the GPU: the torch exception type, or ComfyUI's tip text
        (README fact 9). Worth another attempt, unlike most node errors."""
        message = self.exception_message.lower()
        return (
            self.exception_type in _OOM_TYPES or "out of memory" in message or _OOM_TIP in message
        )

    def describe(self) -> str:
        """``node 2 (ImageToMask): IndexError: index 3 is out of bounds ...``"""
        return (
            f"node {self.node_id} ({self.node_type}): "
            f"{self.exception_type}: {self.exception_message.strip()}"
        )


@dataclass(frozen=True)
class HistoryEntry:
    """One entry of GET /history/{prompt_id}.

    ``number`` is ``prompt[0]``, the run number: the only way to tell two runs of the
    same prompt_id apart (duplicate_prompt_id.json). ``outputs`` is the raw dict, node id →
    {key → list}; ``messages`` the ``status.messages`` pairs ``(type, data)`` (their
    ``timestamp`` in server milliseconds). ``client_id`` and ``create_time`` (server
    milliseconds) come from ``prompt[3]``, the extra_data (success.json);
    ``outputs_to_execute`` from ``prompt[4]`` (the output nodes validation kept).
    """

    prompt_id: str
    number: int
    status_str: str
    completed: bool
    outputs: dict[str, Any]
    messages: tuple[tuple[str, dict[str, Any]], ...]
    client_id: str | None = None
    create_time: int | None = None
    outputs_to_execute: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, prompt_id: str, entry: Mapping[str, Any]) -> HistoryEntry:
        status = entry.get("status") or {}
        messages = tuple((str(m[0]), dict(m[1] or {})) for m in status.get("messages") or ())
        outputs = entry.get("outputs") or {}
        if not isinstance(outputs, dict):
            raise TypeError(f"outputs is {type(outputs).__name__}, not an object")
        prompt = entry["prompt"]
        extra = prompt[3] if len(prompt) > 3 and isinstance(prompt[3], dict) else {}
        client_id, create_time = extra.get("client_id"), extra.get("create_time")
        return cls(
            prompt_id=prompt_id,
            number=int(prompt[0]),
            status_str=str(status.get("status_str") or ""),
            completed=bool(status.get("completed", False)),
            outputs=outputs,
            messages=messages,
            client_id=None if client_id is None else str(client_id),
            create_time=None if create_time is None else int(create_time),
            outputs_to_execute=_node_ids(prompt[4]) if len(prompt) > 4 else None,
        )

    @property
    def outcome(self) -> Outcome:
        """An interrupted run is recorded as ``status_str: error`` with an
        ``execution_interrupted`` message (interrupt_reconnect.json)."""
        if self.status_str == "success":
            return "success"
        if any(kind == "execution_interrupted" for kind, _ in self.messages):
            return "interrupted"
        return "error"

    @property
    def error(self) -> ExecutionErrorInfo | None:
        """The ``execution_error`` message of a failed run, if any."""
        for kind, data in self.messages:
            if kind == "execution_error":
                return ExecutionErrorInfo.from_json(data)
        return None

    @property
    def output_files(self) -> list[OutputFile]:
        """Every file under every output key (images, gifs, video, audio, ...): any list of
        ``{filename, subfolder, type}``. SaveVideo lists its mp4 under ``images`` next to
        ``animated: [true]`` (video.json); non-file lists such as ``animated`` or text are
        skipped."""
        files: list[OutputFile] = []
        for node_id, node_out in self.outputs.items():
            if not isinstance(node_out, dict):
                continue
            for key, items in node_out.items():
                if not isinstance(items, list):
                    continue
                for item in items:
                    if isinstance(item, dict) and "filename" in item:
                        files.append(
                            OutputFile(
                                node_id=str(node_id),
                                key=str(key),
                                filename=str(item["filename"]),
                                subfolder=str(item.get("subfolder") or ""),
                                type=str(item.get("type") or "output"),
                            )
                        )
        return files


@dataclass(frozen=True)
class DownloadedFile:
    """One output stored: ``path`` relative to the job's folder (POSIX separators),
    ``sha256`` hex digest and ``bytes`` size of what was written, ``content_type`` its
    media type as stored (``image/png``)."""

    path: str
    sha256: str
    bytes: int
    node_id: str
    key: str
    content_type: str = "application/octet-stream"
