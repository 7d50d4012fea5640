"""A batch's own store calls (claims, transitions, done records): on worker threads for
PostgreSQL, so their network round trips don't stall the event loop that reads every
server's socket; inline for SQLite, a local file where a call costs less than a hop to a
thread and back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from comfy_assets.store import Store

P = ParamSpec("P")
R = TypeVar("R")

# Worker threads for a networked store (PostgreSQL): two, so one call can wait on the
# network while another runs; more only add GIL contention (docs/performance.md).
STORE_THREADS = 2


class StoreThreads:
    """Where a batch runs its calls to ``store``: ``call`` each, ``landed`` before
    reading or releasing anything after a cancel, ``close`` at the end."""

    def __init__(self, store: Store) -> None:
        self._threads = (
            ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="store")
            if store.dialect == "postgresql"
            else None
        )
        # Calls under way on those threads: a cancelled await does not stop one, so
        # cleanup waits for them before it reads or releases anything.
        self._in_flight: set[concurrent.futures.Future[object]] = set()

    async def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` (a store call): on a worker thread for PostgreSQL,
        inline for SQLite. Raises what ``fn`` raises."""
        if self._threads is None:
            return fn(*args, **kwargs)
        future = self._threads.submit(functools.partial(fn, *args, **kwargs))
        self._in_flight.add(future)  # type: ignore[arg-type]
        future.add_done_callback(self._in_flight.discard)
        return await asyncio.wrap_future(future)

    async def landed(self) -> None:
        """Wait until every call under way on a worker thread has finished."""
        if self._in_flight:
            pending = [asyncio.wrap_future(f) for f in list(self._in_flight)]
            await asyncio.gather(*pending, return_exceptions=True)

    def close(self) -> None:
        """Let the threads go (nothing may be under way any more)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False)
