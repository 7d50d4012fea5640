"""The job state machine: which state may follow which.

The store validates every transition against the state it reads from the database, so a
worker holding a stale view cannot, say, move a finished job back to rendering.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class State(StrEnum):
    """A job's state. Members are strings, so ``State.PENDING == "pending"``."""

    PENDING = "pending"
    SUBMITTED = "submitted"
    RENDERING = "rendering"
    SUCCEEDED = "succeeded"
    DEGRADED = "degraded"
    FAILED_RETRYABLE = "failed_retryable"
    FAILED_FATAL = "failed_fatal"


PENDING = State.PENDING
SUBMITTED = State.SUBMITTED
RENDERING = State.RENDERING
SUCCEEDED = State.SUCCEEDED
DEGRADED = State.DEGRADED
FAILED_RETRYABLE = State.FAILED_RETRYABLE
FAILED_FATAL = State.FAILED_FATAL

# Finished with a usable result: a claim on such a job answers "done".
DONE: frozenset[State] = frozenset({SUCCEEDED, DEGRADED})
# Someone may be working on it right now.
IN_FLIGHT: frozenset[State] = frozenset({SUBMITTED, RENDERING})
# Ended without a render: ``requeue`` sends these back to pending (a degraded job is a
# failure the draft policy accepted as done).
REQUEUEABLE: frozenset[State] = frozenset({FAILED_FATAL, DEGRADED})
# Not finished: it may still end either way (neither done nor a dead letter).
UNFINISHED: frozenset[State] = frozenset({PENDING, SUBMITTED, RENDERING, FAILED_RETRYABLE})

_NAMES = frozenset(s.value for s in State)

ALLOWED: Mapping[State, frozenset[State]] = {
    # succeeded: caught up (already in /history); failed_fatal: a policy stopped it;
    # degraded: a draft skipped an optional shot; failed_retryable: an attempt that failed
    # before it posted (a caught-up download, the server's socket would not open).
    PENDING: frozenset({SUBMITTED, SUCCEEDED, FAILED_FATAL, DEGRADED, FAILED_RETRYABLE}),
    # succeeded straight from submitted: a fully cached prompt never reports rendering.
    SUBMITTED: frozenset({RENDERING, SUCCEEDED, DEGRADED, FAILED_RETRYABLE, FAILED_FATAL}),
    RENDERING: frozenset({SUCCEEDED, DEGRADED, FAILED_RETRYABLE, FAILED_FATAL}),
    FAILED_RETRYABLE: frozenset({PENDING, FAILED_FATAL}),
    FAILED_FATAL: frozenset({PENDING}),  # requeue
    SUCCEEDED: frozenset({PENDING}),  # inputs changed, or a rerun
    DEGRADED: frozenset({PENDING}),
}


class InvalidTransition(ValueError):
    """A transition the state machine forbids, or a state name it does not know.

    ``from_state`` / ``to_state`` are the raw values given; ``job_id`` is set when the
    store raises it for a particular job.
    """

    def __init__(self, from_state: str, to_state: str, *, job_id: str | None = None) -> None:
        self.from_state = from_state
        self.to_state = to_state
        self.job_id = job_id
        who = f"job {job_id}: " if job_id else ""
        unknown = [s for s in (from_state, to_state) if s not in _NAMES]
        if unknown:
            message = f"{who}unknown state {unknown[0]!r} (known: {', '.join(State)})"
        else:
            allowed = ", ".join(sorted(ALLOWED[State(from_state)]))
            message = f"{who}cannot go from {from_state} to {to_state} (allowed: {allowed})"
        super().__init__(message)


def is_allowed(from_state: str, to_state: str) -> bool:
    """True if ``from_state -> to_state`` is allowed; False for unknown state names too."""
    try:
        return State(to_state) in ALLOWED[State(from_state)]
    except ValueError:
        return False


def check_transition(from_state: str, to_state: str, *, job_id: str | None = None) -> None:
    """Raise ``InvalidTransition`` unless ``from_state -> to_state`` is allowed.

    ``job_id`` only goes into the error message.
    """
    if not is_allowed(from_state, to_state):
        raise InvalidTransition(from_state, to_state, job_id=job_id)
