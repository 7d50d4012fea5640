"""Input files, the same assertions against the fake and, when ``COMFYUI_URL`` is set,
against a real ComfyUI v0.8.0 (data/recorded/upload.json; model-free workflows only).

On a real server the tests leave their small files in its input folder, under names
made unique per run (the recording's suffix replaced by a fresh one).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.follow import PromptFollower
from fake_comfy import FakeComfy
from tests.support import fake_or_real_url
from tests.upload_support import (
    animated_png,
    decoded_frames,
    every_value_png,
    invert_workflow,
    inverted_as_comfyui_saves,
    last_frame_workflow,
    png_pixels,
    raw_upload,
    solid_png,
    upload_recording,
    video_from_frames_workflow,
    with_token,
)

pytestmark = pytest.mark.timeout(180)

FIRST, OTHER, REPLACED = solid_png((200, 30, 30)), solid_png((30, 200, 30)), solid_png((9, 9, 9))
NOT_A_VIDEO = b"not a video, thirty bytes long"
# The bytes of the recorded uploads before the first prompt, in order (test_fake_upload.py).
UPLOAD_BYTES = [FIRST, FIRST, OTHER, REPLACED, FIRST, FIRST, FIRST, FIRST, FIRST, None, NOT_A_VIDEO]


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.real_comfyui)])
async def server_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    fake = FakeComfy(prompt_seconds=0.001, output_dir=tmp_path / "out")
    async with fake_or_real_url(request.param, fake) as url:
        yield url


def fresh(value: Any, token: str) -> Any:
    """A recorded request or answer with names unique to this run: the recording's
    suffix, and the ``evil.png`` of its "../" upload, made ``token``'s."""
    return _evil(with_token(value, token), token)


def _evil(value: Any, token: str) -> Any:
    if isinstance(value, dict):
        return {k: _evil(v, token) for k, v in value.items()}
    if isinstance(value, list):
        return [_evil(v, token) for v in value]
    if isinstance(value, str):
        return value.replace("evil.png", f"evil_{token}.png")
    return value


def recorded(path: str) -> list[dict[str, Any]]:
    return [
        ex
        for ex in upload_recording()["exchanges"]
        if ex["kind"] == "http" and ex["request"]["path"] == path
    ]


async def run(url: str, prompt: dict[str, Any]) -> dict[str, Any]:
    """Posts ``prompt``, follows it to its end, returns its /history entry."""
    client_id, prompt_id = uuid.uuid4().hex, str(uuid.uuid4())
    async with ComfyClient(url) as client, PromptFollower(client, client_id, poll_s=0.2) as f:
        post = await client.post_prompt(prompt, prompt_id=prompt_id, client_id=client_id)
        outcome = await f.wait(prompt_id, post.number, deadline_s=150)
    assert outcome.status == "success", outcome
    async with httpx.AsyncClient(base_url=url) as http:
        return (await http.get(f"/history/{prompt_id}")).json()[prompt_id]


async def output(url: str, entry: dict[str, Any], node: str, index: int = 0) -> bytes:
    item = entry["outputs"][node]["images"][index]
    async with httpx.AsyncClient(base_url=url) as http:
        answer = await http.get("/view", params=item)
    assert answer.status_code == 200, item
    return answer.content


async def upload(url: str, name: str, data: bytes, **fields: str) -> dict[str, Any]:
    content_type = "video/mp4" if name.endswith(".mp4") else "image/png"
    async with httpx.AsyncClient(base_url=url) as http:
        answer = await raw_upload(
            http, {"image": {"filename": name, "content_type": content_type}, **fields}, data
        )
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_uploads_are_answered_as_recorded(server_url: str) -> None:
    token = uuid.uuid4().hex[:6]
    uploads = recorded("/upload/image")[: len(UPLOAD_BYTES)]
    async with httpx.AsyncClient(base_url=server_url) as http:
        for ex, data in zip(uploads, UPLOAD_BYTES, strict=True):
            got = await raw_upload(http, fresh(ex["request"]["multipart"], token), data)
            want = fresh(ex["response"], token)
            body = got.json() if want["status"] == 200 else got.text
            assert (got.status_code, got.headers.get("content-type"), body) == (
                want["status"],
                want["content_type"],
                want["body"],
            ), ex["request"]["multipart"]
        view = await http.get(
            "/view",
            params={"filename": "key.png", "subfolder": f"keyframes_{token}", "type": "input"},
        )
        info = (await http.get("/object_info/LoadImage")).json()
    assert (view.status_code, view.headers["content-type"], view.content) == (
        200,
        "image/png",
        REPLACED,
    )
    listed = info["LoadImage"]["input"]["required"]["image"][0]
    assert {f"flat_{token}.png", f"evil_{token}.png"} <= set(listed)
    assert not [name for name in listed if token in name and "/" in name]


async def test_a_missing_input_is_refused_at_validation_as_recorded(server_url: str) -> None:
    token = uuid.uuid4().hex[:6]
    missing = recorded("/prompt")[-1]
    body = fresh(missing["request"]["body"], token)
    body["prompt_id"] = str(uuid.uuid4())
    async with httpx.AsyncClient(base_url=server_url) as http:
        answer = await http.post("/prompt", json=body)
    assert (answer.status_code, answer.json()) == (400, fresh(missing["response"]["body"], token))


async def test_load_image_is_cached_on_the_bytes_of_its_file(server_url: str) -> None:
    token = uuid.uuid4().hex[:6]
    prompt = fresh(recorded("/prompt")[0]["request"]["body"]["prompt"], token)
    subfolder = f"keyframes_{token}"
    await upload(server_url, "key.png", FIRST, subfolder=subfolder)
    first = await run(server_url, prompt)
    again = await run(server_url, prompt)
    await upload(server_url, "key.png", OTHER, subfolder=subfolder, overwrite="true")
    changed = await run(server_url, prompt)
    entries = (first, again, changed)
    cached = [e["status"]["messages"][1][1]["nodes"] for e in entries]
    names = [e["outputs"]["2"]["images"][0]["filename"] for e in entries]
    assert cached == [[], ["1", "2"], []]
    assert names == [
        f"upl_{token}_00001_.png",
        f"upl_{token}_00001_.png",
        f"upl_{token}_00002_.png",
    ]
    assert (png_pixels(await output(server_url, first, "2")) == png_pixels(FIRST)).all()
    assert (png_pixels(await output(server_url, changed, "2")) == png_pixels(OTHER)).all()


async def test_an_inverted_upload_has_comfyuis_float32_pixels(server_url: str) -> None:
    token = uuid.uuid4().hex[:6]
    data, pixels = every_value_png(seed=11)
    stored = await upload(server_url, f"pic_{token}.png", data, subfolder=f"in_{token}")
    image = f"{stored['subfolder']}/{stored['name']}"
    entry = await run(server_url, invert_workflow(image, f"inv_{token}"))
    saved = png_pixels(await output(server_url, entry, "3"))
    # 255 - v, or one less where float32 rounds 255 * (1 - v / 255) below the integer.
    assert (saved == inverted_as_comfyui_saves(pixels)).all()
    assert ((255 - pixels.astype(int)) - saved.astype(int)).max() == 1


async def test_the_last_frame_of_an_uploaded_video_is_image_from_batch_4095(
    server_url: str,
) -> None:
    token = uuid.uuid4().hex[:6]
    folder = f"in_{token}"
    frames = await upload(server_url, f"frames_{token}.png", animated_png(5), subfolder=folder)
    made = await run(
        server_url,
        video_from_frames_workflow(f"{folder}/{frames['name']}", f"video/clip_{token}"),
    )
    mp4 = await output(server_url, made, "3")
    clip = await upload(server_url, f"clip_{token}.mp4", mp4, subfolder=folder)
    entry = await run(server_url, last_frame_workflow(f"{folder}/{clip['name']}", f"last_{token}"))
    decoded = decoded_frames(mp4)
    assert len(decoded) == 5
    assert (png_pixels(await output(server_url, entry, "4")) == decoded[-1]).all()


async def test_a_video_of_pictures_of_odd_size_fails_in_libx264(server_url: str) -> None:
    token = uuid.uuid4().hex[:6]
    frames = await upload(server_url, f"odd_{token}.png", animated_png(2, (33, 21)))
    workflow = video_from_frames_workflow(frames["name"], f"video/odd_{token}")
    client_id, prompt_id = uuid.uuid4().hex, str(uuid.uuid4())
    async with (
        ComfyClient(server_url) as client,
        PromptFollower(client, client_id, poll_s=0.2) as follower,
    ):
        post = await client.post_prompt(workflow, prompt_id=prompt_id, client_id=client_id)
        outcome = await follower.wait(prompt_id, post.number, deadline_s=150)
    assert outcome.status == "error" and outcome.error is not None
    assert (outcome.error.node_type, outcome.error.exception_type) == (
        "SaveVideo",
        "av.error.ExternalError",
    )
    assert 'avcodec_open2("libx264", {})' in outcome.error.exception_message


async def test_load_video_is_cached_on_the_time_its_file_was_written(server_url: str) -> None:
    # LoadVideo's fingerprint_inputs is the file's modification time, not its sha256
    # (comfy_extras/nodes_video.py): the same bytes written again render again.
    token = uuid.uuid4().hex[:6]
    folder = f"in_{token}"
    frames = await upload(server_url, f"frames_{token}.png", animated_png(3), subfolder=folder)
    made = await run(
        server_url,
        video_from_frames_workflow(f"{folder}/{frames['name']}", f"video/clip_{token}"),
    )
    mp4 = await output(server_url, made, "3")
    await upload(server_url, "clip.mp4", mp4, subfolder=folder)
    workflow = last_frame_workflow(f"{folder}/clip.mp4", f"last_{token}")
    first = await run(server_url, workflow)
    await upload(server_url, "clip.mp4", mp4, subfolder=folder)  # the same bytes: not written
    same = await run(server_url, workflow)
    await upload(server_url, "clip.mp4", mp4, subfolder=folder, overwrite="true")
    rewritten = await run(server_url, workflow)
    names = [e["outputs"]["4"]["images"][0]["filename"] for e in (first, same, rewritten)]
    assert names == [f"last_{token}_00001_.png"] * 2 + [f"last_{token}_00002_.png"]
