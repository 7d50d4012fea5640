"""Webhooks: when a job with a ``webhook`` ends, a signed POST to it, from a durable
outbox, at least once, retried with exponential backoff for ``give_up_after_s`` (26 h).

The outbox is a table of the store (``comfy_api_webhooks``): each ending of a job (its
``finished_at``: a done record or a dead letter, and again after a requeue) becomes one
row, its ``webhook-id`` derived from the job and the ending, so an API restarted, or two
API processes, make it once. Deliveries run in the API process, apart from the requests
and from the workers, each receiver and each client within its own share: at most
``per_receiver`` at once to one receiver (the URL's scheme, host and port) and
``per_client`` at once for one client's jobs. A receiver that hangs or fails holds only
its share of sockets, ``timeout_s`` seconds each, and never a render; the due rows of a
receiver or client whose share is in use are left out of the outbox's look
(``ApiLedger.due_webhooks``), so however many of them wait, every other receiver's
deliveries start as soon as they are due. No redirect is
followed, the answer's body is not read, and the connection goes only to public
addresses unless ``--allow-private-webhooks`` (``webhook_urls.GuardedResolver``). Every
attempt is an event of the job (``webhook msg_... attempt 2 to https://host/path:
HTTP 503; next in 37 s``), shown by ``GET /v1/jobs/{id}/events`` and ``comfy-assets
events``.

The body is the Standard Webhooks shape ``{"type": "job.succeeded", "timestamp": ...,
"data": <the job as GET /v1/jobs/{id} answers it>}``, signed (``signing``). With an
object store its files' ``url`` are presigned GET URLs good until an hour after the
last attempt can be made (``Outbox.url_expiry_s``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from urllib.parse import urlsplit

import aiohttp

from comfy_assets.api import signing
from comfy_assets.api.views import iso, job_view
from comfy_assets.api.webhook_urls import GuardedResolver, delivery_problem
from comfy_assets.render.backoff import backoff_delay
from comfy_assets.store import JobRecord, Store, StoreUnavailable, off_loop
from comfy_assets.store.api_jobs import ApiJob, ApiLedger, Webhook
from comfy_assets.store.files import DEFAULT_URL_EXPIRY_S

log = logging.getLogger("comfy_assets.api.outbox")

WEBHOOK_NAMESPACE = uuid.UUID("6f1c2a7e-3f0e-5b5e-9d3c-0a4b7c9e2d11")
GIVE_UP_AFTER_S = 26 * 3600.0
BASE_DELAY_S = 5.0
MAX_DELAY_S = 3600.0
# Seconds an attempt holds its row: longer than any attempt takes, so two API processes
# never deliver it at once, and short enough that a process killed mid-attempt loses
# little time.
HOLD_S = 120.0
# Deliveries at once to one receiver, and for one client's jobs.
PER_RECEIVER = 2
PER_CLIENT = 4
# Seconds between looks at every job with a webhook for an ending without one.
FULL_SCAN_S = 60.0
# The longest a presigned URL may be good for (S3 signs for a week at most).
MAX_URL_EXPIRY_S = 7 * 24 * 3600


def webhook_id(job_id: str, finished_at: float) -> str:
    """The ``webhook-id`` of one ending of a job: the same in every API process."""
    return "msg_" + uuid.uuid5(WEBHOOK_NAMESPACE, f"{job_id} {finished_at!r}").hex


def receiver_of(url: str) -> str:
    """The receiver a delivery's share is counted by: ``scheme://host:port`` of ``url``
    (lowercase, the scheme's port when none is given)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # refused at delivery (``delivery_problem``); counted as written
        port = None
    port = port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{port}"


def shown_url(url: str) -> str:
    """``url`` without its query and fragment, for events and logs (a query may carry a
    receiver's secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


@dataclass(eq=False)
class Outbox:
    """Makes and delivers webhooks (see the module docstring). ``key``: the HMAC key
    (``signing.load_key``); ``partitions``: the clients' (``tokens.partition_of``);
    ``allow_private``: call any address; ``per_receiver``, ``per_client``: deliveries
    at once to one receiver, for one client."""

    ledger: ApiLedger
    key: bytes
    _: KW_ONLY
    partitions: Sequence[str] = ()
    allow_private: bool = False
    timeout_s: float = 10.0
    per_receiver: int = PER_RECEIVER
    per_client: int = PER_CLIENT
    give_up_after_s: float = GIVE_UP_AFTER_S
    base_delay_s: float = BASE_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    poll_s: float = 0.5
    store: Store = field(init=False)
    _cursor: int | None = field(init=False, default=None)  # the last event looked at for endings
    _next_full_scan: float = field(init=False, default=0.0)
    _running: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    # Deliveries under way, by receiver and by client.
    _receivers: Counter[str] = field(init=False, default_factory=Counter)
    _clients: Counter[str] = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self.store = self.ledger.store
        self.partitions = list(self.partitions)

    @property
    def url_expiry_s(self) -> int:
        """Seconds the presigned file URLs of a webhook are good for: a body is made once
        and sent until ``give_up_after_s``, so its URLs last that long and the usual
        hour after the last attempt (at most ``MAX_URL_EXPIRY_S``)."""
        return min(MAX_URL_EXPIRY_S, int(self.give_up_after_s) + DEFAULT_URL_EXPIRY_S)

    async def run(self) -> None:
        """Forever: turn endings into outbox rows and deliver the rows that are due.
        A store away is waited for (logged once a round)."""
        connector = aiohttp.TCPConnector(resolver=GuardedResolver(self.allow_private), limit=64)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            try:
                while True:
                    try:
                        await self.make_webhooks()
                        await self.deliver_due(session)
                    except StoreUnavailable as e:
                        log.warning("webhooks: %s; trying again", e)
                    await asyncio.sleep(self.poll_s)
            finally:
                for task in self._running:
                    task.cancel()
                await asyncio.gather(*self._running, return_exceptions=True)

    async def make_webhooks(self) -> int:
        """An outbox row for each ending not yet given one; returns how many. The jobs
        are found among the events since the last look (a range of their primary key);
        every ``FULL_SCAN_S`` seconds, and first, among all jobs with a webhook, for
        endings written while no API ran or committed out of id order."""
        made = 0
        loop = asyncio.get_running_loop()
        if self._cursor is None or loop.time() >= self._next_full_scan:
            cursor = await off_loop(self.ledger, self.ledger.last_event_id)
            while endings := await off_loop(self.ledger, self.ledger.endings):
                for api, record in endings:
                    await self._make(api, record)
                made += len(endings)
            self._cursor = max(cursor, self._cursor or 0)
            self._next_full_scan = loop.time() + FULL_SCAN_S
            return made
        ids, self._cursor = await off_loop(
            self.ledger, self.ledger.ended_since, self._cursor, self.partitions
        )
        if ids:
            for api, record in await off_loop(self.ledger, self.ledger.endings, ids, len(ids)):
                await self._make(api, record)
                made += 1
        return made

    async def _make(self, api: ApiJob, record: JobRecord) -> None:
        assert record.finished_at is not None and api.webhook is not None
        files = await off_loop(self.store, self.store.files, api.job_id)
        attempts = await off_loop(self.store, self.store.attempts, api.job_id)
        data = job_view(api, record, files, attempts, self.store.file_store, self.url_expiry_s)
        payload = {
            "type": f"job.{record.state}",
            "timestamp": iso(record.finished_at),
            "data": data,
        }
        hook = Webhook(
            webhook_id=webhook_id(api.job_id, record.finished_at),
            job_id=api.job_id,
            url=api.webhook,
            payload=json.dumps(payload, separators=(",", ":")),
            created_at=self.ledger.now(),
            attempts=0,
            next_at=self.ledger.now(),
            delivered_at=None,
            given_up_at=None,
            last_error=None,
            receiver=receiver_of(api.webhook),
            client=api.client,
        )
        await off_loop(self.ledger, self.ledger.add_webhook, hook, record.finished_at)

    async def deliver_due(self, session: aiohttp.ClientSession) -> None:
        """Start an attempt for each due row this process can take within its
        receiver's and its client's share; returns without waiting for them."""
        full_receivers = [r for r, n in self._receivers.items() if n >= self.per_receiver]
        full_clients = [c for c, n in self._clients.items() if n >= self.per_client]
        due = await off_loop(
            self.ledger,
            self.ledger.due_webhooks,
            skip_receivers=full_receivers,
            skip_clients=full_clients,
        )
        for hook in due:
            receiver = hook.receiver or receiver_of(hook.url)
            client = hook.client or ""
            if self._receivers[receiver] >= self.per_receiver:
                continue
            if self._clients[client] >= self.per_client:
                continue
            if not await off_loop(self.ledger, self.ledger.take_webhook, hook, HOLD_S):
                continue  # another API process took it
            self._receivers[receiver] += 1
            self._clients[client] += 1
            task = asyncio.create_task(self._attempt(session, hook))
            self._running.add(task)
            task.add_done_callback(functools.partial(self._done, receiver, client))

    def _done(self, receiver: str, client: str, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        for counts, key in ((self._receivers, receiver), (self._clients, client)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook attempt failed: %r", task.exception(), exc_info=task.exception())

    async def _attempt(self, session: aiohttp.ClientSession, hook: Webhook) -> None:
        """POST ``hook`` once; record the outcome in its row and as an event."""
        body = hook.payload.encode()
        headers = signing.headers(self.key, hook.webhook_id, int(time.time()), body)
        # Refused here for good: the URL is what it was at submission, so it stays refused.
        refused = delivery_problem(hook.url, allow_private=self.allow_private)
        error: str | None = None if refused is None else f"not called: {refused}"
        if refused is None:
            try:
                async with session.post(
                    hook.url, data=body, headers=headers, allow_redirects=False
                ) as r:
                    if not 200 <= r.status < 300:
                        error = f"HTTP {r.status}"
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"[:500] if str(e) else type(e).__name__
        number = hook.attempts + 1
        what = f"webhook {hook.webhook_id} attempt {number} to {shown_url(hook.url)}"
        next_at: float | None = None
        if error is None:
            detail = f"{what}: delivered"
        elif refused is not None:
            detail = f"{what}: {error}; given up"
        elif self.ledger.now() - hook.created_at >= self.give_up_after_s:
            detail = f"{what}: {error}; given up after {self.give_up_after_s:g} s"
        else:
            delay = backoff_delay(number, base_s=self.base_delay_s, cap_s=self.max_delay_s)
            delay = max(delay, 0.1)
            next_at = self.ledger.now() + delay
            detail = f"{what}: {error}; next in {delay:.0f} s"
        await off_loop(
            self.ledger, self.ledger.webhook_tried, hook.webhook_id, error=error, next_at=next_at
        )
        await off_loop(self.store, self.store.note, hook.job_id, detail)
        log.info("job %s: %s", hook.job_id, detail)
