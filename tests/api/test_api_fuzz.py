"""The OpenAPI document fuzzed against the API (schemathesis): for requests generated
from every operation, valid and not, the API never answers 5xx; every answer's status,
content type, headers and body are ones the document lists; a request the document
admits is never refused as invalid (positive data), and one it refuses is refused
(negative data)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings

from comfy_assets.api.app import Limits
from comfy_assets.api.openapi import document
from comfy_assets.jobs.strict_json import CONTROL_CHARACTERS, UNTAKEABLE
from comfy_assets.service import broker
from comfy_assets.store import Store
from tests.api_support import AMQP, auth, make_api

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(600)]

schema = schemathesis.openapi.from_dict(document())


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API on a free loopback port, in a thread with its own event loop, over a
    SQLite store and a fresh queue (deleted at the end)."""
    queue = f"test-api-fuzz-{uuid.uuid4().hex[:10]}"
    store = Store(Path(tmp_path_factory.mktemp("fuzz")) / "store")
    started = threading.Event()
    loops: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    found: list[str] = []

    async def serve() -> None:
        from comfy_assets.api.app import make_app

        # No rate limit: a 429 would hide the answer a request is checked by.
        limits = Limits(
            max_input_bytes=64 * 1024,
            max_message_bytes=256 * 1024,
            max_body_bytes=512 * 1024,
            rate_per_s=1e9,
            burst=10**9,
        )
        runner = web.AppRunner(make_app(make_api(store, queue, limits=limits), background=False))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        found.append(f"http://127.0.0.1:{port}")
        done = asyncio.Event()
        loops.append((asyncio.get_running_loop(), done))
        started.set()
        try:
            await done.wait()
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(30), "the API did not start"
    yield found[0]
    loop, done = loops[0]
    loop.call_soon_threadsafe(done.set)
    thread.join(30)
    store.close()

    async def delete_queues() -> None:
        async with await aio_pika.connect(AMQP) as connection:
            channel = await connection.channel()
            for name in (queue, broker.dead_queue_name(queue)):
                await channel.queue_delete(name)

    asyncio.run(delete_queues())


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_every_answer_is_in_the_document(case: schemathesis.Case, base_url: str) -> None:
    if case.meta is not None and case.meta.generation.mode.is_positive:
        case.body = _referring(_takeable(case.body))
    case.call_and_validate(base_url=base_url, headers=auth())


def _takeable(value: Any) -> Any:
    """``value`` without the text no server or store takes, which JSON Schema cannot state
    for a free-form workflow (the document says it in words): no NUL or lone surrogate in
    any string (``UNTAKEABLE``), no control character in any key."""
    if isinstance(value, str):
        return UNTAKEABLE.sub("", value)
    if isinstance(value, list):
        return [_takeable(item) for item in value]
    if isinstance(value, dict):
        return {
            CONTROL_CHARACTERS.sub("", UNTAKEABLE.sub("", key)): _takeable(item)
            for key, item in value.items()
        }
    return value


def _referring(body: Any) -> Any:
    """A schema-valid job body whose ``set`` and ``inputs`` keys name literal inputs of
    its workflow's nodes: the one rule between fields that JSON Schema cannot state (the
    document says it in words). Each key is moved to an input of its own, added to a
    node whose id has no dot; the values are the generated ones."""
    if not isinstance(body, dict) or not isinstance(body.get("workflow"), dict):
        return body
    workflow = body["workflow"]
    node_id = next((n for n in workflow if "." not in n), None)
    if node_id is None:
        node_id = "fuzz"
        workflow[node_id] = {"class_type": "Fuzz", "inputs": {}}
    inputs = workflow[node_id]["inputs"]
    for field in ("set", "inputs"):
        given = body.get(field)
        if not isinstance(given, dict):
            continue
        moved = {}
        for i, value in enumerate(given.values()):
            name = f"{field}_{i}"
            inputs[name] = 0
            moved[f"{node_id}.{name}"] = value
        body[field] = moved
    return body
