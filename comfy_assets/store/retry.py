"""Store calls that lose their database connection are tried again, for a while.

A PostgreSQL failover, a restart or a dropped connection cuts a call halfway. Every store
method is one transaction, so a call cut before its commit changed nothing and can simply
run again; one cut *during* its commit may or may not have changed the job, so the call
runs again in "retrying" mode, where a move to the state the job is already in counts as
done (``AlreadyApplied``) instead of failing the state machine's check.

Only connection trouble is retried (SQLAlchemy's ``connection_invalidated``, or a failure
to connect at all), with capped exponential backoff, for ``Store.retry_s`` seconds; then
``StoreUnavailable`` is raised. A call on an event loop's thread is never retried: it must
not block the loop (the batch makes its PostgreSQL calls on worker threads).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa

log = logging.getLogger("comfy_assets.store")

P = ParamSpec("P")
R = TypeVar("R")

# True while a call runs again after a commit whose outcome is unknown.
RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("store_retrying", default=False)


class StoreUnavailable(RuntimeError):
    """The database could not be reached for ``waited_s`` seconds; ``cause`` is the last
    driver error (its message names no password: SQLAlchemy hides it)."""

    def __init__(self, what: str, waited_s: float, cause: BaseException) -> None:
        during = f" for {waited_s:.0f} s" if waited_s > 0 else ""
        first_line = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(
            f"the store's database is unreachable ({what} failed{during}: "
            f"{type(cause).__name__}: {first_line})"
        )
        self.waited_s = waited_s
        self.cause = cause


class AlreadyApplied(Exception):
    """Raised inside a retried call: the job is already where the call would move it
    (the first try committed after all). The call then returns as if it had moved it."""


def connection_trouble(error: BaseException) -> bool:
    """Whether ``error`` is a lost or refused database connection (worth another try)."""
    if not isinstance(error, sa.exc.DBAPIError):
        return False
    return bool(error.connection_invalidated or getattr(error, "comfy_connecting", False))


def mark_commit_unknown(error: BaseException) -> None:
    """Note on ``error`` that it came from a commit, whose outcome is unknown."""
    error.comfy_commit_unknown = True  # type: ignore[attr-defined]


def mark_connecting(error: BaseException) -> None:
    """Note on ``error`` that it came from opening a connection (nothing was sent)."""
    error.comfy_connecting = True  # type: ignore[attr-defined]


def _on_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def retried(method: Callable[P, R]) -> Callable[P, R]:
    """Run a ``Store`` method again while its connection fails (see the module
    docstring). ``self.retry_s`` is the budget in seconds; raises StoreUnavailable."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        store: Any = args[0]
        started = time.monotonic()
        delay = 0.05
        unknown = RETRYING.get()
        while True:
            token = RETRYING.set(unknown)
            try:
                return method(*args, **kwargs)
            except AlreadyApplied:
                return None  # type: ignore[return-value]
            except sa.exc.DBAPIError as error:
                if not connection_trouble(error):
                    raise
                waited = time.monotonic() - started
                if waited >= store.retry_s or _on_loop_thread():
                    raise StoreUnavailable(method.__name__, waited, error) from error
                unknown = unknown or getattr(error, "comfy_commit_unknown", False)
                log.warning(
                    "store: %s lost its database connection (%s); trying again in %.2f s",
                    method.__name__,
                    type(error.orig or error).__name__,
                    delay,
                )
            finally:
                RETRYING.reset(token)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    return call
