"""RabbitMQ plumbing (aio-pika): connect, declare the job queue and its dead-letter queue,
publish with publisher confirms.

Both queues are durable **quorum** queues (replicated, so a broker node lost does not lose
jobs); every message is persistent and a publish returns only once the broker confirmed
it, so ``enqueued N jobs`` means N jobs are stored. The job queue is declared with
``x-queue-type: quorum`` only: dead-lettering by the broker and a delivery limit are
better set as a policy (they can change without redeclaring the queue); see
docs/deployment.md. Dead letters of the worker go to ``<queue>.dead`` through the
default exchange, with the reason in the ``x-worker-reason`` header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractQueue,
    DeliveryMode,
)

# The broker URL from the environment (`enqueue`, `worker`): a password there does not
# show in `ps` as a --rabbitmq would.
RABBITMQ_URL_ENV = "COMFY_ASSETS_RABBITMQ_URL"
QUEUE_ARGUMENTS: dict[str, Any] = {"x-queue-type": "quorum"}
REASON_HEADER = "x-worker-reason"
# The reason rides in the content header frame, which must fit in one frame (128 KiB by
# default) with every other property; the full reason is in the store anyway.
MAX_REASON_CHARS = 4000
JSON = "application/json"


class BrokerError(Exception):
    """RabbitMQ refused something we need (a queue declared with other arguments, a
    publish the broker did not route or confirm); the message says what and why."""


def dead_queue_name(queue: str) -> str:
    """The dead-letter queue of ``queue``: ``<queue>.dead``."""
    return f"{queue}.dead"


async def connect(
    url: str, *, name: str = "comfy-assets", timeout_s: float = 10.0
) -> AbstractConnection:
    """Open a plain (not robust) connection to ``url`` (``amqp://user:pass@host:port/``).

    Not robust on purpose: after a reconnect the broker has already requeued our
    unacknowledged messages, so a worker must stop rather than ack on a new channel.
    ``name`` shows in the management UI. Raises ``BrokerError`` when the broker cannot
    be reached within ``timeout_s`` seconds, refuses the login, or the URL is not one
    (the URL in its message shows no password).
    """
    try:
        return await aio_pika.connect(
            url, timeout=timeout_s, client_properties={"connection_name": name}
        )
    except ValueError as e:  # yarl: "Port out of range 0-65535", "Invalid IPv6 URL"
        raise BrokerError(f"not a RabbitMQ URL: {safe_url(url)}: {e}") from e
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as e:
        raise BrokerError(f"cannot connect to RabbitMQ at {safe_url(url)}: {e!r}") from e


async def open_channel(
    connection: AbstractConnection, *, prefetch: int | None = None
) -> AbstractChannel:
    """A channel with publisher confirms, where an unroutable publish raises.

    ``prefetch``: at most that many unacknowledged messages delivered to each consumer
    of this channel (None: no limit, for publishers).
    """
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    if prefetch is not None:
        await channel.set_qos(prefetch_count=prefetch)
    return channel


async def declare_queues(
    channel: AbstractChannel, queue: str
) -> tuple[AbstractQueue, AbstractQueue]:
    """Declare ``queue`` and ``<queue>.dead``, both durable quorum queues; returns both.

    Idempotent. Raises ``BrokerError`` if either exists with other arguments (a classic
    queue of that name, say): RabbitMQ closes the channel then, so open a new one.
    """
    declared = []
    for name in (queue, dead_queue_name(queue)):
        try:
            declared.append(
                await channel.declare_queue(name, durable=True, arguments=dict(QUEUE_ARGUMENTS))
            )
        except aio_pika.exceptions.ChannelPreconditionFailed as e:
            raise BrokerError(
                f"queue {name!r} exists with other arguments than a durable quorum queue "
                f"({e}); delete it or choose another --queue"
            ) from e
    return declared[0], declared[1]


def job_message(body: bytes, job_id: str) -> aio_pika.Message:
    """A persistent JSON message carrying one job line; ``message_id`` is the job id."""
    return aio_pika.Message(
        body, message_id=job_id, content_type=JSON, delivery_mode=DeliveryMode.PERSISTENT
    )


def dead_message(
    body: bytes,
    reason: str,
    *,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> aio_pika.Message:
    """The dead letter of a message: the original ``body``, ``message_id`` and ``headers``
    plus ``x-worker-reason`` (cut to ``MAX_REASON_CHARS`` characters)."""
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    return aio_pika.Message(
        body,
        message_id=message_id,
        content_type=JSON,
        delivery_mode=DeliveryMode.PERSISTENT,
        headers={**(headers or {}), REASON_HEADER: reason},
    )


async def publish(channel: AbstractChannel, queue: str, message: aio_pika.Message) -> None:
    """Publish ``message`` to ``queue`` through the default exchange and wait for the
    broker's confirm. Raises ``BrokerError`` if the broker nacks it or cannot route it
    (no such queue); connection errors propagate as aio-pika raises them."""
    try:
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)
    except aio_pika.exceptions.PublishError as e:
        raise BrokerError(f"RabbitMQ returned a message for {queue!r}: no such queue") from e
    except aio_pika.exceptions.DeliveryError as e:
        raise BrokerError(f"RabbitMQ refused a message for {queue!r}: {e.frame}") from e


async def publish_jobs(
    channel: AbstractChannel, queue: str, jobs: Iterable[tuple[str, bytes]], *, window: int = 256
) -> int:
    """Publish ``(job_id, body)`` pairs to ``queue``, at most ``window`` awaiting their
    confirm at a time (one at a time would take a round trip per job). Returns the count.
    Raises ``BrokerError`` on the first refused message; messages before it may be
    stored, so publishing the same file again is safe (jobs are idempotent) and the way
    to finish.
    """
    count = 0
    pending: set[asyncio.Task[None]] = set()
    try:
        for job_id, body in jobs:
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            pending.add(asyncio.create_task(publish(channel, queue, job_message(body, job_id))))
            count += 1
        for published in asyncio.as_completed(pending):
            await published
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return count


async def enqueue(url: str, queue: str, jobs: Iterable[tuple[str, bytes]]) -> int:
    """Connect, declare ``queue`` and ``<queue>.dead``, publish every ``(job_id, body)``
    with confirms, close. Returns how many were published; raises ``BrokerError``."""
    connection = await connect(url, name=f"comfy-assets enqueue {queue}")
    async with connection:
        channel = await open_channel(connection)
        await declare_queues(channel, queue)
        return await publish_jobs(channel, queue, jobs)


def safe_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (``amqp://render:***@rabbit:5672/``),
    for messages and logs."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"
