"""What the fake ComfyUI tests read and talk with: the recordings of the real server
(data/recorded/*.json), scrubbed of what differs between runs, and a websocket client that
keeps what it receives."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import websockets

from fake_comfy import FakeComfy

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded"
FAKE_DATA = Path(__file__).resolve().parents[2] / "fake_comfy" / "data"
WAIT_S = 5.0  # bound on every wait; a healthy fake answers in milliseconds
NODE_S = 0.001


def recording(case: str) -> dict[str, Any]:
    return json.loads((RECORDED / f"{case}.json").read_text())


def recorded_http(case: str, label: str | None = None, path: str | None = None) -> dict[str, Any]:
    for ex in recording(case)["exchanges"]:
        if ex["kind"] != "http":
            continue
        if (label is None or ex.get("label") == label) and (
            path is None or ex["request"]["path"] == path
        ):
            return ex
    raise LookupError(f"{case}: no exchange {label or path}")


def recorded_run(case: str, client: str) -> list[dict[str, Any]]:
    """Messages of `client` from the first POST up to the first `executing` with node null."""
    out: list[dict[str, Any]] = []
    posted = False
    for ex in recording(case)["exchanges"]:
        if ex["kind"] == "http" and ex["request"]["method"] == "POST":
            posted = True
        if ex["kind"] == "ws" and ex["client"] == client and posted:
            out.append(ex["message"])
            if ex["message"]["type"] == "executing" and ex["message"]["data"]["node"] is None:
                return out
    raise LookupError(f"{case}: no finished run for {client}")


def scrub(value: Any) -> Any:
    """Replaces what differs between runs (timestamps) by placeholders."""
    if isinstance(value, dict):
        return {
            k: ("<t>" if k in ("timestamp", "create_time") else scrub(v)) for k, v in value.items()
        }
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def scrub_entry(entry: dict[str, Any]) -> dict[str, Any]:
    entry = scrub(entry)
    entry["prompt"][0] = "<number>"
    return entry


class Socket:
    """A websocket client that keeps what it receives."""

    def __init__(self, ws: Any, greeting: dict[str, Any]) -> None:
        self.ws = ws
        self.greeting = greeting
        self.messages: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, url: str, client_id: str | None) -> Socket:
        query = f"?clientId={client_id}" if client_id else ""
        ws = await websockets.connect(url.replace("http://", "ws://") + "/ws" + query)
        greeting = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        return cls(ws, greeting)

    async def next(self) -> dict[str, Any]:
        message = json.loads(await asyncio.wait_for(self.ws.recv(), WAIT_S))
        self.messages.append(message)
        return message

    async def until(self, kind: str, **data: Any) -> list[dict[str, Any]]:
        """Reads until a message of `kind` whose data has `data`; returns what was read."""
        start = len(self.messages)
        while True:
            m = await self.next()
            if m["type"] == kind and all(m["data"].get(k) == v for k, v in data.items()):
                return self.messages[start:]

    async def until_match(self, match: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        start = len(self.messages)
        while not match(await self.next()):
            pass
        return self.messages[start:]

    async def until_done(self, prompt_id: str) -> list[dict[str, Any]]:
        return await self.until("executing", node=None, prompt_id=prompt_id)

    async def close(self) -> None:
        await self.ws.close()


def new_id() -> str:
    return str(uuid.uuid4())


async def post(
    client: httpx.AsyncClient, prompt: dict[str, Any], client_id: str | None, prompt_id: str
) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, "prompt_id": prompt_id}
    if client_id is not None:
        body["client_id"] = client_id
    return await client.post("/prompt", json=body)


@asynccontextmanager
async def posted_by_me(
    fake: FakeComfy, prompt: dict[str, Any], prompt_id: str
) -> AsyncIterator[tuple[str, httpx.AsyncClient, Socket]]:
    """``fake`` served, a client of it and a socket of client id "me" that has posted
    ``prompt`` as ``prompt_id``; yields the URL, the client and the socket."""
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        await post(c, prompt, "me", prompt_id)
        yield url, c, sock
