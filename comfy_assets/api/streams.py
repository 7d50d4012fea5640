"""Live event streams (``GET /v1/jobs/{id}/events`` with ``Accept: text/event-stream``):
how many each client may hold open, and the one poller that wakes them.

A stream costs nothing while its job does not change: it waits on an ``asyncio.Event``
and reads the store only when ``Changes`` wakes it. ``Changes`` is one task per API
process, running while any stream is open: every ``poll_s`` seconds it reads the events
written since its last look (a range of the events' primary key, however many streams
there are) and wakes the streams of their jobs. PostgreSQL may commit event ids out of
order (a transaction that took id 10 committing after one that took 11), so each look
goes back ``lookback`` ids and wakes for any id not seen before.

``StreamCap`` bounds one client's open streams (``--max-streams``): past it, 429 with
``Retry-After``, so one client's streams cannot take the sockets, memory and loop of the
API from the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from comfy_assets.store import StoreUnavailable, off_loop
from comfy_assets.store.api_jobs import ApiLedger

log = logging.getLogger("comfy_assets.api")

# Seconds a client refused a stream is told to wait (streams end when their jobs do).
STREAM_RETRY_AFTER_S = 5


class StreamCap:
    """At most ``per_client`` open streams per client."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._open: Counter[str] = Counter()

    def enter(self, client: str) -> bool:
        """Count one more open stream of ``client``: False (nothing counted) when it
        holds ``per_client`` already."""
        if self._open[client] >= self.per_client:
            return False
        self._open[client] += 1
        return True

    def leave(self, client: str) -> None:
        """One stream of ``client`` ended."""
        self._open[client] -= 1
        if self._open[client] <= 0:
            del self._open[client]

    def open(self, client: str) -> int:
        """The streams ``client`` holds open now."""
        return self._open[client]


class Changes:
    """Wakes the streams of jobs that have new events (see the module docstring)."""

    def __init__(self, ledger: ApiLedger, *, poll_s: float = 0.25, lookback: int = 200) -> None:
        self.ledger = ledger
        self.poll_s = poll_s
        self.lookback = lookback
        self.looks = 0  # looks at the store made, for tests and benches
        self.wakes = 0  # streams woken
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._cursor: int | None = None
        self._seen: set[int] = set()

    @contextmanager
    def watch(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever ``job_id`` has new events, while the block runs; the
        caller clears it before each read of the store."""
        changed = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(changed)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="event stream changes")
        try:
            yield changed
        finally:
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(changed)
                if not waiting:
                    del self._waiters[job_id]

    async def close(self) -> None:
        """Stop the poller (the API's shutdown)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        """Look while any stream waits; then end (the next stream starts it again)."""
        self._cursor = None
        while self._waiters:
            try:
                await self.look()
            except StoreUnavailable as e:
                log.warning("event streams: %s; looking again", e)
            except Exception as e:  # the streams must keep a poller: logged, looked again
                log.error("event streams: looking for changes failed: %r", e, exc_info=e)
            await asyncio.sleep(self.poll_s)

    async def look(self) -> None:
        """Read the events since the last look and wake their jobs' streams."""
        self.looks += 1
        if self._cursor is None:  # the first look: where the events end, nothing woken
            last = await off_loop(self.ledger, self.ledger.last_event_id)
            rows = await off_loop(
                self.ledger, self.ledger.events_after, max(0, last - self.lookback)
            )
            self._seen = {i for i, _ in rows}
            self._cursor = max([last, *self._seen])
            return
        since = max(0, self._cursor - self.lookback)
        rows = await off_loop(self.ledger, self.ledger.events_after, since)
        fresh = [(i, job_id) for i, job_id in rows if i not in self._seen]
        for event_id, job_id in fresh:
            self._seen.add(event_id)
            for changed in self._waiters.get(job_id, ()):
                changed.set()
                self.wakes += 1
        if rows:
            self._cursor = max(self._cursor, rows[-1][0])
        low = self._cursor - self.lookback
        self._seen = {i for i in self._seen if i > low}
