"""Store calls that lose their database connection are tried again, for a while; a
database away longer than that, or a disk too full to write it, is one clear error.

A PostgreSQL failover, a restart or a dropped connection cuts a call halfway. Every store
method is one transaction, so a call cut before its commit changed nothing and can simply
run again; one cut *during* its commit may or may not have changed the job, so the call
runs again in "retrying" mode, where a move to the state the job is already in counts as
done (``AlreadyApplied``) instead of failing the state machine's check.

Only connection trouble is retried (SQLAlchemy's ``connection_invalidated``, or a failure
to connect at all), with capped exponential backoff, for ``Store.retry_s`` seconds; then
``StoreUnavailable`` is raised. A call on an event loop's thread is never retried: it must
not block the loop. ``off_loop`` runs a call where it may wait (a worker thread, for
PostgreSQL), and stops its retries when its caller is cancelled.

The store's ``Outage`` says once when its database goes away and once when it is back,
rather than a line per retried call; a pooled connection found lost is first replaced
at once, and only a call that fails again says the database is away. A write refused for want of disk space (SQLite's
``SQLITE_FULL``, PostgreSQL's ``disk_full``) raises ``StoreDiskFull``, at once: a full
disk does not empty itself while we wait.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa

from comfy_assets.store.errors import StoreError

log = logging.getLogger("comfy_assets.store")

P = ParamSpec("P")
R = TypeVar("R")

# True while a call runs again after a commit whose outcome is unknown.
RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("store_retrying", default=False)

# Set by ``off_loop`` when the coroutine awaiting a call is cancelled: its retries stop.
ABANDONED: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "store_abandoned", default=None
)

# Seconds a store call that lost its connection is tried again, by default.
DEFAULT_RETRY_S = 30.0

# sqlite3's extended result code for "database or disk is full" (sqlite.org/rescode.html).
SQLITE_FULL = 13
# PostgreSQL's SQLSTATE disk_full (postgresql.org/docs/current/errcodes-appendix.html).
PG_DISK_FULL = "53100"

# Connection failures that waiting does not cure: the server answered and refused us
# (libpq's messages for an unknown role or database, a wrong or missing password, no
# pg_hba.conf line).
_REFUSED_FOR_GOOD = (
    "does not exist",
    "authentication failed",
    "no password supplied",
    "pg_hba.conf",
)


def _first_line(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class StoreUnavailable(StoreError, RuntimeError):
    """The database could not be reached for ``waited_s`` seconds; ``cause`` is the last
    driver error (its message names no password: SQLAlchemy hides it)."""

    def __init__(self, what: str, waited_s: float, cause: BaseException) -> None:
        during = f" for {waited_s:.0f} s" if waited_s > 0 else ""
        super().__init__(
            f"the store's database is unreachable ({what} failed{during}: {_first_line(cause)})"
        )
        self.waited_s = waited_s
        self.cause = cause


class StoreDiskFull(StoreUnavailable):
    """No space left where the store's database is written: ``where`` names it (the SQLite
    file, or the PostgreSQL URL without its password), ``what`` the store call. A
    ``StoreUnavailable``: whoever stops for an unreachable store stops for this too."""

    # Waiting does not free a disk: callers that wait out a failing store stop at once.
    lasting = True

    def __init__(self, what: str, where: str, cause: BaseException) -> None:
        RuntimeError.__init__(
            self, f"no space left on device for the store's database {where} (writing {what})"
        )
        self.waited_s = 0.0
        self.cause = cause
        self.where = where


class AlreadyApplied(Exception):
    """Raised inside a retried call: the job is already where the call would move it
    (the first try committed after all). The call then returns as if it had moved it."""


class Outage:
    """Whether the store's database is away right now, said in one log line when a call
    first loses it and one when a call reaches it again. Safe from any thread.

    ``consequence``: what its user does meanwhile, added to the first line (the worker
    sets it: it takes no new messages). ``away``: a call lost the connection and none has
    reached the database since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None  # time.monotonic() of the first failure
        self.consequence = ""

    @property
    def away(self) -> bool:
        return self._since is not None

    def lost(self, what: str, error: BaseException, budget_s: float) -> None:
        """A call (``what``) lost the connection with ``error``; calls wait ``budget_s``."""
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.warning(
            "store: the database is unreachable (%s: %s); store calls wait for it up to %g s%s",
            what,
            _first_line(error),
            budget_s,
            f"; {self.consequence}" if self.consequence else "",
        )

    def reached(self) -> None:
        """A call reached the database."""
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning(
                "store: the database is reachable again (away %.1f s)", time.monotonic() - since
            )


def connection_trouble(error: BaseException) -> bool:
    """Whether ``error`` is a lost or refused database connection (worth another try)."""
    if not isinstance(error, sa.exc.DBAPIError):
        return False
    return bool(error.connection_invalidated or connecting(error))


def connecting(error: BaseException) -> bool:
    """Whether ``error`` came from opening a connection (the database refused or did not
    answer a new one), rather than from a pooled connection lost since it was opened."""
    return bool(getattr(error, "comfy_connecting", False))


def refused_for_good(error: BaseException) -> bool:
    """Whether a failure to connect is the server's answer that waiting does not change
    (unknown role or database, authentication), rather than the server being away."""
    text = str(getattr(error, "orig", None) or error)
    return any(fragment in text for fragment in _REFUSED_FOR_GOOD)


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` is the database refusing a write for want of disk space."""
    orig = getattr(error, "orig", None)
    if orig is None:
        return False
    if getattr(orig, "sqlite_errorcode", None) == SQLITE_FULL:
        return True
    return getattr(orig, "sqlstate", None) == PG_DISK_FULL


def database_place(engine: sa.Engine) -> str:
    """Where ``engine`` writes, for an error line: the SQLite file's path, or the URL
    without its password."""
    url = engine.url
    if url.get_backend_name() == "sqlite":
        return str(url.database)
    return url.render_as_string(hide_password=True)


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
    docstring). ``self.retry_s`` is the budget in seconds; raises StoreUnavailable, and
    StoreDiskFull for a write the database's disk has no room for."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        store: Any = args[0]
        outage: Outage = store.outage
        started = time.monotonic()
        delay = 0.05
        unknown = RETRYING.get()
        abandoned = ABANDONED.get()
        stale_tried = False  # a lost pooled connection was tried again once, at once
        while True:
            token = RETRYING.set(unknown)
            try:
                result = method(*args, **kwargs)
            except AlreadyApplied:
                outage.reached()
                return None  # type: ignore[return-value]
            except sa.exc.DBAPIError as error:
                if disk_full(error):
                    raise StoreDiskFull(
                        method.__name__, database_place(store.engine), error
                    ) from error
                if not connection_trouble(error):
                    raise
                waited = time.monotonic() - started
                gone = abandoned is not None and abandoned.is_set()
                # One pooled connection lost (a restart or a failover since it was
                # opened, a proxy's cut) says nothing yet of the database now: the call
                # runs again at once on a new connection (on the event loop's thread
                # too: it waits for nothing), and the outage is said only when that
                # fails too. Otherwise the first call after an outage, on a connection
                # from before it, would say the database is away again.
                again_at_once = not stale_tried and not connecting(error)
                if not again_at_once and (waited >= store.retry_s or _on_loop_thread() or gone):
                    outage.lost(method.__name__, error, store.retry_s)
                    raise StoreUnavailable(method.__name__, waited, error) from error
                unknown = unknown or getattr(error, "comfy_commit_unknown", False)
                pause = 0.0 if again_at_once else delay
                if pause:
                    outage.lost(method.__name__, error, store.retry_s)
                stale_tried = True
                log.debug(
                    "store: %s lost its database connection (%s); trying again in %.2f s",
                    method.__name__,
                    type(error.orig or error).__name__,
                    pause,
                )
            else:
                outage.reached()
                return result
            finally:
                RETRYING.reset(token)
            if not pause:
                continue
            if abandoned is not None:
                abandoned.wait(pause)  # wakes at once when the caller is cancelled
            else:
                time.sleep(pause)
            delay = min(delay * 2, 2.0)

    return call


async def off_loop(store: Any, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)``, a call on ``store``, made where its retries may wait out an
    outage: on a thread of the loop's default executor for PostgreSQL (the event loop
    goes on meanwhile), inline for SQLite (a local file has no outage to wait out, and
    the hop to a thread would cost more than the call). A cancelled caller's call stops
    retrying at its next wait. Raises what ``fn`` raises."""
    if store.dialect != "postgresql":
        return fn(*args, **kwargs)
    gone = threading.Event()
    context = contextvars.copy_context()
    context.run(ABANDONED.set, gone)
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, functools.partial(context.run, fn, *args, **kwargs))
    except asyncio.CancelledError:
        gone.set()
        raise
