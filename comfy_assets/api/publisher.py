"""Publishing the API's jobs to the queue, with publisher confirms, and again after a
crash.

One connection and one confirming channel per API process, opened again on the next
publish after the broker goes away. A job is published after its rows are in the store
and marked published once the broker confirmed it (``ApiLedger.mark_published``); a
process killed in between leaves it unmarked, and ``republish_loop`` of any API process
publishes it again. A job published twice is harmless: the worker renders a job once
whatever number of its messages arrive (claims, done records).
"""

from __future__ import annotations

import asyncio
import logging

from aio_pika.abc import AbstractChannel, AbstractConnection

from comfy_assets.service import broker
from comfy_assets.store import StoreUnavailable, off_loop
from comfy_assets.store.api_jobs import ApiLedger

log = logging.getLogger("comfy_assets.api.publisher")

# A job not confirmed this long after it was recorded is published again by the loop
# (a request still publishing it is given that long first).
REPUBLISH_AFTER_S = 10.0


class Publisher:
    """Publishes job messages to ``queue`` on the broker at ``url``."""

    def __init__(self, url: str, queue: str, *, timeout_s: float = 10.0) -> None:
        self.url = url
        self.queue = queue
        self.timeout_s = timeout_s
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def _open(self) -> AbstractChannel:
        async with self._lock:
            channel = self._channel
            if channel is not None and not channel.is_closed:
                return channel
            await self._drop()
            connection = await broker.connect(
                self.url, name=f"comfy-assets api {self.queue}", timeout_s=self.timeout_s
            )
            try:
                channel = await broker.open_channel(connection)
                await broker.declare_queues(channel, self.queue)
            except BaseException:
                await connection.close()
                raise
            self._connection, self._channel = connection, channel
            return channel

    async def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            try:
                await connection.close()
            except Exception as e:  # closing a broken connection: nothing more to do
                log.debug("closing the broker connection: %r", e)

    @property
    def connected(self) -> bool:
        """True while a channel to the broker is open."""
        return self._channel is not None and not self._channel.is_closed

    async def ensure(self) -> None:
        """Open the connection now (readiness). Raises ``broker.BrokerError``."""
        await self._open()

    async def publish(self, job_id: str, body: bytes) -> None:
        """Publish one job's message and wait for the broker's confirm (at most
        ``timeout_s`` seconds). Raises ``broker.BrokerError`` when the broker cannot be
        reached, refuses the message or does not confirm it in time."""
        channel = await self._open()
        try:
            await asyncio.wait_for(
                broker.publish(channel, self.queue, broker.job_message(body, job_id)),
                self.timeout_s,
            )
        except broker.BrokerError:
            raise
        except (TimeoutError, OSError, RuntimeError, Exception) as e:
            await self._drop()
            raise broker.BrokerError(f"RabbitMQ did not confirm job {job_id}: {e!r}") from e

    async def close(self) -> None:
        """Close the connection."""
        async with self._lock:
            await self._drop()


async def publish_recorded(
    ledger: ApiLedger, publisher: Publisher, job_id: str, body: bytes, take: int
) -> None:
    """Publish a job whose rows are in the store (its message of take ``take``), then
    mark it published if its row is still of that take. Raises ``broker.BrokerError``
    (it stays unmarked: published again later) and ``StoreUnavailable``."""
    await publisher.publish(job_id, body)
    await off_loop(ledger, ledger.mark_published, job_id, True, take)


async def republish_loop(ledger: ApiLedger, publisher: Publisher, every_s: float = 2.0) -> None:
    """Forever: publish the jobs recorded more than ``REPUBLISH_AFTER_S`` seconds ago
    that no confirm was noted for (an API killed between the store and the broker, a
    broker away during a request). Failures are logged and tried again next round."""
    while True:
        try:
            due = await off_loop(ledger, ledger.unpublished, ledger.now() - REPUBLISH_AFTER_S)
            for job in due:
                await publish_recorded(ledger, publisher, job.job_id, job.message, job.take)
                log.info("job %s: published again (no confirm was recorded)", job.job_id)
        except (broker.BrokerError, StoreUnavailable) as e:
            log.warning("publishing unconfirmed jobs again: %s; trying again", e)
        await asyncio.sleep(every_s)
