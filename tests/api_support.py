"""What the API's tests share: clients and their tokens, a job body, the API in process
(aiohttp's test server) over a store and the machine's RabbitMQ, a fresh queue."""

from __future__ import annotations

import base64
import copy
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aiohttp.test_utils import TestClient, TestServer

from comfy_assets.api.app import Api, Limits, make_app
from comfy_assets.api.publisher import Publisher
from comfy_assets.api.tokens import Clients
from comfy_assets.service import broker
from comfy_assets.store import Store
from comfy_assets.store.api_jobs import ApiLedger
from tests.conftest import IMAGE_WORKFLOW

AMQP = os.environ.get("COMFY_ASSETS_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789xx"}
KEY = b"a webhook secret of 32 bytes ok!"


def auth(client: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[client]}"}


def write_tokens(path: Path) -> Path:
    path.write_text("".join(f"{name}:{token}\n" for name, token in TOKENS.items()))
    return path


def job_body(job_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A valid request: the 4-node image workflow inline, one ``set``."""
    body: dict[str, Any] = {
        "id": job_id or str(uuid.uuid4()),
        "workflow": copy.deepcopy(IMAGE_WORKFLOW),
        "set": {"1.color": 16711680},
    }
    body.update(fields)
    return body


def data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@asynccontextmanager
async def fresh_queue(prefix: str = "test-api") -> AsyncIterator[str]:
    """A fresh queue name starting ``prefix``; the queue and its ``.dead`` are deleted at the
    end. Fails the test at once when RabbitMQ (``AMQP``) is unreachable."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    try:
        connection = await aio_pika.connect(AMQP, timeout=5)
    except OSError as e:
        pytest.fail(f"RabbitMQ unreachable at {AMQP}: {e!r}")
    await connection.close()
    yield name
    async with await aio_pika.connect(AMQP) as connection:
        channel = await connection.channel()
        for q in (name, broker.dead_queue_name(name)):
            await channel.queue_delete(q)


async def queued(queue_name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Take (and ack) every message of ``queue_name``."""
    messages = []
    async with await aio_pika.connect(AMQP) as connection:
        channel = await connection.channel()
        try:
            q = await channel.declare_queue(queue_name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return []  # never declared: nothing was published
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            messages.append(message)
    return messages


def make_api(store: Store, queue_name: str, **overrides: Any) -> Api:
    limits = overrides.pop(
        "limits",
        Limits(max_input_bytes=64 * 1024, max_message_bytes=256 * 1024, max_body_bytes=512 * 1024),
    )
    return Api(
        store=store,
        ledger=ApiLedger(store),
        publisher=Publisher(AMQP, queue_name),
        clients=Clients({t: n for n, t in TOKENS.items()}),
        limits=limits,
        **overrides,
    )


async def api_client(api: Api, *, background: bool = False) -> TestClient:
    client = TestClient(TestServer(make_app(api, background=background)))
    await client.start_server()
    return client
