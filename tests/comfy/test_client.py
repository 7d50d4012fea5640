"""ComfyClient against the recorded answers of a real ComfyUI v0.8.0, and its error
mapping against real sockets (refused, reset, closed, silent, 500 text/plain)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp import web

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import (
    ConnectionLost,
    OutputMissing,
    PromptRejected,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    UnexpectedAnswer,
)
from comfy_assets.comfy.types import ExecutionErrorInfo
from tests.ports import free_port

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded"


def recording(case: str) -> list[dict]:
    return json.loads((RECORDED / f"{case}.json").read_text())["exchanges"]


def recorded_file(sha256: str) -> bytes:
    for path in (RECORDED / "files").iterdir():
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == sha256:
            return data
    raise FileNotFoundError(f"no recorded file with sha256 {sha256}")


def _key(method: str, path: str) -> tuple[str, str, tuple]:
    parts = urlsplit(path)
    query = tuple(sorted((k, tuple(v)) for k, v in parse_qs(parts.query, True).items()))
    return method, parts.path, query


@asynccontextmanager
async def answering(
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An HTTP server on loopback answering every request with ``handle``; yields its
    base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass
class Sent:
    """A request as the server received it: method, path with query as sent, body."""

    method: str
    target: str
    body: bytes


class Replay:
    """A server answering each request with the next recorded answer to the same method,
    path and query (in recording order); ``requests`` keeps what was sent, and a request
    nothing was recorded for fails the test when its client closes."""

    def __init__(self, *cases: str, labels: set[str] | None = None) -> None:
        self.answers: dict[tuple, list[dict]] = {}
        self.requests: list[Sent] = []
        self.unrecorded: list[str] = []
        for case in cases:
            for ex in recording(case):
                if ex["kind"] != "http" or "request" not in ex:
                    continue
                if labels is not None and ex.get("label") not in labels:
                    continue
                req = ex["request"]
                self.answers.setdefault(_key(req["method"], req["path"]), []).append(ex["response"])

    async def handle(self, request: web.Request) -> web.Response:
        target = request.raw_path
        self.requests.append(Sent(request.method, target, await request.read()))
        answers = self.answers.get(_key(request.method, target))
        if not answers:
            self.unrecorded.append(f"{request.method} {target}")
            return web.Response(status=599, text="nothing recorded")
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        body = answer["body"]
        if isinstance(body, dict) and set(body) == {"bytes", "sha256"}:
            content = recorded_file(body["sha256"])
        elif isinstance(body, (dict, list)):
            content = json.dumps(body).encode()
        else:
            content = (body or "").encode()
        headers = {"content-type": answer["content_type"]} if answer.get("content_type") else {}
        return web.Response(status=answer["status"], body=content, headers=headers)

    @asynccontextmanager
    async def client(self) -> AsyncIterator[ComfyClient]:
        """A ComfyClient named gpu0 of this server."""
        async with answering(self.handle) as url, ComfyClient(url, name="gpu0") as client:
            yield client
        assert self.unrecorded == [], "requests nothing was recorded for"


# -- recorded answers → dataclasses ------------------------------------------------------


async def test_system_stats_reads_version_and_cpu_device():
    async with Replay("basics").client() as client:
        stats = await client.system_stats()
    assert stats.comfyui_version == "0.8.0"
    assert [(d.name, d.type, d.label) for d in stats.devices] == [("cpu", "cpu", "cpu")]
    assert stats.devices[0].vram_free == 24210178048
    assert stats.devices[0].vram_total == 25276514304


async def test_queue_shows_one_running_and_two_pending_with_their_numbers():
    async with Replay("three_in_a_row", labels={"queue: one running, two pending"}).client() as c:
        queue = await c.queue()
    assert [e.number for e in queue.running] == [4]
    assert [e.number for e in queue.pending] == [5, 6]
    assert queue.length == 3
    assert queue.contains("1f8e98b2-9896-4454-9835-a16d49aa6db7")
    assert not queue.contains("1f8e98b2-9896-4454-9835-a16d49aa6db7", number=4)
    assert queue.running[0].client_id == "1d9d8d4248c044df96b1547a156627de"


async def test_unknown_history_id_is_none():
    async with Replay("basics").client() as client:
        assert await client.history("7e97a650-8d70-41c7-9662-6812956c1483") is None


async def test_history_of_a_success_lists_both_saved_images():
    pid = "78d29e6e-ba18-4dda-b1c6-1bc2d5aef9de"
    async with Replay("success").client() as client:
        entry = await client.history(pid)
    assert entry is not None
    assert (entry.number, entry.outcome, entry.completed) == (0, "success", True)
    assert entry.client_id == "21c5d207996f4efaa3d34fc41b0375a2"
    assert entry.create_time == 1796040101976
    assert [(f.node_id, f.key, f.filename, f.type) for f in entry.output_files] == [
        ("3", "images", "solid_00001_.png", "output"),
        ("4", "images", "inverted_00001_.png", "output"),
    ]


async def test_video_output_is_a_file_listed_under_images():
    async with Replay("video").client() as client:
        entry = await client.history("6a1bcfb6-803e-44f5-9c6c-029f802a646e")
    assert entry is not None
    files = entry.output_files
    assert [(f.key, f.subfolder, f.filename) for f in files] == [
        ("images", "video", "shot_00001_.mp4")
    ]


def test_output_files_reads_every_key_and_skips_non_files():
    from comfy_assets.comfy.types import HistoryEntry

    entry = HistoryEntry.from_json(
        "p",
        {
            "prompt": [7, "p", {}, {}, ["9"]],
            "outputs": {
                "9": {
                    "gifs": [{"filename": "a.gif", "subfolder": "", "type": "output"}],
                    "audio": [{"filename": "a.flac", "subfolder": "snd", "type": "output"}],
                    "images": [{"filename": "p.png", "subfolder": "", "type": "temp"}],
                    "animated": [True],
                    "text": ["hello"],
                }
            },
            "status": {"status_str": "success", "completed": True, "messages": []},
        },
    )
    assert [(f.key, f.filename, f.type) for f in entry.output_files] == [
        ("gifs", "a.gif", "output"),
        ("audio", "a.flac", "output"),
        ("images", "p.png", "temp"),
    ]


async def test_history_of_a_reposted_id_holds_only_the_last_run():
    async with Replay("duplicate_prompt_id").client() as client:
        entry = await client.history("4e867388-28ad-4ac5-a400-21a330af54bb")
    assert entry is not None and entry.number == 3


async def test_history_of_an_interrupted_prompt_reads_interrupted():
    async with Replay("interrupt_reconnect").client() as client:
        entry = await client.history("e24fb471-593d-48a3-a2dc-0401a8a7899b")
    assert entry is not None
    assert (entry.status_str, entry.outcome, entry.output_files) == ("error", "interrupted", [])


async def test_history_of_a_failed_prompt_carries_the_index_error():
    async with Replay("execution_error").client() as client:
        entry = await client.history("e1e4a3a3-c450-41bd-88ec-8cb37bcfda1f")
    assert entry is not None and entry.outcome == "error"
    assert entry.error is not None
    assert (entry.error.node_id, entry.error.node_type, entry.error.exception_type) == (
        "2",
        "ImageToMask",
        "IndexError",
    )
    assert not entry.error.is_oom


@pytest.mark.parametrize(
    ("exception_type", "message", "oom"),
    [
        ("torch.OutOfMemoryError", "Allocation on device 0 would exceed", True),
        ("torch.cuda.OutOfMemoryError", "CUDA error", True),
        ("RuntimeError", "x\nThis error means you ran out of memory on your GPU.\n\nTIPS:", True),
        ("RuntimeError", "CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("IndexError", "index 3 is out of bounds for dimension 3 with size 3", False),
    ],
)
def test_out_of_memory_is_recognised_by_type_or_tip(exception_type, message, oom):
    info = ExecutionErrorInfo("5", "KSampler", exception_type, message)
    assert info.is_oom is oom


# -- POST /prompt ------------------------------------------------------------------------


async def test_post_sends_prompt_client_id_and_prompt_id_and_reads_number():
    replay = Replay("success")
    workflow = recording("success")[1]["request"]["body"]["prompt"]
    async with replay.client() as client:
        post = await client.post_prompt(
            workflow, prompt_id="78d29e6e-ba18-4dda-b1c6-1bc2d5aef9de", client_id="c1"
        )
    assert (post.number, post.node_errors) == (0, {})
    sent = json.loads(replay.requests[0].body)
    assert sent == {
        "prompt": workflow,
        "client_id": "c1",
        "prompt_id": "78d29e6e-ba18-4dda-b1c6-1bc2d5aef9de",
    }


async def test_post_200_with_node_errors_reports_the_dropped_output():
    replay = Replay("validation_errors", labels={"link to a missing node"})
    async with replay.client() as client:
        post = await client.post_prompt({}, prompt_id="x", client_id="c")
    assert post.number == 11
    assert list(post.node_errors) == ["3"]


async def test_validation_400_is_rejected_with_readable_node_errors():
    replay = Replay("validation_errors", labels={"value below min"})
    async with replay.client() as client:
        with pytest.raises(PromptRejected) as info:
            await client.post_prompt({}, prompt_id="x", client_id="c")
    err = info.value
    assert err.error_type == "prompt_outputs_failed_validation"
    assert not err.transient
    assert "node 1 (EmptyImage): Value -5 smaller than min of 1 [width]" in str(err)
    assert err.node_errors["1"]["class_type"] == "EmptyImage"


async def test_unknown_node_class_is_rejected_as_invalid_prompt():
    replay = Replay("validation_errors", labels={"unknown node class"})
    async with replay.client() as client:
        with pytest.raises(PromptRejected) as info:
            await client.post_prompt({}, prompt_id="x", client_id="c")
    assert info.value.error_type == "invalid_prompt"
    assert "node NoSuchNode does not exist" in str(info.value)


async def test_500_text_plain_is_a_server_error_with_the_body():
    replay = Replay("validation_errors", labels={"body is not JSON"})
    async with replay.client() as client:
        with pytest.raises(ServerError) as info:
            await client.post_prompt({}, prompt_id="x", client_id="c")
    assert info.value.status == 500
    assert info.value.body == "500 Internal Server Error\n\nServer got itself in trouble"
    assert info.value.transient


# -- other routes ------------------------------------------------------------------------


async def test_interrupt_delete_and_free_send_the_recorded_bodies():
    sent: list[tuple[str, bytes]] = []

    async def handle(request: web.Request) -> web.Response:
        sent.append((request.path, await request.read()))
        return web.Response(body=b"")

    async with answering(handle) as url, ComfyClient(url) as client:
        await client.interrupt("p1")
        await client.interrupt()
        await client.delete_from_queue(["p1", "p2"])
        await client.free()
    assert [(path, json.loads(body)) for path, body in sent] == [
        ("/interrupt", {"prompt_id": "p1"}),
        ("/interrupt", {}),
        ("/queue", {"delete": ["p1", "p2"]}),
        ("/free", {"unload_models": True, "free_memory": True}),
    ]


async def test_view_returns_the_recorded_png_bytes():
    async with Replay("success").client() as client:
        data = await client.view("solid_00001_.png", "", "output")
    assert hashlib.sha256(data).hexdigest() == (
        "c738a34e8eba88674d7f6ba4b6298c461ca97c3c43ab356adc4d61a9e509d3ed"
    )


async def test_view_404_is_output_missing_and_403_is_unexpected():
    async with Replay("basics").client() as client:
        with pytest.raises(OutputMissing):
            await client.view("does-not-exist.png", "", "output")
        with pytest.raises(UnexpectedAnswer) as info:
            await client.view("x.png", "../..", "output")
    assert "403" in str(info.value)


async def test_a_body_of_the_wrong_shape_is_unexpected_answer():
    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"queue_running": "nope"})

    async with answering(handle) as url, ComfyClient(url) as client:
        with pytest.raises(UnexpectedAnswer) as info:
            await client.queue()
    assert "GET /queue" in str(info.value)


async def test_a_body_nested_too_deeply_is_unexpected_answer():
    async def handle(request: web.Request) -> web.Response:
        return web.Response(text="[" * 100_000 + "]" * 100_000, content_type="application/json")

    async with answering(handle) as url, ComfyClient(url, name="gpu9") as client:
        with pytest.raises(UnexpectedAnswer) as info:
            await client.queue()
    assert "gpu9: GET /queue" in str(info.value)
    assert "body is JSON nested too deeply to read" in str(info.value)


def test_ws_url_keeps_host_and_port_and_sets_client_id():
    client = ComfyClient("http://127.0.0.1:8188/")
    assert client.ws_url("abc") == "ws://127.0.0.1:8188/ws?clientId=abc"
    assert ComfyClient("https://h").ws_url("x") == "wss://h/ws?clientId=x"


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="ftp://h"):
        ComfyClient("ftp://h")


# -- error mapping over real sockets -----------------------------------------------------


@asynccontextmanager
async def raw_server(behaviour: str) -> AsyncIterator[str]:
    """A TCP server that reads the request head, then: ``reset`` (RST), ``close`` (FIN,
    no answer), ``silent`` (never answers until the test ends), ``cut`` (a 200 of
    100 bytes by its Content-Length, cut by a RST after 10), ``half-head`` (FIN in the
    middle of a 200's headers), ``drip-head`` or
    ``drip-body`` (answers a byte at a time until the test ends: a header line that never
    ends, or a 200 whose chunked body never ends)."""
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if behaviour == "silent":
            await done.wait()
        elif behaviour.startswith("drip-"):
            if behaviour == "drip-body":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
            drip = b"1\r\n \r\n" if behaviour == "drip-body" else b"-"
            while not done.is_set():
                writer.write(drip)
                await writer.drain()
                await asyncio.sleep(0.02)  # the server's pace, not a synchronisation
        elif behaviour == "half-head":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Wed, 02 De")
            await writer.drain()
        elif behaviour in ("reset", "cut"):
            if behaviour == "cut":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst half")
                await writer.drain()
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        done.set()
        server.close()
        await server.wait_closed()


def aiohttp_500() -> AbstractAsyncContextManager[str]:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(
            status=500, text="500 Internal Server Error\n\nServer got itself in trouble"
        )

    return answering(handle)


ALL_KINDS = (ServerUnreachable, ConnectionLost, RequestTimeout, ServerError)


async def _error_of(url: str) -> Exception:
    async with ComfyClient(url, name="gpu9", timeout_s=0.5) as client:
        with pytest.raises(Exception) as info:
            await client.queue()
    return info.value


async def test_refused_reset_closed_silent_and_500_are_told_apart_by_type():
    refused = await _error_of(f"http://127.0.0.1:{free_port()}")
    async with raw_server("reset") as url:
        reset = await _error_of(url)
    async with raw_server("close") as url:
        closed = await _error_of(url)
    async with raw_server("silent") as url:
        silent = await _error_of(url)
    async with aiohttp_500() as url:
        error_500 = await _error_of(url)

    got = {
        "refused": refused,
        "reset": reset,
        "closed": closed,
        "silent": silent,
        "500": error_500,
    }
    expected = {
        "refused": ServerUnreachable,
        "reset": ConnectionLost,
        "closed": ConnectionLost,
        "silent": RequestTimeout,
        "500": ServerError,
    }
    for what, exc in got.items():
        assert type(exc) is expected[what], f"{what}: {type(exc).__name__}: {exc}"
        others = [k for k in ALL_KINDS if k is not expected[what]]
        assert not isinstance(exc, tuple(others)), what
        assert exc.transient
        assert "gpu9" in str(exc) and "GET /queue" in str(exc)
    assert "connection refused" in str(refused)
    assert error_500.body.startswith("500 Internal Server Error")


@pytest.mark.parametrize(
    "behaviour, reason",
    [
        ("half-head", "the server closed it in the middle of the answer's headers, status 200"),
        (
            "cut",
            "the answer's body could not be read: Not enough data to satisfy content length "
            "header (received 10 of 100 bytes)",
        ),
    ],
)
async def test_a_connection_closed_mid_answer_is_told_in_words(behaviour, reason):
    # aiohttp's own messages for these two are reprs (client.py: _lost_reason).
    async with raw_server(behaviour) as url:
        lost = await _error_of(url)
    assert type(lost) is ConnectionLost and lost.transient
    assert str(lost) == f"gpu9: GET /queue: connection lost ({reason})"


async def test_socket_to_a_refused_port_is_server_unreachable():
    async with ComfyClient(f"http://127.0.0.1:{free_port()}", timeout_s=1) as client:
        with pytest.raises(ServerUnreachable, match="connection refused"):
            await client.connect_ws("c1")
