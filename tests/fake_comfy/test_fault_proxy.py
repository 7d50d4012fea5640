"""The campaign's fault proxy: what passes through, what is answered 404, what is cut."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import websockets

from fake_comfy import FakeComfy
from fake_comfy.proxy import FaultProxy
from tests.support import write_jobs

WAIT_S = 10.0


async def render_one(client: httpx.AsyncClient, fake: FakeComfy) -> str:
    """Post one image prompt through ``client``; returns the name of its solid output."""
    job_dir = write_jobs(fake.output_dir.parent / "jobs", 1).parent
    prompt = json.loads((job_dir / "image.json").read_text())
    answer = await client.post("/prompt", json={"prompt": prompt, "client_id": "t"})
    assert answer.status_code == 200, answer.text
    await fake.wait_idle(WAIT_S)
    (entry,) = (await client.get("/history")).json().values()
    return entry["outputs"]["3"]["images"][0]["filename"]


async def test_the_first_two_downloads_of_a_listed_output_are_404_then_the_file_passes():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url, view_404={"solid_*": 2})
        async with proxy.serve() as via, httpx.AsyncClient(base_url=via) as client:
            name = await render_one(client, fake)
            statuses = [
                (await client.get("/view", params={"filename": name, "type": "output"})).status_code
                for _ in range(3)
            ]
            other = await client.get("/view", params={"filename": "inverted_00001_.png"})
    assert statuses == [404, 404, 200]
    assert other.status_code == 200 and other.content.startswith(b"\x89PNG")
    assert proxy.stats["view_404"] == 2
    # The two answered by the proxy never reached the server.
    assert fake.stats["requests"]["GET /view"] == 2


async def test_an_output_listed_for_good_is_404_every_time():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url, view_404={"solid_00001_.png": None})
        async with proxy.serve() as via, httpx.AsyncClient(base_url=via) as client:
            name = await render_one(client, fake)
            statuses = [
                (await client.get("/view", params={"filename": name})).status_code for _ in range(5)
            ]
    assert name == "solid_00001_.png"
    assert statuses == [404] * 5
    assert fake.stats["requests"].get("GET /view", 0) == 0


async def test_requests_and_bodies_pass_through_a_kept_alive_connection_unchanged():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url)
        async with proxy.serve() as via, httpx.AsyncClient(base_url=via) as client:
            await render_one(client, fake)
            stats = [(await client.get("/system_stats")).status_code for _ in range(3)]
    assert stats == [200, 200, 200]
    assert fake.stats["requests"]["GET /system_stats"] == 3
    assert sum(p["posted"] for p in fake.stats["prompts"].values()) == 1
    assert proxy.stats["connections"] == 1  # one connection kept alive, read request by request
    assert proxy.stats["cut"] == 0


async def test_cut_all_aborts_an_open_websocket_without_a_close_frame():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url)
        async with proxy.serve() as via:
            ws_url = via.replace("http://", "ws://") + "/ws?clientId=a"
            async with websockets.connect(ws_url) as ws:
                greeting = await ws.recv()
                proxy.cut_all()
                with pytest.raises(websockets.ConnectionClosedError) as closed:
                    await ws.recv()
    assert '"status"' in greeting
    assert closed.value.rcvd is None  # no close frame: an abrupt cut


async def test_a_seeded_cut_gives_the_client_no_answer_and_cuts_are_bounded():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url, cuts=1, cut_within_s=0.0)
        async with proxy.serve() as via:
            async with httpx.AsyncClient(base_url=via) as client:
                with pytest.raises(httpx.TransportError):
                    await client.get("/queue")
                again = [(await client.get("/queue")).status_code for _ in range(3)]
    assert again == [200, 200, 200]  # the one cut is spent
    assert proxy.stats["cut"] == 1


async def test_a_target_that_refuses_closes_the_clients_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proxy = FaultProxy(dead)
    async with proxy.serve() as via, httpx.AsyncClient(base_url=via) as client:
        with pytest.raises(httpx.TransportError):
            await client.get("/queue")
    assert proxy.stats["connections"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"cut_probability": 1.5}, {"cuts": -1}, {"cut_within_s": -0.1}],
)
def test_out_of_range_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        FaultProxy("127.0.0.1:1", **kwargs)


def test_a_target_without_a_port_is_refused():
    with pytest.raises(ValueError, match="host and a port"):
        FaultProxy("http://127.0.0.1")


async def test_a_lost_answer_reaches_the_server_but_not_the_client():
    fake = FakeComfy()
    async with fake.serve() as url:
        proxy = FaultProxy(url, lose_answer={"POST /prompt": 1, "GET /view": 1})
        async with proxy.serve() as via, httpx.AsyncClient(base_url=via) as client:
            job_dir = write_jobs(fake.output_dir.parent / "jobs", 1).parent
            prompt = json.loads((job_dir / "image.json").read_text())
            with pytest.raises(httpx.TransportError):
                await client.post("/prompt", json={"prompt": prompt, "prompt_id": "p1"})
            await fake.wait_idle(WAIT_S)
            params = {"filename": "solid_00001_.png"}
            with pytest.raises(httpx.TransportError):
                await client.get("/view", params=params)
            whole = await client.get("/view", params=params)
    # The prompt the client never heard of was queued and ran; the cut download was sent.
    assert fake.stats["prompts"]["p1"] == {"posted": 1, "executed": 1}
    assert fake.stats["requests"]["GET /view"] == 2
    assert whole.status_code == 200 and whole.content.startswith(b"\x89PNG")
    assert proxy.stats["lost_answers"] == 2
