"""Live event streams in process over a SQLite store: a client past ``--max-streams``
open streams gets 429 with ``Retry-After`` (another client still gets its own), and the
streams read the store only when their job has new events, woken by the one poller of
the API process, then end with the job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import ClientResponse

from comfy_assets.api.app import Limits
from comfy_assets.store import Store
from tests.api_support import api_client, auth, job_body, make_api
from tests.support import wait_until

pytestmark = pytest.mark.rabbitmq

STREAM = {"Accept": "text/event-stream"}


async def next_event(response: ClientResponse) -> tuple[str, dict[str, Any]]:
    """The next ``event:`` of a stream and its data (keep-alives skipped)."""
    kind = None
    while True:
        line = (await asyncio.wait_for(response.content.readline(), 30)).decode().strip()
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind is not None:
            return kind, json.loads(line[6:])


async def test_streams_are_capped_per_client_and_read_the_store_only_when_woken(
    store: Store, queue: str
) -> None:
    limits = Limits(
        max_input_bytes=1 << 16, max_message_bytes=1 << 18, max_body_bytes=1 << 19, max_streams=2
    )
    api = make_api(store, queue, limits=limits)
    api.changes.poll_s = 3600.0  # the test makes each look itself
    reads = {"events": 0}
    events = store.events

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads["events"] += 1
        return events(*args, **kwargs)

    store.events = counted  # type: ignore[method-assign]
    body = job_body()
    async with await api_client(api) as client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        url = f"/v1/jobs/{body['id']}/events"
        streams = [await client.get(url, headers={**auth(), **STREAM}) for _ in range(2)]
        for s in streams:
            assert s.status == 200
            assert await next_event(s) == ("transition", await _first(client, url))
        refused = await client.get(url, headers={**auth(), **STREAM})
        assert refused.status == 429 and refused.headers["Retry-After"] == "5"
        assert "--max-streams" in (await refused.json())["message"]
        assert (await client.get(url, headers=auth())).status == 200  # not a stream: served

        # Nothing changes: looking costs the streams nothing (a stream woken for
        # nothing would read once more than the two reads counted below).
        await wait_until(lambda: api.changes.looks > 0, 30, "the poller's first look")
        before, woken = reads["events"], api.changes.wakes
        for _ in range(3):
            await api.changes.look()
        assert api.changes.wakes == woken

        # A change wakes each stream once, which reads and sends it.
        store.note(body["id"], "a note for the streams")
        await api.changes.look()
        for s in streams:
            kind, data = await next_event(s)
            assert (kind, data["detail"]) == ("transition", "a note for the streams")
        assert reads["events"] == before + 2 and api.changes.wakes == woken + 2

        # The job ends (cancelled): each stream says so and ends, freeing its place.
        assert (await client.post(f"/v1/jobs/{body['id']}/cancel", headers=auth())).status == 200
        await api.changes.look()
        for s in streams:
            assert (await next_event(s))[0] == "transition"
            assert await next_event(s) == (
                "end",
                {"state": "failed_fatal", "reason": "cancelled by alice"},
            )
            assert (await s.content.read()).strip() == b""  # then the stream ends
        await wait_until(lambda: api.streams.open("alice") == 0, 30, "the streams to end")
        again = await client.get(url, headers={**auth(), **STREAM})
        assert again.status == 200  # an ended job's stream: its events, then its end
        again.close()


async def _first(client: Any, url: str) -> dict[str, Any]:
    listed = await (await client.get(url, headers=auth())).json()
    return listed["events"][0]
