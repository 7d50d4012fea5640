"""The API over a store whose files are not on its disk (``LinkedFileStore``, the stand-in
for an object store): a job's ``files[].url`` is a presigned GET URL, ``GET
/v1/jobs/{id}/files/{name}`` redirects there (307; no bytes through the API) and a
client following it gets the bytes and ranges, ``HEAD`` and ``If-None-Match`` are
answered by the API, and a webhook carries presigned URLs good for as long as it may be
sent."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from comfy_assets.api.outbox import Outbox
from comfy_assets.api.submission import parse_submission
from comfy_assets.store import OutputFile, Store
from comfy_assets.store.api_jobs import ApiJob, ApiLedger
from tests.api_support import api_client, auth, job_body, make_api
from tests.file_store_support import REQUESTS, LinkedFileStore, serve_links
from tests.support import wait_until

pytestmark = pytest.mark.rabbitmq

DATA = bytes(range(256)) * 40
SHA = hashlib.sha256(DATA).hexdigest()
NAME = "video/clip_00001_.mp4"


def _done_job(store: Store, objects: LinkedFileStore, webhook: str | None = None) -> str:
    """A job of alice's, done with the one output NAME (DATA) in the object store."""
    sub = parse_submission(
        job_body(), partition="api-alice", max_input_bytes=10, max_message_bytes=10**6
    )
    ledger = ApiLedger(store)
    ledger.take(
        ApiJob(sub.job.id, "alice", sub.content, sub.message, webhook, store.now()),
        "api-alice",
        sub.job,
    )
    objects.folder.write_file(f"api-alice/{sub.job.id}/{NAME}", DATA, "video/mp4")
    assert store.claim(sub.job.id, "test-owner") == "claimed"
    store.mark_done(sub.job.id, "test-owner", files=[OutputFile(NAME, SHA, len(DATA))])
    return sub.job.id


async def test_files_are_presigned_urls_and_the_api_redirects_to_them(
    store: Store, queue: str, tmp_path: Path
) -> None:
    objects = LinkedFileStore(tmp_path / "bucket")
    store.file_store = objects  # type: ignore[attr-defined]
    links = await serve_links(objects)
    job_id = _done_job(store, objects)
    client = await api_client(make_api(store, queue))
    try:
        async with client:
            view = await (await client.get(f"/v1/jobs/{job_id}", headers=auth())).json()
            [entry] = view["files"]
            assert entry["name"] == NAME and entry["sha256"] == SHA
            url = entry["url"]
            assert url.startswith(objects.base_url) and "X-Amz-Signature=" in url
            async with aiohttp.ClientSession() as plain:  # no token: the URL is the key
                async with plain.get(url) as got:
                    assert got.status == 200 and await got.read() == DATA

            link = f"/v1/jobs/{job_id}/files/{NAME}"
            moved = await client.get(link, headers=auth(), allow_redirects=False)
            assert moved.status == 307
            assert moved.headers["Location"].startswith(f"{objects.base_url}/api-alice/{job_id}/")
            assert moved.headers["ETag"] == f'"{SHA}"'
            assert "no-store" in moved.headers["Cache-Control"]
            assert await moved.read() == b""  # no bytes through the API
            followed = await client.get(link, headers=auth())
            assert followed.status == 200 and await followed.read() == DATA
            part = await client.get(link, headers={**auth(), "Range": "bytes=10-19"})
            assert part.status == 206 and await part.read() == DATA[10:20]
            same = await client.get(
                link, headers={**auth(), "If-None-Match": f'"{SHA}"'}, allow_redirects=False
            )
            assert same.status == 304
            head = await client.head(link, headers=auth(), allow_redirects=False)
            assert head.status == 200 and head.headers["Content-Length"] == str(len(DATA))
            assert head.headers["Content-Type"] == "video/mp4"
            assert (await client.get(link, headers=auth("bob"))).status == 404
            other = f"/v1/jobs/{job_id}/files/other.png"
            assert (await client.get(other, headers=auth())).status == 404
    finally:
        await links.close()
    # What reached the object store's server: GETs only, never the API's token.
    requests = links.app[REQUESTS]
    assert {method for method, _, _ in requests} == {"GET"}
    assert all(authorization is None for _, _, authorization in requests)
    assert set(objects.expiries) == {3600}


async def test_a_webhook_carries_urls_good_until_its_last_attempt(
    store: Store, tmp_path: Path
) -> None:
    objects = LinkedFileStore(tmp_path / "bucket")
    store.file_store = objects  # type: ignore[attr-defined]
    links = await serve_links(objects)
    bodies: list[bytes] = []

    async def receive(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    job_id = _done_job(store, objects, f"http://127.0.0.1:{port}/hook")
    outbox = Outbox(ApiLedger(store), b"k" * 32, allow_private=True, poll_s=0.01)
    task = asyncio.create_task(outbox.run())
    try:
        await wait_until(lambda: bool(bodies), 30, "the webhook delivered")
        [url] = [f["url"] for f in json.loads(bodies[0])["data"]["files"]]
        assert url.startswith(f"{objects.base_url}/api-alice/{job_id}/")
        async with aiohttp.ClientSession() as plain, plain.get(url) as got:
            assert got.status == 200 and await got.read() == DATA
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
        await links.close()
    # Sent for up to 26 hours: its URLs last that and the usual hour more.
    assert objects.expiries == [26 * 3600 + 3600]
