"""The fake ComfyUI's routing of messages between clients, its queue and history, and its
lives (stopped, started again, served in a thread) against the recordings of the real server."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from PIL import Image

from fake_comfy import FakeComfy, workflows
from tests.fake_comfy.recordings import (
    NODE_S,
    WAIT_S,
    Socket,
    post,
    posted_by_me,
    recorded_http,
    recording,
    scrub,
)

# -- routing (execution_error.json, broadcast_and_missed.json, interrupt_reconnect.json) -


async def test_anonymous_prompt_interrupt_reaches_everyone_but_its_other_events_do_not(
    tmp_path: Path,
) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        ours = await Socket.open(url, "ours")
        theirs = await Socket.open(url, None)
        assert len(theirs.greeting["data"]["sid"]) == 32  # a fresh uuid4 hex
        await post(c, workflows.blur_chain(), None, "anon")
        # Its progress_state is broadcast: wait until it hangs at node 2.
        await ours.until_match(
            lambda m: m["type"] == "progress_state" and "2" in m["data"]["nodes"]
        )
        await c.post("/interrupt", json={})
        got = await ours.until("execution_interrupted", prompt_id="anon")
        await theirs.until("execution_interrupted", prompt_id="anon")
        await ours.close()
        await theirs.close()
    kinds = {m["type"] for m in got}
    assert kinds <= {"status", "progress_state", "execution_interrupted"}
    assert "execution_start" not in kinds and "executing" not in kinds


async def test_reconnect_with_the_same_client_id_replaces_the_socket(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.blur_chain(), "h") as (url, c, old):
        await old.until("executing", node="2", prompt_id="h")
        new = await Socket.open(url, "me")
        assert new.greeting == {
            "type": "status",
            "data": {"status": {"exec_info": {"queue_remaining": 1}}, "sid": "me"},
        }
        # As recorded: the current node, without prompt_id.
        assert await new.next() == {"type": "executing", "data": {"node": "2"}}
        await c.post("/interrupt", json={"prompt_id": "h"})
        await new.until_done("h")
        await new.close()
    # The server is gone and has closed every socket: the replaced one got nothing more.
    assert [message async for message in old.ws] == []


async def test_duplicate_prompt_id_runs_twice_and_history_keeps_the_second(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        first = (await post(c, workflows.solid_and_inverted(color=1), "me", "dup")).json()
        second = (await post(c, workflows.solid_and_inverted(color=2), "me", "dup")).json()
        await fake.wait_idle(WAIT_S)
        entry = (await c.get("/history/dup")).json()["dup"]
    assert (first["number"], second["number"]) == (0, 1)
    assert entry["prompt"][0] == 1 and entry["prompt"][2]["1"]["inputs"]["color"] == 2
    assert entry["outputs"]["3"]["images"][0]["filename"] == "solid_00002_.png"
    assert fake.stats["prompts"]["dup"] == {"posted": 2, "executed": 2}
    assert [r["number"] for r in fake.stats["runs"]] == [0, 1]


async def test_queue_lists_running_and_pending_as_recorded(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    posts = [
        ex["request"]["body"]
        for ex in recording("three_in_a_row")["exchanges"]
        if ex["kind"] == "http" and ex["request"]["method"] == "POST"
    ]
    client_id = posts[0]["client_id"]
    first, second, third = (body["prompt_id"] for body in posts)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, client_id)
        for body in posts:
            await c.post("/prompt", json=body)
        await sock.until("executing", node="2", prompt_id=first)
        queue = (await c.get("/queue")).json()
        remaining = (await c.get("/prompt")).json()
        deleted = await c.post("/queue", json={"delete": [third, first]})
        after = (await c.get("/queue")).json()
        await c.post("/interrupt")
        await sock.until_done(second)
        await sock.close()
    want = recorded_http("three_in_a_row", label="queue: one running, two pending")["response"]
    assert [item[0] for item in queue["queue_running"] + queue["queue_pending"]] == [0, 1, 2]
    for listing in (queue, want["body"]):
        for item in listing["queue_running"] + listing["queue_pending"]:
            item[0] = "<number>"
    assert scrub(queue) == scrub(want["body"])
    assert remaining == recorded_http("three_in_a_row", label="queue_remaining")["response"]["body"]
    assert (deleted.status_code, deleted.content) == (200, b"")
    # A running prompt is not deleted (interrupt_reconnect.json); the pending one is.
    assert [item[1] for item in after["queue_running"]] == [first]
    assert [item[1] for item in after["queue_pending"]] == [second]
    assert fake.stats["prompts"][third] == {"posted": 1, "executed": 0}


async def test_history_max_items_gives_the_latest_entries(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        for pid in ("h1", "h2", "h3"):
            await post(c, workflows.single_image(), None, pid)
        await fake.wait_idle(WAIT_S)
        assert list((await c.get("/history", params={"max_items": 2})).json()) == ["h2", "h3"]
        assert list((await c.get("/history")).json()) == ["h1", "h2", "h3"]


# -- server lives ------------------------------------------------------------------------


async def test_a_server_stopped_and_started_on_the_same_port_forgets_but_records_remain(
    fake: FakeComfy,
) -> None:
    async with fake.serve() as url:
        port = fake.port
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await post(c, workflows.single_image(), None, "a")).json()["number"] == 0
            await fake.wait_idle(WAIT_S)
    assert fake.port is None
    async with fake.serve(port=port) as url, httpx.AsyncClient(base_url=url) as c:
        assert fake.port == port
        assert (await c.get("/history/a")).json() == {}
        assert (await post(c, workflows.single_image(), None, "b")).json()["number"] == 0
        await fake.wait_idle(WAIT_S)
        item = (await c.get("/history/b")).json()["b"]["outputs"]["2"]["images"][0]
    assert item["filename"] == "still_00002_.png"  # counters come from the files on disk
    assert [r["prompt_id"] for r in fake.stats["runs"]] == ["a", "b"]


async def test_leaving_serve_loses_the_running_prompt(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with posted_by_me(fake, workflows.blur_chain(), "h") as (url, c, sock):
        await sock.until("executing", node="2", prompt_id="h")
        with pytest.raises(TimeoutError):
            await fake.wait_idle(0.05)
    with pytest.raises(websockets.ConnectionClosed):
        await sock.until_done("h")
    assert [(r["prompt_id"], r["outcome"]) for r in fake.stats["runs"]] == [("h", "lost")]


def test_serve_in_thread_serves_sync_callers(tmp_path: Path) -> None:
    fake = FakeComfy(prompt_seconds=NODE_S, output_dir=tmp_path)
    with fake.serve_in_thread() as url:
        with httpx.Client(base_url=url) as c:
            assert (
                c.post(
                    "/prompt", json={"prompt": workflows.single_image(), "prompt_id": "t"}
                ).status_code
                == 200
            )
            asyncio.run(fake.wait_for_runs(1, WAIT_S))
            stats = c.get("/fake/stats").json()
    assert stats == fake.stats
    assert stats["prompts"] == {"t": {"posted": 1, "executed": 1}}
    assert stats["runs"][0]["outcome"] == "success"
    assert {
        "prompt_id",
        "client_id",
        "number",
        "word",
        "posted",
        "start",
        "last_message",
        "end",
        "outcome",
    } == set(stats["runs"][0])
    assert stats["runs"][0]["word"] == "ok"
    # Not a late prompt: its last message is its end.
    assert stats["runs"][0]["last_message"] == stats["runs"][0]["end"]


async def test_preview_images_are_served_from_the_temp_folder(fake: FakeComfy) -> None:
    prompt = workflows.single_image(width=8, height=6)
    prompt["2"] = {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        await post(c, prompt, None, "pv")
        await fake.wait_idle(WAIT_S)
        (item,) = (await c.get("/history/pv")).json()["pv"]["outputs"]["2"]["images"]
        got = await c.get("/view", params=item)
        as_output = await c.get("/view", params={**item, "type": "output"})
    assert item["type"] == "temp" and item["filename"].startswith("ComfyUI_temp_")
    assert Image.open(io.BytesIO(got.content)).size == (8, 6)
    assert as_output.status_code == 404
    assert list(fake.output_dir.iterdir()) == []


async def test_clearing_the_queue_drops_every_pending_prompt(tmp_path: Path) -> None:
    fake = FakeComfy(script=["hang"], prompt_seconds=NODE_S, output_dir=tmp_path)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
        sock = await Socket.open(url, "me")
        for pid in ("run", "p1", "p2"):
            await post(c, workflows.blur_chain(), "me", pid)
        await sock.until("executing", node="2", prompt_id="run")
        assert (await c.post("/queue", json={"clear": True})).status_code == 200
        assert (await c.get("/queue")).json()["queue_pending"] == []
        await c.post("/interrupt")
        await fake.wait_idle(WAIT_S)
        await sock.until_done("run")
        await sock.close()
    assert [r["prompt_id"] for r in fake.stats["runs"]] == ["run"]


async def test_a_bug_in_the_fake_is_raised_not_swallowed(
    fake: FakeComfy, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(class_type: str, inputs: dict[str, Any], folders: object) -> tuple[Any, ...]:
        raise ZeroDivisionError("fake bug")

    monkeypatch.setattr("fake_comfy.nodes.compute", broken)
    with pytest.raises(RuntimeError, match="executor crashed"):
        async with fake.serve() as url, httpx.AsyncClient(base_url=url) as c:
            await post(c, workflows.single_image(), None, "x")
            with pytest.raises(RuntimeError, match="executor crashed"):
                await fake.wait_idle(WAIT_S)
    assert [r["outcome"] for r in fake.stats["runs"]] == ["lost"]
