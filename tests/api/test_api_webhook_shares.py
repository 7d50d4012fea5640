"""Webhook deliveries isolated per receiver and per client (over a SQLite store, receivers
on loopback): receivers of one client that accept and never answer hold at most their
share of deliveries (two each, four for the client), and another client's healthy
receiver gets its webhook while they hang."""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from comfy_assets.api.outbox import PER_CLIENT, PER_RECEIVER, Outbox
from comfy_assets.store import Store
from comfy_assets.store.api_jobs import ApiLedger
from tests.api.test_api_parts import _ended_job, _receiver
from tests.support import wait_until


async def test_hanging_receivers_hold_their_share_and_a_healthy_one_is_delivered(
    store: Store,
) -> None:
    connections: Counter[int] = Counter()  # port -> connections accepted, never answered
    hold = asyncio.Event()  # set at the end: the hanging receivers let go

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[writer.get_extra_info("sockname")[1]] += 1
        await hold.wait()
        writer.close()

    hanging = [await asyncio.start_server(hang, "127.0.0.1", 0) for _ in range(5)]
    ports = [server.sockets[0].getsockname()[1] for server in hanging]
    delivered = asyncio.Event()

    async def receive(request: web.Request) -> web.Response:
        delivered.set()
        return web.Response(status=204)

    runner, healthy_port = await _receiver(receive)
    ledger = ApiLedger(store)
    for port in ports:
        for _ in range(3):
            _ended_job(store, ledger, f"http://127.0.0.1:{port}/hook", client="bob")
    # Long enough that a hanging delivery never ends while the test runs.
    outbox = Outbox(
        ledger,
        b"k" * 32,
        partitions=["api-alice", "api-bob"],
        allow_private=True,
        timeout_s=600.0,
        poll_s=0.01,
    )
    task = asyncio.create_task(outbox.run())
    try:
        await wait_until(
            lambda: sum(connections.values()) >= PER_CLIENT, 30, "bob's receivers to hang"
        )
        job = _ended_job(store, ledger, f"http://127.0.0.1:{healthy_port}/hook")
        await asyncio.wait_for(delivered.wait(), 60)
        assert sum(connections.values()) == PER_CLIENT  # bob's share, not more
        assert max(connections.values()) <= PER_RECEIVER
        await wait_until(
            lambda: any(h.delivered_at is not None for h in ledger.webhooks(job)),
            30,
            "the delivery recorded",
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hold.set()
        for server in hanging:
            server.close()
            await server.wait_closed()
        await runner.cleanup()
