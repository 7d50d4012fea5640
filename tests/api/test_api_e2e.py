"""The API end to end with real parts: ``comfy-assets api`` and ``comfy-assets worker``
as processes, the machine's PostgreSQL and RabbitMQ, two fake ComfyUI servers, httpx as
the client and a local webhook receiver that checks every signature.

A client submits a job with an input picture as a data URI, follows it live (Server-Sent
Events) until it ends, fetches its picture (the bytes of the done record), gets a signed
webhook that is retried after the receiver's first 500 with the same ``webhook-id``,
and sees each attempt among the job's events; a job accepted just before the API is
SIGKILLed renders once all the same (the restarted API answers for it); a job cancelled while its prompt runs
ends as a dead letter ``cancelled by alice``, its prompt interrupted and never posted
again."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from comfy_assets.api.signing import load_key, verify
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.api_support import AMQP, TOKENS, auth, data_uri, write_tokens
from tests.ports import free_port
from tests.process_support import FAST, command, start, stop
from tests.support import ROOT

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.timeout(180)]

INVERT = json.loads((ROOT / "data/workflows/invert_picture.json").read_text())
PICTURE = (ROOT / "data/jobs/pictures/dawn/key.png").read_bytes()
# Another picture: the fake, like ComfyUI, answers a prompt it has run before from cache.
OTHER_PICTURE = (ROOT / "data/jobs/pictures/dusk/key.png").read_bytes()


class Receiver:
    """A webhook receiver on loopback: answers 500 to the first attempt of each
    ``webhook-id``, 200 after; keeps each attempt with whether its signature holds."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.attempts: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        h = request.headers
        ok = verify(self.key, h["webhook-id"], h["webhook-timestamp"], body, h["webhook-signature"])
        first = not any(a["id"] == h["webhook-id"] for a in self.attempts)
        self.attempts.append({"id": h["webhook-id"], "verified": ok, "body": json.loads(body)})
        return web.Response(status=500 if first else 200)


def in_state(http: Any, job_id: str, state: str) -> Any:
    """A ``wait_for`` condition: job ``job_id`` is in ``state`` by ``GET /v1/jobs/{id}``."""

    async def check() -> bool:
        answer = await http.get(f"/v1/jobs/{job_id}", headers=auth())
        return answer.json()["state"] == state

    return check


async def wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    """Poll the async ``condition`` every 50 ms until it returns something true."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (found := await condition()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)
    return found


async def test_submit_follow_fetch_webhook_and_cancel(
    tmp_path: Path, pg_url: str, queue: str
) -> None:
    fakes = [FakeComfy(prompt_seconds=0.02), FakeComfy(prompt_seconds=0.02)]
    secret = tmp_path / "secret"
    secret.write_text("a webhook secret, long enough\n")
    receiver = Receiver(load_key(secret))
    hook_app = web.Application()
    hook_app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(hook_app)
    await runner.setup()
    hook_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", hook_port).start()
    port = free_port()
    store_dir = tmp_path / "store"
    env_db = ["--store", store_dir, "--db-url", pg_url]
    with fakes[0].serve_in_thread(port=0) as url0, fakes[1].serve_in_thread(port=0) as url1:
        servers = ["--server", f"gpu0={url0}", "--server", f"gpu1={url1}"]
        worker = await start(
            command("worker", "--rabbitmq", AMQP, "--queue", queue, *servers, *env_db, *FAST),
            tmp_path / "worker.log",
        )
        api_args = command(
            "api",
            *env_db,
            "--rabbitmq",
            AMQP,
            "--queue",
            queue,
            "--listen",
            f"127.0.0.1:{port}",
            "--tokens",
            write_tokens(tmp_path / "tokens"),
            "--webhook-secret-file",
            secret,
            "--allow-private-webhooks",
            *servers,
        )
        apis = [await start(api_args, tmp_path / "api.log")]

        async def kill_and_restart() -> None:
            apis[-1].send_signal(signal.SIGKILL)
            await apis[-1].wait()
            apis.append(await start(api_args, tmp_path / "api-restarted.log"))

        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                await _scenario(http, fakes, receiver, hook_port, kill_and_restart)
            assert worker.returncode is None, "the worker exited"
        finally:
            for proc in (*apis, worker):
                await stop(proc)
            await runner.cleanup()
            for name in ("api.log", "api-restarted.log", "worker.log"):
                if (tmp_path / name).exists():
                    print(f"--- {name}\n{(tmp_path / name).read_text()[-4000:]}")
    for name in ("api.log", "api-restarted.log"):
        logged = (tmp_path / name).read_text()
        assert not any(token in logged for token in TOKENS.values())  # never a token
    with Store(store_dir, pg_url) as store:
        assert store.counts("api-alice")["succeeded"] == 3
    assert "its claim taken by" in (tmp_path / "worker.log").read_text()


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False


async def _scenario(
    http: httpx.AsyncClient,
    fakes: list[FakeComfy],
    receiver: Receiver,
    hook_port: int,
    kill_and_restart: Callable[[], Awaitable[None]],
) -> None:
    await wait_for(lambda: _ready(http), 60, "the API to be ready")
    job_id = str(uuid.uuid4())
    body = {
        "id": job_id,
        "workflow": INVERT,
        "inputs": {"1.image": data_uri(PICTURE)},
        "webhook": f"http://127.0.0.1:{hook_port}/hook",
    }
    answer = await http.post("/v1/jobs", json=body, headers=auth())
    assert answer.status_code == 202, answer.text
    retry = await http.post("/v1/jobs", json=body, headers=auth())
    assert retry.status_code == 200

    # Live until it ends.
    kinds, states = [], []
    headers = {**auth(), "Accept": "text/event-stream"}
    async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as stream:
        kind = None
        async for line in stream.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
                kinds.append(kind)
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                states.append(data["to"] if kind == "transition" else data["state"])
    assert kinds[-1] == "end" and states[-1] == "succeeded"
    assert "rendering" in states or "submitted" in states

    view = (await http.get(f"/v1/jobs/{job_id}", headers=auth())).json()
    assert view["state"] == "succeeded" and view["attempts"] == 1
    assert len(view["servers"]) == 1
    [picture] = view["files"]
    got = await http.get(picture["url"], headers=auth())
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    assert hashlib.sha256(got.content).hexdigest() == picture["sha256"] == got.headers["etag"][1:-1]
    part = await http.get(picture["url"], headers={**auth(), "Range": "bytes=0-7"})
    assert part.status_code == 206 and part.content == got.content[:8]
    assert (await http.get(picture["url"], headers=auth("bob"))).status_code == 404
    # Rendered once, on one server.
    prompt_ids = {p for fake in fakes for p in fake.stats["prompts"]}
    assert len(prompt_ids) == 1
    assert (
        sum(f.stats["prompts"].get(p, {}).get("executed", 0) for f in fakes for p in prompt_ids)
        == 1
    )

    # The webhook: refused once (500), delivered again with the same id, both signed.
    await wait_for(lambda: _true(len(receiver.attempts) >= 2), 60, "the webhook's retry")
    first, second = receiver.attempts[:2]
    assert first["id"] == second["id"] and first["verified"] and second["verified"]
    assert second["body"]["type"] == "job.succeeded"
    assert second["body"]["data"]["files"] == view["files"]

    async def webhook_events() -> list[str]:
        events = (await http.get(f"/v1/jobs/{job_id}/events", headers=auth())).json()["events"]
        return [e["detail"] for e in events if (e["detail"] or "").startswith("webhook ")]

    details = await wait_for(
        lambda: _at_least(webhook_events(), 2), 30, "both webhook attempts as events"
    )
    assert "HTTP 500; next in" in details[0] and details[1].endswith(": delivered")

    # An API SIGKILLed right after a 202 loses nothing: the job renders, once.
    # (Its own filename prefix: the fake, like ComfyUI, would answer the same prompt
    # from its cache.)
    workflow = json.loads(json.dumps(INVERT).replace("img2img", "kept"))
    kept = {"id": str(uuid.uuid4()), "workflow": workflow, "inputs": {"1.image": data_uri(PICTURE)}}
    assert (await http.post("/v1/jobs", json=kept, headers=auth())).status_code == 202
    await kill_and_restart()
    await wait_for(lambda: _ready(http), 60, "the restarted API to be ready")

    async def kept_done() -> bool:
        state = (await http.get(f"/v1/jobs/{kept['id']}", headers=auth())).json()["state"]
        return state == "succeeded"

    await wait_for(kept_done, 60, "the job accepted before the kill to render")
    runs = [r for f in fakes for r in f.stats["runs"] if r["prompt_id"] not in prompt_ids]
    assert [r["outcome"] for r in runs] == ["success"]
    prompt_ids |= {r["prompt_id"] for r in runs}

    # A job cancelled while its prompt runs: interrupted, a dead letter, never executed.
    for fake in fakes:
        fake.prompt_seconds = 2.0  # a node's seconds: an interrupt lands between nodes
    slow = {
        "id": str(uuid.uuid4()),
        "workflow": INVERT,
        "inputs": {"1.image": data_uri(OTHER_PICTURE)},
    }
    assert (await http.post("/v1/jobs", json=slow, headers=auth())).status_code == 202

    await wait_for(in_state(http, slow["id"], "rendering"), 60, "the slow job to render")
    cancelled = await http.post(f"/v1/jobs/{slow['id']}/cancel", headers=auth())
    assert cancelled.status_code in (200, 202)  # 202: the API finishes it by itself

    slow_prompts = {p for f in fakes for p in f.stats["prompts"]} - prompt_ids

    async def interrupted() -> bool:
        ends = [
            r["outcome"] for f in fakes for r in f.stats["runs"] if r["prompt_id"] in slow_prompts
        ]
        return ends == ["interrupted"]

    await wait_for(interrupted, 60, "the slow prompt to be interrupted")

    async def dead_letter() -> dict[str, Any] | None:
        view = (await http.get(f"/v1/jobs/{slow['id']}", headers=auth())).json()
        return view if view["state"] == "failed_fatal" else None

    final = await wait_for(dead_letter, 60, "the cancelled job's dead letter")
    assert final["reason"] == "cancelled by alice"
    events = (await http.get(f"/v1/jobs/{slow['id']}/events", headers=auth())).json()["events"]
    details = [e["detail"] or "" for e in events]
    assert "cancel asked by alice: claim taken from its worker" in details
    assert any(d.startswith("cancel: prompt ") and "interrupted on gpu" in d for d in details)
    assert ("failed_fatal", "cancelled by alice") in [(e["to"], e["detail"]) for e in events]
    assert await interrupted()  # posted once, interrupted, never run again
    listed = (await http.get("/v1/servers", headers=auth())).json()["servers"]
    # The session's database may hold other tests' servers too (their leases, health).
    servers = [s for s in listed if s["name"] in ("gpu0", "gpu1")]
    assert [s["name"] for s in servers] == ["gpu0", "gpu1"] and all(s["healthy"] for s in servers)
    assert servers[0]["health"].startswith("gpu0 healthy")
    judged = [s["store_health"] for s in servers if s["store_health"] is not None]
    assert all(h["state"] == "ok" for h in judged)

    # The worker whose claim the cancel took left the job to the API and goes on: a job
    # sent after it renders.
    for fake in fakes:
        fake.prompt_seconds = 0.02
    workflow = json.loads(json.dumps(INVERT).replace("img2img", "after"))
    after = {
        "id": str(uuid.uuid4()),
        "workflow": workflow,
        "inputs": {"1.image": data_uri(PICTURE)},
    }
    assert (await http.post("/v1/jobs", json=after, headers=auth())).status_code == 202

    done = in_state(http, after["id"], "succeeded")
    await wait_for(done, 60, "a job sent after the cancel to render")


async def _true(value: bool) -> bool:
    return value


async def _at_least(found: Any, n: int) -> Any:
    values = await found
    return values if len(values) >= n else None
