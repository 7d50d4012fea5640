"""What the result store returns and raises: rows as frozen dataclasses, typed errors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any, NamedTuple, Protocol

from comfy_assets.jobs.states import DONE, State
from comfy_assets.store.errors import StoreError


class ClaimStatus(StrEnum):
    """Answer of ``Store.claim``; members compare equal to their strings."""

    CLAIMED = "claimed"  # the caller holds the job now
    HELD = "held"  # another owner holds a live claim
    DONE = "done"  # succeeded or degraded: nothing to do
    DEAD_LETTERED = "dead_lettered"  # failed_fatal: needs a requeue
    # The store's prompt_id of the job is another (a newer take, other inputs): not claimed.
    CHANGED = "changed"


@dataclass(frozen=True)
class JobRecord:
    """One row of ``jobs``. Times in epoch seconds; durations in seconds.

    ``line`` orders jobs within their file. ``attempts`` counts tries since the job was
    last requeued or its inputs changed, ``attempts_before`` the tries before: attempt
    rows are numbered ``attempts_before + 1`` onwards. ``seconds``
    is the job's total wall time, ``queue_wait_s`` the time its prompts waited in
    ComfyUI's queue, ``gpu_seconds`` the time they ran. ``set`` is the job's overrides,
    ``take`` its take, ``inputs`` its input files (``store.register.inputs_json``).
    """

    job_id: str
    partition: str
    line: int
    prompt_id: str
    shot: int | None
    optional: bool
    duration_s: float | None
    set: dict[str, Any]
    state: State
    attempts: int
    attempts_before: int
    server: str | None
    number: int | None
    reason: str | None
    claimed_by: str | None
    claim_expires_at: float | None
    created_at: float
    updated_at: float
    first_submitted_at: float | None
    finished_at: float | None
    seconds: float | None
    queue_wait_s: float | None
    gpu_seconds: float | None
    take: int = 1
    inputs: tuple[dict[str, Any], ...] = ()
    # Set by a claim that took the job over from another owner: what the event says.
    taken_over: str | None = None

    @property
    def done(self) -> bool:
        """True for succeeded and degraded."""
        return self.state in DONE


class OutputFileLike(Protocol):
    """What ``mark_done`` needs of a file (``comfy.types.DownloadedFile`` has it)."""

    @property
    def path(self) -> str | PurePosixPath: ...
    @property
    def sha256(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def node_id(self) -> str | None: ...
    @property
    def key(self) -> str | None: ...
    @property
    def content_type(self) -> str | None: ...


@dataclass(frozen=True)
class OutputFile:
    """A file to record with a done job: ``path`` relative to the job dir, ``bytes`` its
    size. ``node_id`` / ``key`` say which output wrote it (node "9", key "images");
    ``content_type`` its media type (None: judged from its name)."""

    path: str | PurePosixPath
    sha256: str
    bytes: int
    node_id: str | None = None
    key: str | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class FileRecord:
    """One row of ``files``, a line of the job's manifest: an output of ``prompt_id``,
    ``path`` relative to the job dir with "/" separators, ``bytes`` its size,
    ``content_type`` its media type (``image/png``; None in rows recorded before the
    column was)."""

    job_id: str
    prompt_id: str
    path: str
    sha256: str
    bytes: int
    node_id: str | None
    key: str | None
    content_type: str | None = None


@dataclass(frozen=True)
class AttemptRecord:
    """One try of a job on one server (seconds; ``seconds`` includes the queue wait).

    ``outcome`` is "success", "transient" (may be retried) or "permanent".
    """

    job_id: str
    attempt: int
    server: str | None
    prompt_id: str | None
    number: int | None
    started_at: float
    ended_at: float
    seconds: float
    queue_wait_s: float | None
    gpu_seconds: float | None
    outcome: str
    reason: str | None


@dataclass(frozen=True)
class AttemptEntry:
    """One try to write with the transition it leads to (``Via.tried`` of
    ``Store.transition``, ``mark_done`` and ``dead_letter``): one transaction, not two.
    Also ``Store.record_attempt``'s one argument; seconds; ``attempt`` is the row's number."""

    attempt: int
    outcome: str
    server: str | None = None
    prompt_id: str | None = None
    number: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    seconds: float | None = None
    queue_wait_s: float | None = None
    gpu_seconds: float | None = None
    reason: str | None = None
    models: tuple[str, ...] = ()  # the job's model files (a model_loads row when any)
    model_loaded: bool = False  # its server had to load one of them for this try


class JobBrief(NamedTuple):
    """The columns of a job that a partition's summary reads (``Store.job_brief_page``):
    a plain row, not a ``JobRecord`` (whose ``set`` and ``inputs`` are JSON to parse),
    so a million are read in seconds. ``state`` is the state's name."""

    job_id: str
    prompt_id: str
    state: str
    line: int
    shot: int | None
    server: str | None


@dataclass(frozen=True)
class ModelLoadRecord:
    """One try of a job that loads models: its model files, whether its server had to
    load one (the pool's view), and the try's outcome and GPU seconds (None: not run)."""

    job_id: str
    attempt: int
    server: str | None
    models: tuple[str, ...]
    loaded: bool
    outcome: str
    gpu_seconds: float | None


@dataclass(frozen=True)
class RenderingStart:
    """The move of a job from submitted to rendering, not yet written: ``server``
    accepted the prompt of attempt ``attempt`` as run ``number`` at ``at`` (epoch
    seconds). ``Via.rendering`` of the transition that ends the attempt writes it first, its
    event at ``at``, in the same transaction (``Store.transition``, ``mark_done``,
    ``dead_letter``)."""

    server: str
    attempt: int
    number: int
    at: float


@dataclass(frozen=True)
class Via:
    """How a job reaches the state a store move writes (``via=`` of ``Store.transition``,
    ``mark_done`` and ``dead_letter``): ``server`` (stored on the job, and in the event),
    ``attempt`` (the try's number in this run, in the event; ``mark_done`` also sets the
    job's ``attempts`` to it), ``tried`` (that try's row, written in the same transaction)
    and ``rendering`` (the job's move to rendering not yet written, written first). All
    None: a move that names none of them."""

    server: str | None = None
    attempt: int | None = None
    tried: AttemptEntry | None = None
    rendering: RenderingStart | None = None


# A move that names no server, attempt, try or rendering move.
NO_VIA = Via()


@dataclass(frozen=True)
class ServerLease:
    """Who holds a GPU server and until when (epoch seconds). ``owner`` is None once
    released; ``last_model``, the model files the server holds (a JSON list, written by
    ``pool/plan.py: held_text``; an older row: one bare file name), survives the
    release."""

    server: str
    owner: str | None
    expires_at: float | None
    prompt_id: str | None
    last_model: str | None
    updated_at: float
    holder_gone: bool = False  # its owner is gone (``store/owners.py``): free to take

    def held(self, now: float | None = None) -> bool:
        """True if an owner holds it at ``now`` (epoch seconds, default this host's
        clock; pass ``store.now()`` to judge by the database's)."""
        now = time.time() if now is None else now
        return self.owner is not None and self.expires_at is not None and self.expires_at > now


@dataclass(frozen=True)
class RegisterResult:
    """Job ids, in the order given, sorted by what ``register_jobs`` did with them."""

    inserted: list[str]
    unchanged: list[str]
    changed: list[str]  # inputs changed: back to pending, attempts 0
    # Left as they are: the store has a newer take (``register_jobs(forward_only=True)``).
    superseded: list[str] = field(default_factory=list)
    # Of ``unchanged``, those ended already (done, degraded, dead-lettered), with their
    # records as the registration read them: a run started again on its file resolves
    # them without a claim each.
    ended: dict[str, JobRecord] = field(default_factory=dict)


class UnknownJob(StoreError, LookupError):
    """No job with that id in the store."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: not in the store")
        self.job_id = job_id


class ClaimLost(StoreError, RuntimeError):
    """The caller does not hold the job's claim (never had it, released, or taken over)."""

    def __init__(self, job_id: str, owner: str, holder: str | None) -> None:
        now_held = f"held by {holder}" if holder else "held by nobody"
        super().__init__(f"job {job_id}: {owner} does not hold the claim (it is {now_held})")
        self.job_id = job_id
        self.owner = owner
        self.holder = holder


class PartitionConflict(StoreError, ValueError):
    """Job ids already registered under another partition (ids are global)."""

    def __init__(self, partition: str, conflicts: dict[str, str]) -> None:
        shown = ", ".join(f"{j} (in {p!r})" for j, p in sorted(conflicts.items())[:5])
        more = f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""
        super().__init__(
            f"cannot register in partition {partition!r}: job ids already in another "
            f"partition: {shown}{more}"
        )
        self.partition = partition
        self.conflicts = conflicts


class StoreConflict(StoreError, RuntimeError):
    """A guarded UPDATE matched no row although its row was locked: a bug, not a race."""
