"""The worker service: takes jobs from a source (RabbitMQ, memory, a job file) and runs
each exactly once through ``batch.run_one`` on one shared GPU pool.

Per message, one outcome and one log line:

- done (now, or before: nothing posted) -> ack;
- dead-lettered by this run -> publish to ``<queue>.dead`` with ``x-worker-reason``, ack;
- dead-lettered by an earlier delivery -> ack only (published then, not again);
- of an older take than the store's (or registered again meanwhile) -> ack, nothing
  registered or posted, an event of the job says it was superseded;
- not a valid job (bad JSON, bad id, a workflow path outside ``--workflows-dir``, a body
  over ``--max-message-bytes``, ...) -> ``<queue>.dead`` with the validation error, ack;
- its handling raised in our own code, the job's failure (``render/guard.py``) ->
  ``<queue>.dead`` with ``our error while handling this job: ...``, ack;
- still running when the shutdown grace ran out -> run cancelled (prompt interrupted and
  removed, claim and server lease released), nack with requeue;
- the store unreachable for longer than its retry budget, full, or our disk full (an
  output that cannot be written) -> nack with requeue, and the worker stops.

An ack is sent only after the store holds the done record, so a worker killed at any
moment leaves the message unacknowledged; its redelivery finds the done record, or the
prompt in the server's history, and nothing runs twice.

While the store's database is away (a restart, a failover) the worker takes no new
message: store calls wait for it up to ``Store.retry_s`` seconds (the store says once that
it is gone and once that it is back), and the worker goes on when it answers. Only a
longer outage stops it.

Shutdown (SIGTERM/SIGINT, or ``Worker.request_stop``): stop consuming, give running jobs
``grace_s`` seconds, cancel the rest, requeue their messages, close, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import TypeVar, cast

from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.pool.pool import Pool
from comfy_assets.render.batch import Batch
from comfy_assets.render.config import BatchConfig
from comfy_assets.render.owners import OwnerHeartbeat, new_owner
from comfy_assets.render.publish import publish_servers
from comfy_assets.render.results import results_location, write_results
from comfy_assets.render.run import make_pool
from comfy_assets.render.steering import EVERY_S
from comfy_assets.service import broker
from comfy_assets.service.handling import MessageHandler
from comfy_assets.service.messages import MAX_MESSAGE_BYTES
from comfy_assets.service.queue_file import scan_queue_file
from comfy_assets.service.sources import JobSource
from comfy_assets.store import Store, StoreError, StoreUnavailable, off_loop

log = logging.getLogger("comfy_assets.service.worker")

T = TypeVar("T")

# Outcome counters (Worker.counts): "acked" counts every ack; the others say why.
OUTCOMES = (
    "acked",
    "done",
    "done_before",
    "dead_lettered",
    "dead_before",
    "invalid",
    "stopped",
    "left_to_holder",
    "superseded",
    "requeued",
)


# Messages in hand per server: one job renders while the next waits in line for its
# server, so a freed server gets its next prompt at once instead of after the first
# job's downloads, done record and ack, and the next message's round trip.
JOBS_PER_SERVER = 2


# A partition's results.csv is written again no sooner than this many times the seconds
# its last write took (``Worker._write_results``): a write reads what changed, but joins
# every segment's bytes (a first write reads them all).
RESULTS_DUTY = 20.0


@dataclass(eq=False)
class Worker:
    """Consumes ``source`` and runs its jobs over ``servers``: ``jobs_per_server`` in
    hand per server (one renders, the next waits in line for it; the two may be posted
    in either order), a storyboard's shots under the delivery policy one per server at
    most, so a shot starts only once the shots before it on that server have ended.

    ``store``: the result store (shared by every worker using the same servers).
    ``config``: retries, deadlines, leases (seconds). ``grace_s``: seconds running jobs
    get after a stop request before they are cancelled and requeued. ``workflows_dir``:
    where relative ``workflow`` paths of messages are resolved (never outside it).
    ``max_message_bytes``: a body larger than this is dead-lettered unparsed.
    ``health_file``: touched every ``heartbeat_s`` seconds while the worker runs
    (liveness), removed at exit. ``status_every_s``: seconds between the rows it writes
    for ``comfy-assets status`` (what each server of its pool renders, or why it is not
    used: ``render/publish.py``), taken out at its end.

    ``run()`` returns when the source has no more jobs and every job has finished, or
    after a stop request; ``counts`` then says what happened to each message (OUTCOMES).
    """

    source: JobSource
    _: KW_ONLY
    servers: Sequence[ServerSpec]
    store: Store
    config: BatchConfig
    grace_s: float = 60.0
    workflows_dir: Path = Path(".")
    max_message_bytes: int = MAX_MESSAGE_BYTES
    health_file: Path | None = None
    heartbeat_s: float = 5.0
    owner: str | None = None  # None: a new one (``new_owner``)
    results_every_s: float = 5.0
    status_every_s: float = EVERY_S
    jobs_per_server: int = JOBS_PER_SERVER

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("a worker needs at least one server")
        if self.jobs_per_server < 1:
            raise ValueError("jobs_per_server must be at least 1")
        self.servers = list(self.servers)
        self.workflows_dir = Path(self.workflows_dir)
        owner = self.owner or new_owner()
        self.owner = owner
        self._owner = owner  # the same, typed as set
        self.partition = self.source.partition
        self.counts: Counter[str] = Counter({name: 0 for name in OUTCOMES})
        self.consuming = asyncio.Event()  # set while messages are being taken
        self.stop_reason: str | None = None
        self._stop = asyncio.Event()
        self._stop_at = 0.0
        self._failure: BaseException | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.batches: set[Batch] = set()  # the running messages' batches (status rows)
        self._slots = asyncio.Semaphore(self.jobs_per_server * len(self.servers))
        self.owner_heartbeat: OwnerHeartbeat | None = None  # while ``run`` runs
        self.handler = MessageHandler(
            source=self.source,
            store=self.store,
            config=self.config,
            workflows_dir=self.workflows_dir,
            max_message_bytes=self.max_message_bytes,
            owner=owner,
            heartbeat=lambda: self.owner_heartbeat,
            counts=self.counts,
            batches=self.batches,
            shots=len(self.servers),
        )

    # -- control --------------------------------------------------------------------

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop taking messages; running jobs get ``grace_s`` seconds from the first
        request. Later requests change nothing (the promised grace stands) and are
        logged. Safe to call from a signal handler installed with
        ``loop.add_signal_handler``."""
        now = asyncio.get_running_loop().time()
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop_at = now
            self._stop.set()
            running = len(self.handler.runs)
            log.info(
                "%s: stopping; no new messages, %d running job%s get up to %g s",
                reason,
                running,
                "" if running == 1 else "s",
                self.grace_s,
            )
            return
        left = max(0.0, self._stop_at + self.grace_s - now)
        log.warning(
            "%s: second signal received; still waiting up to %.0f s for running jobs",
            reason,
            left,
        )

    def _fail(self, exc: BaseException) -> None:
        """Stop the worker because of ``exc``; ``run()`` raises it after the shutdown."""
        if self._failure is None:
            self._failure = exc
        if not self._stop.is_set():  # a later error is logged where it happened
            self.request_stop(f"error: {exc}")

    def _broker_lost(self, why: str) -> None:
        self._fail(broker.BrokerError(why))

    # -- the service ----------------------------------------------------------------

    async def run(self) -> None:
        """Consume until the source is exhausted (then wait for every job) or a stop is
        requested (then the grace rule). Raises what stopped the worker, if something
        failed: ``broker.BrokerError`` (connection lost, refused declaration or
        publication), ``StoreUnavailable`` (the store's database away longer than its
        budget; ``StoreDiskFull``: no room to write it), ``OSError`` (our disk: an output
        that cannot be written) or the exception of a message's handling, after the
        shutdown."""
        # Other workers, on any host, take this one's jobs only once this stops beating.
        owner_heartbeat = OwnerHeartbeat(self.store, self._owner)
        await off_loop(self.store, owner_heartbeat.start)
        try:
            await self._run(owner_heartbeat)
        finally:
            await off_loop(self.store, owner_heartbeat.stop)

    async def _run(self, owner_heartbeat: OwnerHeartbeat) -> None:
        self.owner_heartbeat = owner_heartbeat
        pool = make_pool(self.servers, self.store, self.config, self._owner)
        heartbeat: asyncio.Task[None] | None = None
        results: asyncio.Task[None] | None = None
        status: asyncio.Task[None] | None = None
        health_file = self.health_file
        outage = self.store.outage
        said = outage.consequence
        outage.consequence = "the worker takes no new message until it is back"
        async with pool:
            try:
                # A stop asked for while RabbitMQ is being reached needs no connection.
                opened, _ = await self._unless_stopped(
                    self.source.open(self.jobs_per_server * len(self.servers), self._broker_lost)
                )
                if opened and health_file is not None:
                    health_file.touch()  # fail now, not in the background
                    heartbeat = asyncio.create_task(self._heartbeat(health_file), name="heartbeat")
                    heartbeat.add_done_callback(self._background_done)
                if opened:
                    results = asyncio.create_task(
                        self._write_results(self.results_every_s), name="results"
                    )
                    rows = publish_servers(
                        self.store, self._owner, pool, self.batches, self.status_every_s
                    )
                    status = asyncio.create_task(rows, name="status rows")
                    status.add_done_callback(_status_rows_done)
                    await self._serve(pool)
            finally:
                outage.consequence = said
                self.consuming.clear()
                await self._cancel_all()
                if results is not None:
                    results.cancel()
                    await asyncio.wait({results})
                if status is not None:
                    status.cancel()
                    await asyncio.wait({status})
                    await self._clear_status_rows()
                self._flush_results()
                if heartbeat is not None and health_file is not None:
                    heartbeat.cancel()
                    await asyncio.wait({heartbeat})
                    health_file.unlink(missing_ok=True)
                await self.source.close()
        self._summary()
        if self._failure is not None:
            raise self._failure

    async def _serve(self, pool: Pool) -> None:
        """Take messages until the source ends or a stop, then wait for the running jobs
        (``_drain``). A failure to take messages stops the worker (``_fail``)."""
        try:
            # The servers' quarantines as they stand, before the first message is taken.
            await self._unless_stopped(pool.read_health())
            self.consuming.set()
            log.info(
                "worker %s: taking jobs of %s with %d server%s (%s)",
                self.owner,
                self.partition,
                len(self.servers),
                "" if len(self.servers) == 1 else "s",
                ", ".join(s.name for s in self.servers),
            )
            await self._consume(pool)
            self.consuming.clear()
            await self.source.stop_taking()
        except StoreUnavailable as e:
            # Away past its budget: said in the stop line; run() raises it.
            self._fail(e)
        except Exception as e:
            # Running jobs still get their grace; run() raises this at the end.
            log.error("worker: taking messages failed: %r", e, exc_info=e)
            self._fail(e)
        await self._drain()

    def _summary(self) -> None:
        c = self.counts
        log.info(
            "worker %s: %d acked (%d done, %d done before, %d dead-lettered, %d dead before, "
            "%d invalid, %d stopped by the delivery policy, %d left to another holder, "
            "%d superseded by a newer take), %d requeued",
            self.owner,
            c["acked"],
            c["done"],
            c["done_before"],
            c["dead_lettered"],
            c["dead_before"],
            c["invalid"],
            c["stopped"],
            c["left_to_holder"],
            c["superseded"],
            c["requeued"],
        )

    async def _consume(self, pool: Pool) -> None:
        """Take messages, ``jobs_per_server`` per server at most in hand, until stopped
        or the source is exhausted."""
        while not self._stop.is_set():
            got, _ = await self._unless_stopped(self._slots.acquire())
            if not got:
                return
            if not await self._store_back():
                self._slots.release()
                return
            # A message taken now would only wait in hand for a quarantine to end.
            usable = pool.until_usable(self._say_unusable, self._say_usable)
            got, _ = await self._unless_stopped(usable)
            if not got:
                self._slots.release()
                return
            got, delivery = await self._unless_stopped(self.source.next())
            if delivery is None:
                self._slots.release()
                if got and not self._stop.is_set():
                    log.info("%s: no more jobs", self.partition)
                return
            try:
                # The database may have gone while we waited for this message.
                back = await self._store_back()
            except BaseException:
                self._slots.release()
                await self.handler.give_back(delivery)
                raise
            if self._stop.is_set() or not back:
                # Stopped while it arrived, or while the database was away.
                self._slots.release()
                await self.handler.give_back(delivery)
                return
            task = asyncio.create_task(self.handler.handle(delivery, pool))
            self._handlers.add(task)
            task.add_done_callback(self._handler_done)

    def _say_unusable(self, why: str) -> None:
        log.warning("worker %s: %s; taking no message until one is usable", self.owner, why)

    def _say_usable(self) -> None:
        log.info("worker %s: a server is usable again; taking messages", self.owner)

    async def _store_back(self) -> bool:
        """While the store's database is away, take no message: wait for it here, once,
        rather than in a handler per message. True once it answers (at once when it is
        not away), False if a stop is requested first; raises StoreUnavailable when it
        stays away longer than the store's budget (``Store.retry_s``)."""
        if not self.store.outage.away:
            return True
        back, _ = await self._unless_stopped(off_loop(self.store, self.store.ping))
        return back

    async def _unless_stopped(self, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Await ``aw`` unless a stop is requested first: (True, result) or (False, None)."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
            await asyncio.wait({task, stop})
        if task.cancelled():
            return False, None
        return True, task.result()

    async def _drain(self) -> None:
        """Wait for running jobs: all of them if the source just ran out; after a stop
        request, until ``grace_s`` after it, then cancel the rest (their handlers
        requeue the messages) and wait for their cleanup."""
        if self._handlers and not self._stop.is_set():
            await self._unless_stopped(asyncio.wait(set(self._handlers)))
        if not self._handlers:
            return
        loop = asyncio.get_running_loop()
        left = self._stop_at + self.grace_s - loop.time()
        if left > 0:
            log.info("waiting up to %.0f s for %d running jobs", left, len(self._handlers))
            await asyncio.wait(set(self._handlers), timeout=left)
        late = [h for h in self._handlers if not h.done()]
        if late:
            log.warning(
                "grace of %g s is over: cancelling %d running job%s (prompts interrupted, "
                "messages requeued)",
                self.grace_s,
                len(late),
                "" if len(late) == 1 else "s",
            )
            for handler in late:
                run = self.handler.runs.get(handler)
                # A handler still waiting for the store has no run yet: cancel it whole
                # (it requeues its message).
                (run or handler).cancel()
            await asyncio.wait(late)

    async def _cancel_all(self) -> None:
        """Cancel every handler still there (only when ``run`` itself is interrupted or
        failed) and wait for their cleanup."""
        left = [h for h in self._handlers if not h.done()]
        for handler in left:
            handler.cancel()
        if left:
            await asyncio.wait(left)

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._handlers.discard(task)
        self._slots.release()
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, StoreUnavailable | OSError):
            # The store (away past its budget, or full) or our disk: its message was
            # requeued, and the stop line says why; no traceback for what is not a bug.
            self._fail(exc)
        elif exc is not None:
            log.error("worker: a message's handling failed: %r", exc, exc_info=exc)
            self._fail(exc)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = cast(BaseException, task.exception())
            log.error("worker: %s failed: %r", task.get_name(), exc, exc_info=exc)
            self._fail(exc)

    async def _clear_status_rows(self) -> None:
        try:
            await off_loop(self.store, self.store.clear_live, self._owner)
        except StoreUnavailable as e:  # they go stale by themselves
            log.warning("status rows of worker %s not cleared: %s", self.owner, e)

    async def _heartbeat(self, path: Path) -> None:
        """Touch ``path`` every ``heartbeat_s`` seconds: proof the event loop turns."""
        while True:
            path.touch()
            await asyncio.sleep(self.heartbeat_s)

    # -- one message ----------------------------------------------------------------

    async def _write_results(self, every_s: float) -> None:
        """Write the results.csv of every partition a message touched, every ``every_s``
        seconds at most (and once more when the worker stops): the same table ``run``
        writes. A write reads only the segments whose jobs changed since the last one
        (``render.segments``) but joins every segment's bytes into the file, and a first
        write reads them all: a partition whose write took ``t`` seconds is written again
        no sooner than ``RESULTS_DUTY x t`` after it, so the worker spends at most
        ``1 / RESULTS_DUTY`` of its time on it. Off the event loop; while the store's
        database is away, left for later."""
        loop = asyncio.get_running_loop()
        due: dict[str, float] = {}  # partition -> loop time of its next write
        while True:
            await asyncio.sleep(every_s)
            now = loop.time()
            touched = self.handler.touched
            pending = sorted(p for p in touched if due.get(p, now) <= now)
            touched.difference_update(pending)
            try:
                while pending and not self.store.outage.away:
                    started = loop.time()
                    try:
                        await off_loop(self.store, self._write_partition_results, pending[0])
                    except (OSError, StoreError) as e:  # the database's or the files'
                        self.handler.touched.add(pending[0])  # tried again next time
                        self._results_not_written(pending[0], e)
                    took = loop.time() - started
                    due[pending.pop(0)] = loop.time() + RESULTS_DUTY * took
            finally:
                self.handler.touched.update(pending)

    def _flush_results(self) -> None:
        """The last write of the touched partitions' results.csv, when the worker stops."""
        touched, self.handler.touched = self.handler.touched, set()
        for partition in sorted(touched):
            if self.store.outage.away:
                path = results_location(self.store, partition)
                log.warning("%s not written: the store's database is away", path)
                continue
            try:
                self._write_partition_results(partition)
            except (OSError, StoreError) as e:  # the database's or the files'
                self._results_not_written(partition, e)

    def _write_partition_results(self, partition: str) -> None:
        """Write ``partition``'s results.csv, without the sample rows that only the
        Dagster assets show."""
        write_results(self.store, partition, sample=False)

    def _results_not_written(self, partition: str, error: BaseException) -> None:
        # write_csv's OSError may not name the file (a write cut short by a full disk).
        path = results_location(self.store, partition)
        log.warning("%s not written: %s", path, error)


def _status_rows_done(task: asyncio.Task[None]) -> None:
    """The status rows stopped, the jobs did not: said loudly, not raised."""
    if not task.cancelled() and task.exception() is not None:
        exc = cast(BaseException, task.exception())
        log.error("worker: status rows failed: %r", exc, exc_info=exc)


def job_messages(path: Path, max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, bytes]]:
    """Validate the job file at ``path`` (input files under the default ``InputRules()``)
    and return ``(job_id, body)`` per job, in file order: self-contained messages
    (``comfy_assets.service.messages``: the workflow and the input files' bytes inline, so
    a worker anywhere posts what was validated, under the same prompt_id as ``run``),
    under the file's stem as partition (as ``run`` names it) with the header's priority.
    Raises ``JobFileError`` listing every problem, a message over ``max_bytes`` bytes and
    an input taken from another job included (each on its line and field, found before
    any input file is read for a message); nothing is returned for a partly valid file.
    ``InputChanged`` when an input file changes meanwhile. Every body is held in the list:
    ``comfy-assets enqueue`` takes them a chunk at a time from
    ``service.queue_file.scan_queue_file`` instead, which also takes a partition, input
    rules and a priority of one's own.
    """
    return list(scan_queue_file(path, max_bytes).messages())
