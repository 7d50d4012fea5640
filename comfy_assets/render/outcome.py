"""What an attempt comes to (``AttemptResult``, ``Eviction``), the hooks it calls on the
way (``AttemptHooks``), and the readable reasons and timings taken from what ComfyUI
answered (``describe_error``, ``entry_timings``)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

from comfy_assets.comfy.errors import (
    ComfyError,
    PromptRejected,
    ServerError,
)
from comfy_assets.comfy.types import DownloadedFile, HistoryEntry, excerpt

Kind = Literal["success", "transient", "permanent"]

# What failed, when it may not be the job's fault (``render/blame.py`` decides whose),
# by where the decision comes from:
# - judged by a second server (the same failure there makes it the job's): an
#   ``execution_error``, a prompt ``rejected`` (POST 400, or 200 with node_errors), an
#   answer the client does not understand (``garbled``);
# - the server's at first sight: an ``infrastructure`` error (``comfy/infra.py``), a
#   ``wedged`` server (our prompt still running after its interrupt and delete);
# - retryable, the server's once the job renders elsewhere, never the job's alone: the
#   attempt's ``deadline``, a prompt ``stalled`` (no word of it for many times its
#   workflow's longest run), a prompt the server ``lost``, a ``server`` error (5xx,
#   refused, reset, timed out), out of memory (``oom``).
FailureKind = Literal[
    "execution_error",
    "rejected",
    "garbled",
    "infrastructure",
    "wedged",
    "deadline",
    "stalled",
    "lost",
    "server",
    "oom",
]
JUDGED: frozenset[str] = frozenset({"execution_error", "rejected", "garbled"})
SERVERS_AT_ONCE: frozenset[str] = frozenset({"infrastructure", "wedged"})
RETRYABLE: frozenset[str] = frozenset({"deadline", "stalled", "lost", "server", "oom"})
# After these the prompt may still be on its server, or have succeeded there after all:
# the next attempt catches up there first. After the others its run there is over.
CATCH_UP_AFTER: frozenset[str] = frozenset({"deadline", "stalled", "lost", "server"})

# Hex addresses and long numbers differ between two runs of one failing node.
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\d{4,}")


@dataclass(frozen=True)
class Failure:
    """A failure that may belong to the server, for ``render/blame.py``. ``kind``
    (``FailureKind``); ``signature``: equal for the same error in the same node
    (node id, exception type, first message line without addresses), so two servers that
    failed "the same way" compare equal; ``summary``: the reason for people, without
    the server (``execution_error in node 2 (ImageToMask): IndexError: ...``)."""

    kind: FailureKind
    signature: str
    summary: str

    @classmethod
    def of(cls, kind: FailureKind, what: str) -> Failure:
        """A failure whose signature is its kind and ``what`` without addresses and long
        numbers (``POST /prompt 500``); ``what`` is its summary too."""
        return cls(kind, f"{kind}|{_VOLATILE.sub('#', what.strip())[:200]}", what)

    @classmethod
    def execution_error(
        cls, kind: FailureKind, node_id: str, exception_type: str, first_line: str, summary: str
    ) -> Failure:
        """The failure of an execution_error in ``node_id``."""
        line = _VOLATILE.sub("#", first_line.strip())[:200]
        return cls(kind, f"node {node_id}|{exception_type}|{line}", summary)


@dataclass
class AttemptResult:
    """What one attempt came to. ``reason`` is for people (empty on success).

    ``gpu_seconds`` and ``queue_wait_s`` come from the server's own timestamps in the
    /history entry (execution_start, execution_success/error; extra_data.create_time),
    ``seconds`` is this attempt's wall time. ``outputs_missing``: the run succeeded but
    the server no longer has its files, so the next attempt must render anew.
    ``failure``: what failed, when the failure may be the server's (else None).
    ``file_store_fault``: the run succeeded but its outputs could not be stored or
    confirmed in the store's files: the store's failure, not the job's nor the
    server's (the job is tried again, its outputs caught up from the server's /history).
    """

    kind: Kind
    reason: str = ""
    server: str | None = None
    prompt_id: str | None = None
    number: int | None = None
    posted: bool = False
    caught_up: bool = False
    files: list[DownloadedFile] = field(default_factory=list)
    seconds: float = 0.0
    gpu_seconds: float | None = None
    queue_wait_s: float | None = None
    outputs_missing: bool = False
    failure: Failure | None = None
    file_store_fault: bool = False


@dataclass(frozen=True)
class Run:
    """A run of an attempt's prompt on a server, as the attempt follows or takes it:
    ``number`` (ComfyUI's run number), ``posted`` (this attempt posted it), ``caught_up``
    (an earlier run's, taken with nothing posted), ``verify`` (the POST's answer was not
    seen: the run is checked to have kept every output node before its outputs are
    taken)."""

    number: int
    _: KW_ONLY
    posted: bool = False
    caught_up: bool = False
    verify: bool = False

    def recorded(self, server: str, entry: HistoryEntry | None = None) -> dict[str, Any]:
        """The fields an ``AttemptResult`` of this run on ``server`` has of it: the run,
        and from its /history ``entry`` when there is one, its GPU seconds and queue
        wait (``entry_timings``)."""
        gpu, wait = entry_timings(entry) if entry is not None else (None, None)
        return dict(
            server=server,
            number=self.number,
            posted=self.posted,
            caught_up=self.caught_up,
            gpu_seconds=gpu,
            queue_wait_s=wait,
        )


@dataclass(frozen=True)
class Eviction:
    """What removing our prompt from a server came to. ``was_there``: still queued or
    running when we looked; ``confirmed``: it has left the server (False when the
    server could not be asked: ``problem`` says why); ``won``: its history entry when
    that run succeeded after all; ``history``: the prompt's /history entry once it left
    (its last run, whichever it was); ``wedged``: it stayed running past the wedge wait
    after its interrupt and delete (the server runs nothing: ``problem`` says so)."""

    was_there: bool
    confirmed: bool
    won: HistoryEntry | None = None
    problem: str = ""
    history: HistoryEntry | None = None
    wedged: bool = False


async def _none() -> str | None:
    return None


async def _nothing(*args: object) -> None:
    return None


@dataclass
class AttemptHooks:
    """Coroutines the attempt awaits at state changes (the store writes transitions):
    ``submitted(server, detail)`` before the POST (``detail``: why this post may render
    the job a second time, or None), ``rendering(server, number)`` after it.
    ``stopped()``: why nothing may be posted any more (the batch stopped), else None;
    asked right before ``submitted`` and again right before the POST. ``unsure()``
    waits while this process's heartbeat is not reaching the store (others may soon take
    its jobs), up to the store's budget; then why nothing may be posted, else None. Asked
    right before the POST: an answer ends the attempt transient, nothing posted."""

    submitted: Callable[[str, str | None], Awaitable[None]] = _nothing
    rendering: Callable[[str, int], Awaitable[None]] = _nothing
    stopped: Callable[[], str | None] = lambda: None
    unsure: Callable[[], Awaitable[str | None]] = _none


class NotPosted(Exception):
    """The batch stopped before this attempt posted anything (``AttemptHooks.stopped``):
    the job is still pending, and its slot is released."""


def entry_timings(entry: HistoryEntry) -> tuple[float | None, float | None]:
    """(gpu_seconds, queue_wait_s) from a /history entry's status messages and create_time
    (all server-side milliseconds; success.json shows the shapes)."""
    start = end = None
    for item in entry.messages or []:
        kind, data = item[0], item[1] if len(item) > 1 else {}
        ts = data.get("timestamp") if isinstance(data, dict) else None
        if ts is None:
            continue
        if kind == "execution_start":
            start = ts
        elif kind in ("execution_success", "execution_error", "execution_interrupted"):
            end = ts
    created = getattr(entry, "create_time", None)  # ms; None where the entry lacks it
    gpu = (end - start) / 1000 if start is not None and end is not None else None
    wait = (start - created) / 1000 if start is not None and created is not None else None
    return gpu, (max(wait, 0.0) if wait is not None else None)


def describe_error(e: ComfyError, what: str) -> str:
    """A reason a person can read, in the shape of the log lines in STYLE.md."""
    if isinstance(e, ServerError):
        first = (e.body or "").strip().splitlines()[:1]
        return f"{what} {e.status}, {excerpt(first[0]) if first else 'no body'}"
    if isinstance(e, PromptRejected):
        return f"{what} 400, {e.detail}"
    return f"{what}: {type(e).__name__}: {e}"
