"""The API under a hostile client's headers and a shared farm: numbers of any length in
``Range`` and ``Last-Event-ID`` answered 416 or 400 (never 500), the API's description
open without a token while every job route still needs one, and ``GET /v1/servers``
showing one client no other client's failure reasons."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from comfy_assets.store import OutputFile, Store
from tests.api_support import api_client, auth, job_body, make_api

pytestmark = pytest.mark.rabbitmq

HUGE = "9" * 5000


async def test_ranges_and_event_ids_of_any_length_are_answered_in_bounds(
    store: Store, queue: str
) -> None:
    client = await api_client(make_api(store, queue))
    body = job_body()
    data = bytes(range(256)) * 4
    async with client:
        assert (await client.post("/v1/jobs", json=body, headers=auth())).status == 202
        folder = store.job_dir("api-alice", body["id"])
        folder.mkdir(parents=True)
        (folder / "solid_00001_.png").write_bytes(data)
        assert store.claim(body["id"], "test-owner") == "claimed"
        sha = hashlib.sha256(data).hexdigest()
        store.mark_done(
            body["id"], "test-owner", files=[OutputFile("solid_00001_.png", sha, len(data))]
        )
        url = f"/v1/jobs/{body['id']}/files/solid_00001_.png"

        async def get(range_header: str) -> tuple[int, bytes, str | None]:
            answer = await client.get(url, headers={**auth(), "Range": range_header})
            return answer.status, await answer.read(), answer.headers.get("Content-Range")

        assert await get(f"bytes={HUGE}-") == (416, b"", f"bytes */{len(data)}")
        # Two of 5000 digits are over aiohttp's 8190 bytes a header (400 before us).
        long = HUGE[:4000]
        assert await get(f"bytes={long}-{long}") == (416, b"", f"bytes */{len(data)}")
        # A last byte past the end is the end; the last HUGE bytes are the whole file.
        assert await get(f"bytes=1000-{HUGE}") == (206, data[1000:], "bytes 1000-1023/1024")
        assert await get(f"bytes=-{HUGE}") == (206, data, "bytes 0-1023/1024")
        assert await get(f"bytes={'0' * 5000}5-6") == (206, data[5:7], "bytes 5-6/1024")

        events = f"/v1/jobs/{body['id']}/events"
        stream = {**auth(), "Accept": "text/event-stream"}
        for bad in (HUGE, "-1", "x", str(2**63)):
            answer = await client.get(events, headers={**stream, "Last-Event-ID": bad})
            assert answer.status == 400
            message = (await answer.json())["message"]
            assert message == "Last-Event-ID: expected an event id (an integer)"
        # The job has ended: a stream resumed after its last event holds only the end.
        resumed = await client.get(events, headers={**stream, "Last-Event-ID": str(2**63 - 1)})
        assert resumed.status == 200
        text = (await resumed.text()).strip()
        assert text.startswith("event: end") and "transition" not in text


async def test_huge_content_length_is_refused_before_the_body(store: Store, queue: str) -> None:
    client = await api_client(make_api(store, queue))
    async with client:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        token = auth()["Authorization"]
        writer.write(
            f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {HUGE}\r\n\r\n{{}}".encode()
        )
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
    assert status_line.split()[1] == b"400", status_line


async def test_the_description_opens_without_a_token_and_jobs_do_not(
    store: Store, queue: str
) -> None:
    client = await api_client(make_api(store, queue))
    async with client:
        document = await client.get("/openapi.json")
        assert document.status == 200 and (await document.json())["paths"]["/v1/jobs"]
        page = await client.get("/docs")
        assert page.status == 200 and "/v1/jobs" in await page.text()
        assert (await client.post("/v1/jobs", json=job_body())).status == 401
        assert (await client.get(f"/v1/jobs/{job_body()['id']}")).status == 401
        assert (await client.get("/v1/servers")).status == 401


async def test_a_client_sees_servers_health_but_only_its_own_jobs_failures(
    store: Store, queue: str
) -> None:
    client = await api_client(make_api(store, queue))
    alice_job, bob_job = job_body(), job_body()
    async with client:
        assert (await client.post("/v1/jobs", json=alice_job, headers=auth())).status == 202
        assert (await client.post("/v1/jobs", json=bob_job, headers=auth("bob"))).status == 202
        for job, reason in (
            (alice_job, "alice's cat.png: CUDA error"),
            (bob_job, "bob's secret-plan.png: CUDA error"),
        ):
            store.server_failed("gpu0", job["id"], "sha", "CUDA error", reason, infrastructure=True)

        async def health(who: str) -> dict:
            answer = await client.get("/v1/servers", headers=auth(who))
            assert answer.status == 200
            [gpu0] = [s for s in (await answer.json())["servers"] if s["name"] == "gpu0"]
            return gpu0["store_health"]

        seen_by_alice, seen_by_bob = await health("alice"), await health("bob")
    assert seen_by_alice["strikes"] == seen_by_bob["strikes"] == 2
    assert seen_by_alice["state"] == seen_by_bob["state"]
    assert seen_by_alice["failures"] == [
        {"job_id": alice_job["id"], "reason": "alice's cat.png: CUDA error"}
    ]
    assert seen_by_bob["failures"] == [
        {"job_id": bob_job["id"], "reason": "bob's secret-plan.png: CUDA error"}
    ]
    assert "secret-plan" not in str(seen_by_alice) and "cat.png" not in str(seen_by_bob)
