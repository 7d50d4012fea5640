"""Where the worker's jobs come from: a RabbitMQ queue, an in-memory asyncio queue (tests,
embedding) or a job file. One small interface for all three.

A ``JobSource`` hands out ``Delivery`` objects, one job each; the worker answers each with
exactly one of ``ack()`` (finished), ``dead_letter(reason)`` then ``ack()`` (given up), or
``requeue()`` (not finished here: give it to another worker). ``next()`` returns None when
the source has nothing more to give: a job file read to its end, or ``stop_taking()``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
    ConsumerTag,
)

from comfy_assets.jobs.model import Job, JobFile, Policy
from comfy_assets.service import broker

log = logging.getLogger("comfy_assets.service.sources")

# Called once if the source breaks while in use (RabbitMQ connection or channel lost);
# the argument says what happened.
OnLost = Callable[[str], None]


class Delivery(ABC):
    """One job handed to the worker.

    ``body``: the message as sent (one job of JSON, ``comfy_assets.service.messages``; empty for
    a job file's job, which comes already validated as ``job``, with its file's header
    ``policy``). ``message_id``: the publisher's id (the job id for ``comfy-assets
    enqueue``), None if unset. ``redelivered``: an earlier delivery of this message was
    not acknowledged (a worker died or gave it back).
    """

    body: bytes
    message_id: str | None
    redelivered: bool
    job: Job | None
    policy: Policy | None = None

    @abstractmethod
    async def ack(self) -> None:
        """The job is finished here (done, or dead-lettered and published)."""

    @abstractmethod
    async def requeue(self) -> None:
        """Give the job back for another delivery (shutdown before it finished)."""

    @abstractmethod
    async def dead_letter(self, reason: str) -> None:
        """Publish the message to the dead-letter destination with ``reason``. Does not
        ack: the worker acks after this returned, so a crash in between repeats the
        publication rather than losing it."""


class JobSource(ABC):
    """A stream of deliveries. ``partition`` names the store partition of its jobs;
    ``dead_destination`` says where dead letters go, for log lines."""

    partition: str
    dead_destination: str

    @abstractmethod
    async def open(self, prefetch: int, on_lost: OnLost) -> None:
        """Start: hold at most ``prefetch`` unacknowledged deliveries at a time.
        ``on_lost`` is called if the source breaks later."""

    @abstractmethod
    async def next(self) -> Delivery | None:
        """The next delivery, waiting for one; None when there will be no more."""

    @abstractmethod
    async def stop_taking(self) -> None:
        """Take no more jobs: deliveries not yet handed out go back, ``next()`` returns
        None from now on. Deliveries already handed out stay valid."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything (connections). Deliveries not answered go back."""


# --- RabbitMQ ------------------------------------------------------------------------


class RabbitDelivery(Delivery):
    """A message from RabbitMQ, acknowledged on the channel it came from."""

    def __init__(self, message: AbstractIncomingMessage, source: RabbitSource) -> None:
        self.message = message
        self.source = source
        self.body = message.body
        self.message_id = message.message_id
        self.redelivered = bool(message.redelivered)
        self.job = None

    async def ack(self) -> None:
        """Basic.ack. Raises ``broker.BrokerError`` if the channel is gone (the broker
        has then requeued the message already)."""
        self.source.check_open("ack")
        await self.message.ack()

    async def requeue(self) -> None:
        """Basic.nack with requeue. If the channel is already gone the broker requeued
        the message when it closed, so there is nothing left to do."""
        if self.source.channel_closed:
            log.warning(
                "message %s: channel already closed; the broker requeued it", self.message_id
            )
            return
        await self.message.nack(requeue=True)

    async def dead_letter(self, reason: str) -> None:
        """Publish the original body, message_id and headers plus ``x-worker-reason`` to
        ``<queue>.dead`` and wait for the broker's confirm."""
        self.source.check_open("dead-letter")
        headers: Mapping[str, Any] = dict(self.message.headers or {})
        message = broker.dead_message(
            self.body, reason, message_id=self.message_id, headers=headers
        )
        await broker.publish(self.source.channel, self.source.dead_queue, message)


class RabbitSource(JobSource):
    """Consumes ``queue`` (a durable quorum queue, declared with ``<queue>.dead``) with
    manual acks and ``prefetch_count`` = the worker's capacity."""

    def __init__(self, url: str, queue: str, *, name: str = "comfy-assets worker") -> None:
        self.url = url
        self.queue_name = queue
        self.partition = queue
        self.dead_queue = broker.dead_queue_name(queue)
        self.dead_destination = self.dead_queue
        self.name = name
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._tag: ConsumerTag | None = None
        self._buffer: asyncio.Queue[RabbitDelivery | None] = asyncio.Queue()
        self._taking = False
        self._closing = False
        self._on_lost: OnLost | None = None
        self.lost: str | None = None

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("RabbitSource used before open()")
        return self._channel

    @property
    def channel_closed(self) -> bool:
        return self._channel is None or self._channel.is_closed

    def check_open(self, what: str) -> None:
        """Raise ``broker.BrokerError`` if the channel is closed (so ``what`` is lost)."""
        if self.channel_closed:
            why = self.lost or "closed"
            raise broker.BrokerError(
                f"cannot {what} on queue {self.queue_name!r}: channel {why}; "
                "the broker has requeued the message"
            )

    async def open(self, prefetch: int, on_lost: OnLost) -> None:
        """Connect, declare both queues, set ``prefetch_count`` and start consuming.
        Raises ``broker.BrokerError`` (unreachable, refused declaration)."""
        self._on_lost = on_lost
        self._connection = await broker.connect(self.url, name=f"{self.name} {self.queue_name}")
        self._connection.close_callbacks.add(self._closed)
        self._channel = await broker.open_channel(self._connection, prefetch=prefetch)
        self._channel.close_callbacks.add(self._closed)
        self._queue, _ = await broker.declare_queues(self._channel, self.queue_name)
        self._taking = True
        self._tag = await self._queue.consume(self._on_message)
        log.info(
            "consuming queue %s (prefetch %d, dead letters to %s)",
            self.queue_name,
            prefetch,
            self.dead_queue,
        )

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        if not self._taking:
            # Arrived between our Basic.Cancel and its CancelOk: give it straight back.
            await message.nack(requeue=True)
            return
        self._buffer.put_nowait(RabbitDelivery(message, self))

    def _closed(self, _sender: object, exc: BaseException | None = None) -> None:
        if self._closing or self.lost:
            return
        self.lost = f"lost: {exc!r}" if exc else "lost"
        log.error("queue %s: connection %s", self.queue_name, self.lost)
        self._taking = False
        self._buffer.put_nowait(None)  # wake next()
        if self._on_lost:
            self._on_lost(f"RabbitMQ connection {self.lost}")

    async def next(self) -> RabbitDelivery | None:
        """The next message (waits); None once ``stop_taking()`` ran or the connection
        was lost."""
        if not self._taking and self._buffer.empty():
            return None
        item = await self._buffer.get()
        if item is None:
            self._buffer.put_nowait(None)  # every later call returns None too
        return item

    async def stop_taking(self) -> None:
        """Basic.Cancel our consumer, then nack (requeue) what was delivered but not
        handed out."""
        self._taking = False
        if self._tag is not None and self._queue is not None and not self.channel_closed:
            await self._queue.cancel(self._tag)
        self._tag = None
        while not self._buffer.empty():
            item = self._buffer.get_nowait()
            if item is not None:
                await item.requeue()
        self._buffer.put_nowait(None)

    async def close(self) -> None:
        """Close the channel and the connection (unanswered messages go back)."""
        self._closing = True
        self._taking = False
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()


# --- in memory -----------------------------------------------------------------------


class MemoryDelivery(Delivery):
    """A job from a ``MemorySource``; its answers are recorded on the source."""

    def __init__(
        self, source: MemorySource, body: bytes, message_id: str | None, count: int
    ) -> None:
        self.source = source
        self.body = body
        self.message_id = message_id
        self.redelivered = count > 1
        self.job = None
        self.answered = False

    def _answer(self) -> None:
        if self.answered:
            raise RuntimeError(f"message {self.message_id}: answered twice")
        self.answered = True

    async def ack(self) -> None:
        """Record the ack in ``source.acked``."""
        self._answer()
        self.source.acked.append(self.body)

    async def requeue(self) -> None:
        """Put the message back at the end of the queue (recorded in ``source.requeued``)."""
        self._answer()
        self.source.requeued.append(self.body)
        self.source._put(self.body, self.message_id)

    async def dead_letter(self, reason: str) -> None:
        """Record ``(body, reason)`` in ``source.dead``."""
        self.source.dead.append((self.body, reason))


class MemorySource(JobSource):
    """An asyncio queue of message bodies, for tests and for embedding the worker.

    ``put()`` adds a message; ``end()`` says no more will come (``next()`` then returns
    None once the queue is empty). Answers are recorded: ``acked`` (bodies),
    ``requeued`` (bodies), ``dead`` ((body, reason) pairs).
    """

    def __init__(self, partition: str = "memory") -> None:
        self.partition = partition
        self.dead_destination = f"{partition} (in memory)"
        self._queue: asyncio.Queue[tuple[bytes, str | None] | None] = asyncio.Queue()
        self._deliveries: dict[bytes, int] = {}
        self._taking = True
        self.acked: list[bytes] = []
        self.requeued: list[bytes] = []
        self.dead: list[tuple[bytes, str]] = []

    def put(self, message: bytes | str | Mapping[str, Any], message_id: str | None = None) -> None:
        """Add one message: bytes as is, str as UTF-8, a mapping as JSON (its ``id`` is
        the default ``message_id``)."""
        if isinstance(message, Mapping):
            message_id = message_id or (
                message.get("id") if isinstance(message.get("id"), str) else None
            )
            body = json.dumps(message).encode()
        elif isinstance(message, str):
            body = message.encode()
        else:
            body = message
        self._put(body, message_id)

    def _put(self, body: bytes, message_id: str | None) -> None:
        self._queue.put_nowait((body, message_id))

    def end(self) -> None:
        """No more messages: ``next()`` returns None once the queue is drained."""
        self._queue.put_nowait(None)

    async def open(self, prefetch: int, on_lost: OnLost) -> None:
        """Nothing to connect; the worker's own limit bounds what it takes."""

    async def next(self) -> MemoryDelivery | None:
        if not self._taking:
            return None
        item = await self._queue.get()
        if item is None or not self._taking:
            if item is not None:
                self._queue.put_nowait(item)  # stopped while waiting: leave it queued
            self._taking = False
            return None
        body, message_id = item
        count = self._deliveries[body] = self._deliveries.get(body, 0) + 1
        return MemoryDelivery(self, body, message_id, count)

    async def stop_taking(self) -> None:
        self._taking = False
        self._queue.put_nowait(None)  # wake a waiting next()

    async def close(self) -> None:
        self._taking = False


# --- a job file ----------------------------------------------------------------------


class FileDelivery(Delivery):
    """One job of a job file. The store is the only record here: a dead letter is its
    failed_fatal row, a requeue leaves the job pending for the next run of the file."""

    def __init__(self, source: FileSource, job: Job) -> None:
        self.source = source
        self.job = job
        self._job = job  # the same, typed as set
        self.policy = source.job_file.policy
        self.body = b""
        self.message_id = job.id
        self.redelivered = False

    async def ack(self) -> None:
        self.source.acked.append(self._job.id)

    async def requeue(self) -> None:
        self.source.requeued.append(self._job.id)

    async def dead_letter(self, reason: str) -> None:
        self.source.dead.append((self._job.id, reason))


class FileSource(JobSource):
    """The jobs of a loaded (so already validated) job file, in line order."""

    def __init__(self, job_file: JobFile, partition: str | None = None) -> None:
        self.job_file = job_file
        self.partition = partition or job_file.path.stem
        self.dead_destination = "the store's dead letters"
        self._pending = list(reversed(job_file.jobs))
        self._taking = True
        self.acked: list[str] = []
        self.requeued: list[str] = []
        self.dead: list[tuple[str, str]] = []

    async def open(self, prefetch: int, on_lost: OnLost) -> None:
        """Nothing to open: the file was read and validated by ``load_job_file``."""

    async def next(self) -> FileDelivery | None:
        if not self._taking or not self._pending:
            return None
        return FileDelivery(self, self._pending.pop())

    async def stop_taking(self) -> None:
        self._taking = False

    async def close(self) -> None:
        self._taking = False
