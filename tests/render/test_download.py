"""Outputs from /history to disk: untrusted names, temp + rename, sha256 while streaming."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from aiohttp import web

from comfy_assets.comfy.answers import view_content_type
from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.download import download_outputs, safe_output_path
from comfy_assets.comfy.errors import (
    ConnectionLost,
    NotTheFile,
    OutputMissing,
    OutputTooLarge,
    UnsafeOutputName,
)
from comfy_assets.comfy.types import HistoryEntry
from comfy_assets.render.outputs import JobOutputs
from comfy_assets.store import OutputFile
from comfy_assets.store.files import FolderFileStore
from fake_comfy.media import solid_png
from tests.comfy.test_client import Replay, answering, raw_server

PNG_END = bytes.fromhex("0000000049454e44ae426082")  # every PNG's last 12 bytes (IEND)
SOLID_SHA = "c738a34e8eba88674d7f6ba4b6298c461ca97c3c43ab356adc4d61a9e509d3ed"
INVERTED_SHA = "464c43efa7ad491c5c1c044eb0ee4514168353431144f09b0da746163e5da0d5"
VIDEO_SHA = "9b91298d9e25fd367a4dda8af612b70e683a0cfa084348e22862432a0d543e14"


def entry_with(*files: dict) -> HistoryEntry:
    return HistoryEntry.from_json(
        "p",
        {
            "prompt": [1, "p", {}, {}, ["9"]],
            "outputs": {"9": {"images": list(files)}},
            "status": {"status_str": "success", "completed": True, "messages": []},
        },
    )


def sink(folder: Path) -> JobOutputs:
    """The outputs of the job whose folder in a folder store is ``folder``."""
    return JobOutputs(FolderFileStore(folder.parent.parent), folder.parent.name, folder.name)


def all_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    ("subfolder", "filename"),
    [
        ("", "../evil.png"),
        ("", ".."),
        ("", "a/b.png"),
        ("", "a\\b.png"),
        ("", "nul\x00.png"),
        ("", ""),
        ("..", "x.png"),
        ("video/../..", "x.png"),
        ("/etc", "passwd"),
        ("\\windows", "x.png"),
        ("C:", "x.png"),
        ("ok", "C:x.png"),
        ("", "two\nlines.png"),
        ("", "cr\r.png"),
        ("", "tab\t.png"),
        ("", "del\x7f.png"),
        ("", "c1\x85.png"),
        ("video\ntakes", "x.png"),
        ("video/ta\x1bkes", "x.png"),
    ],
)
def test_unsafe_names_are_refused(tmp_path, subfolder, filename):
    with pytest.raises(UnsafeOutputName):
        safe_output_path(tmp_path, subfolder, filename)


def test_a_symlink_leading_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "video").symlink_to(outside)
    with pytest.raises(UnsafeOutputName, match="outside"):
        safe_output_path(dest, "video", "shot.mp4")


def test_a_file_name_that_is_a_link_out_is_refused_and_one_within_is_taken(tmp_path):
    (tmp_path / "outside.png").write_bytes(b"theirs")
    dest = tmp_path / "dest"
    (dest / "takes").mkdir(parents=True)
    (dest / "shot.png").symlink_to(tmp_path / "outside.png")
    (dest / "video").symlink_to(dest / "takes", target_is_directory=True)
    with pytest.raises(UnsafeOutputName, match="outside"):
        safe_output_path(dest, "", "shot.png")
    assert safe_output_path(dest, "video", "s.mp4") == dest / "video" / "s.mp4"


def test_safe_names_keep_their_subfolders(tmp_path):
    assert safe_output_path(tmp_path, "", "a.png") == tmp_path / "a.png"
    assert safe_output_path(tmp_path, "video/takes", "s.mp4") == tmp_path / "video/takes/s.mp4"
    assert safe_output_path(tmp_path, "video\\takes", "s.mp4") == tmp_path / "video/takes/s.mp4"


async def test_both_images_of_the_recorded_success_land_with_their_sha256(tmp_path):
    replay = Replay("success")
    async with replay.client() as client:
        entry = await client.history("78d29e6e-ba18-4dda-b1c6-1bc2d5aef9de")
        assert entry is not None
        files = await download_outputs(client, entry, sink(tmp_path))
    assert [(f.path, f.sha256, f.bytes, f.node_id, f.key) for f in files] == [
        ("solid_00001_.png", SOLID_SHA, 543, "3", "images"),
        ("inverted_00001_.png", INVERTED_SHA, 543, "4", "images"),
    ]
    assert all_files(tmp_path) == ["inverted_00001_.png", "solid_00001_.png"]
    assert hashlib.sha256((tmp_path / "solid_00001_.png").read_bytes()).hexdigest() == SOLID_SHA


async def test_the_video_lands_in_its_subfolder(tmp_path):
    async with Replay("video").client() as client:
        entry = await client.history("6a1bcfb6-803e-44f5-9c6c-029f802a646e")
        assert entry is not None
        files = await download_outputs(client, entry, sink(tmp_path))
    assert [(f.path, f.sha256, f.bytes) for f in files] == [
        ("video/shot_00001_.mp4", VIDEO_SHA, 2594)
    ]
    assert all_files(tmp_path) == ["video/shot_00001_.mp4"]


async def test_previews_are_skipped_and_duplicates_fetched_once(tmp_path):
    fetched: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        fetched.append(request.query["filename"])
        return web.Response(body=b"png:" + request.query["filename"].encode() + PNG_END)

    entry = entry_with(
        {"filename": "preview.png", "subfolder": "", "type": "temp"},
        {"filename": "keep.png", "subfolder": "", "type": "output"},
        {"filename": "keep.png", "subfolder": "", "type": "output"},
    )
    async with answering(handle) as url, ComfyClient(url) as client:
        files = await download_outputs(client, entry, sink(tmp_path))
    assert fetched == ["keep.png"]
    assert [f.path for f in files] == ["keep.png"]
    assert (tmp_path / "keep.png").read_bytes() == b"png:keep.png" + PNG_END


async def test_an_unsafe_name_fails_before_any_request_or_file(tmp_path):
    fetched: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        fetched.append(str(request.url))
        return web.Response(body=b"x")

    entry = entry_with(
        {"filename": "ok.png", "subfolder": "", "type": "output"},
        {"filename": "../../escape.png", "subfolder": "", "type": "output"},
    )
    async with answering(handle) as url, ComfyClient(url) as client:
        with pytest.raises(UnsafeOutputName, match="escape"):
            await download_outputs(client, entry, sink(tmp_path / "dest"))
    assert fetched == []
    assert all_files(tmp_path) == []


async def test_a_download_cut_midway_leaves_no_file_behind(tmp_path):
    entry = entry_with({"filename": "big.mp4", "subfolder": "video", "type": "output"})
    async with raw_server("cut") as url, ComfyClient(url) as client:
        with pytest.raises(ConnectionLost, match="big.mp4"):
            await download_outputs(client, entry, sink(tmp_path))
    assert all_files(tmp_path) == []


async def test_a_missing_output_is_output_missing(tmp_path):
    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=404, body=b"")

    entry = entry_with({"filename": "gone.png", "subfolder": "", "type": "output"})
    async with answering(handle) as url, ComfyClient(url) as client:
        with pytest.raises(OutputMissing, match="gone.png"):
            await download_outputs(client, entry, sink(tmp_path))
    assert all_files(tmp_path) == []


async def test_a_file_over_the_limit_by_its_content_length_is_refused_before_a_byte_is_written(
    tmp_path,
):
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 89 + PNG_END)  # Content-Length: 101

    entry = entry_with({"filename": "big.png", "subfolder": "", "type": "output"})
    async with answering(handle) as url, ComfyClient(url) as client:
        with pytest.raises(OutputTooLarge, match="big.png: 101 bytes, over the limit of 100"):
            await download_outputs(client, entry, sink(tmp_path), max_bytes=100)
        files = await download_outputs(client, entry, sink(tmp_path), max_bytes=101)
    assert [(f.path, f.bytes) for f in files] == [("big.png", 101)]
    assert all_files(tmp_path) == ["big.png"]


class _Endless:
    """A body without Content-Length that never ends, as a broken server might send;
    ``hung_up`` is set when the client closes the connection."""

    def __init__(self) -> None:
        self.sent = 0
        self.hung_up = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while self.sent < 1 << 30:
                await response.write(b"y" * 1000)
                self.sent += 1000
        except ConnectionError:  # the client went away: what the test waits for
            self.hung_up.set()
        return response


async def test_a_stream_past_the_limit_fails_and_leaves_no_partial_file(tmp_path):
    endless = _Endless()
    entry = entry_with({"filename": "endless.mp4", "subfolder": "video", "type": "output"})
    async with answering(endless.handle) as url:
        async with ComfyClient(url) as client:
            with pytest.raises(OutputTooLarge, match="endless.mp4: more than 2500 bytes") as info:
                await download_outputs(client, entry, sink(tmp_path), max_bytes=2500)
        async with asyncio.timeout(30):
            await endless.hung_up.wait()  # we stopped reading and closed the connection
    assert not info.value.transient  # the same prompt writes the same file again
    assert endless.sent < 64 << 20  # what the sockets' buffers took before we hung up
    assert all_files(tmp_path) == []


RED_PNG = solid_png(64, 64, (255, 0, 0), [], 6)


@pytest.mark.parametrize(
    ("body", "content_type", "said"),
    [
        # A login page of a proxy in between answers 200 text/html: not the PNG /history lists.
        (
            b"<html>please log in</html>",
            "text/html",
            "answered text/html, not the file (image/png expected)",
        ),
        # A proxy that sends half the file, and says so in its Content-Length: only the
        # PNG's own end (IEND) tells.
        (
            RED_PNG[: len(RED_PNG) // 2],
            "image/png",
            "of a PNG without its end (IEND chunk)",
        ),
    ],
)
async def test_a_view_answer_that_is_not_the_file_is_refused_and_nothing_is_kept(
    tmp_path, body, content_type, said
):
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    entry = entry_with({"filename": "solid_00001_.png", "subfolder": "", "type": "output"})
    async with answering(handle) as url, ComfyClient(url) as client:
        with pytest.raises(NotTheFile) as info:
            await download_outputs(client, entry, sink(tmp_path))
    assert said in str(info.value)
    assert info.value.transient
    assert all_files(tmp_path) == []


@pytest.mark.parametrize(
    ("filename", "content_type"),
    [
        ("a.png", "image/png"),
        ("clip.mp4", "video/mp4"),
        ("page.html", "application/octet-stream"),  # ComfyUI never serves HTML as HTML
        ("mesh.unknownext", "application/octet-stream"),
    ],
)
def test_the_view_content_type_is_the_one_comfyui_sends(filename, content_type):
    assert view_content_type(filename) == content_type


def test_stale_outputs_are_removed_and_nothing_outside_the_job_folder(tmp_path):
    job_dir = tmp_path / "p" / "job"
    (job_dir / "video").mkdir(parents=True)
    for name in ("a.png", "old.png", "video/s.mp4", "video/old.mp4"):
        (job_dir / name).write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.png").write_bytes(b"keep")
    (job_dir / "linked").symlink_to(elsewhere, target_is_directory=True)
    (job_dir / "file-link.png").symlink_to(elsewhere / "precious.png")
    kept = [OutputFile("a.png", "0" * 64, 1), OutputFile("video/s.mp4", "0" * 64, 1)]
    FolderFileStore(tmp_path).remove_stale_outputs("p", "job", kept, 1)
    left = sorted(
        (Path(folder) / name).relative_to(job_dir).as_posix()
        for folder, dirs, names in os.walk(job_dir)
        for name in dirs + names
    )
    assert left == ["a.png", "linked", "video", "video/s.mp4"]
    assert (elsewhere / "precious.png").read_bytes() == b"keep"
