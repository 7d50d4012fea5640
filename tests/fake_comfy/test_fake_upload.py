"""Input files on the fake ComfyUI, against the recording of a real one (upload.json):
POST /upload/image, LoadImage / LoadVideo of what was uploaded, on real pixels, the cache
keyed on the file's bytes; and ComfyClient.upload_input against the fake."""

from __future__ import annotations

import io
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image, ImageSequence

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.errors import InputRejected, ServerError, UnexpectedAnswer
from fake_comfy import FakeComfy
from tests.fake_comfy.recordings import scrub
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
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0

# Three pictures under one name: the first upload, other bytes, the overwrite's bytes.
FIRST, OTHER, REPLACED = solid_png((200, 30, 30)), solid_png((30, 200, 30)), solid_png((9, 9, 9))
NOT_A_VIDEO = b"not a video, thirty bytes long"


def recorded_uploads() -> list[dict[str, Any]]:
    """The uploads of upload.json before its first prompt."""
    uploads = []
    for ex in upload_recording()["exchanges"]:
        if ex["kind"] == "http" and ex["request"]["path"] == "/prompt":
            return uploads
        if ex["kind"] == "http" and ex["request"]["path"] == "/upload/image":
            uploads.append(ex)
    raise LookupError("upload.json: no prompt after the uploads")


# The bytes of each recorded upload, in order (the recording's notes say which are equal).
UPLOAD_BYTES = [
    FIRST,  # new
    FIRST,  # same name, same bytes
    OTHER,  # same name, other bytes → "key (1).png"
    REPLACED,  # overwrite=true
    FIRST,  # no subfolder, type omitted
    FIRST,  # type=temp
    FIRST,  # subfolder climbing out → 400
    FIRST,  # "../evil.png"
    FIRST,  # type=models → 500
    None,  # no image field → 400
    NOT_A_VIDEO,  # clip.mp4
]


def recorded_http(index: int) -> dict[str, Any]:
    """The index-th http exchange of upload.json that is not an upload (prompts, history)."""
    others = [
        ex
        for ex in upload_recording()["exchanges"]
        if ex["kind"] == "http" and ex["request"]["path"] != "/upload/image"
    ]
    return others[index]


@pytest.fixture
def fake(tmp_path: Path) -> FakeComfy:
    return FakeComfy(prompt_seconds=0.001, output_dir=tmp_path / "out", input_dir=tmp_path / "in")


async def run_prompt(
    fake: FakeComfy, http: httpx.AsyncClient, prompt: dict[str, Any], **body: Any
) -> dict[str, Any]:
    """Posts ``prompt`` and returns its history entry once the fake is idle."""
    prompt_id = body.pop("prompt_id", str(uuid.uuid4()))
    answer = await http.post("/prompt", json={"prompt": prompt, "prompt_id": prompt_id, **body})
    assert answer.status_code == 200, answer.text
    await fake.wait_idle(WAIT_S)
    return (await http.get(f"/history/{prompt_id}")).json()[prompt_id]


def output_bytes(fake: FakeComfy, entry: dict[str, Any], node: str) -> bytes:
    [item] = entry["outputs"][node]["images"]
    return (fake.output_dir / item["subfolder"] / item["filename"]).read_bytes()


async def upload(http: httpx.AsyncClient, name: str, data: bytes, **fields: str) -> dict[str, Any]:
    answer = await raw_upload(
        http, {"image": {"filename": name, "content_type": "image/png"}, **fields}, data
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


# -- POST /upload/image as recorded ------------------------------------------------------


async def test_every_recorded_upload_is_answered_as_recorded(fake: FakeComfy) -> None:
    uploads = recorded_uploads()
    assert len(uploads) == len(UPLOAD_BYTES)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        for ex, data in zip(uploads, UPLOAD_BYTES, strict=True):
            got = await raw_upload(http, ex["request"]["multipart"], data)
            want = ex["response"]
            body = got.json() if want["status"] == 200 else got.text
            assert (got.status_code, got.headers.get("content-type"), body) == (
                want["status"],
                want["content_type"],
                want["body"],
            ), ex["request"]["multipart"]
        view = await http.get(
            "/view",
            params={"filename": "key.png", "subfolder": "keyframes_8fd0fd", "type": "input"},
        )
        info = (await http.get("/object_info/LoadImage")).json()
    assert (view.status_code, view.headers["content-type"], view.content) == (
        200,
        "image/png",
        REPLACED,
    )
    inputs = fake.input_dir
    assert (inputs / "keyframes_8fd0fd" / "key.png").read_bytes() == REPLACED
    assert (inputs / "keyframes_8fd0fd" / "key (1).png").read_bytes() == OTHER
    assert (inputs / "evil.png").read_bytes() == FIRST  # "../" climbed out of the subfolder
    assert (inputs / "keyframes_8fd0fd" / "clip_8fd0fd.mp4").read_bytes() == NOT_A_VIDEO
    assert (fake.temp.root / "tmp_8fd0fd.png").read_bytes() == FIRST
    assert not (inputs.parent / "etc").exists()
    # Only the top of the input folder is listed, images only (upload.json).
    assert info["LoadImage"]["input"]["required"]["image"][0] == ["evil.png", "flat_8fd0fd.png"]
    stats = fake.stats
    assert stats["requests"]["POST /upload/image"] == 11
    assert stats["uploads"] == 8
    assert {name: n["count"] for name, n in stats["uploaded"].items()} == {
        "keyframes_8fd0fd/key.png": 3,
        "keyframes_8fd0fd/key (1).png": 1,
        "flat_8fd0fd.png": 1,
        "tmp_8fd0fd.png [temp]": 1,
        "keyframes_8fd0fd/../evil.png": 1,
        "keyframes_8fd0fd/clip_8fd0fd.mp4": 1,
    }


async def test_each_rename_takes_the_next_free_number(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        names = [
            (await upload(http, "shot.png", solid_png((i, 0, 0)), subfolder="s"))["name"]
            for i in range(3)
        ]
        again = await upload(http, "shot.png", solid_png((1, 0, 0)), subfolder="s")
    assert names == ["shot.png", "shot (1).png", "shot (2).png"]
    assert again["name"] == "shot (1).png"  # the bytes already there under that name


async def test_two_fakes_have_input_folders_of_their_own() -> None:
    one, two = FakeComfy(prompt_seconds=0.001), FakeComfy(prompt_seconds=0.001)
    async with one.serve() as url_one, two.serve() as url_two:
        async with httpx.AsyncClient(base_url=url_one) as http:
            await upload(http, "only_here.png", FIRST)
        async with httpx.AsyncClient(base_url=url_two) as http:
            view = await http.get("/view", params={"filename": "only_here.png", "type": "input"})
    assert one.input_dir != two.input_dir
    assert (one.input_dir / "only_here.png").read_bytes() == FIRST
    assert view.status_code == 404


# -- LoadImage of an upload: validation, cache, pixels -----------------------------------


async def test_load_image_runs_then_replays_then_runs_again_for_new_bytes_as_recorded(
    fake: FakeComfy,
) -> None:
    # upload.json: the prompt of exchange 26 run, posted again (fully cached, the old name
    # replayed), then the file overwritten with other bytes and the prompt run again.
    first, first_history = recorded_http(1), recorded_http(2)
    again, again_history = recorded_http(3), recorded_http(4)
    changed, changed_history = recorded_http(5), recorded_http(6)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        await upload(http, "key.png", FIRST, type="input", subfolder="keyframes_8fd0fd")
        entries = [await run_prompt(fake, http, **first["request"]["body"])]
        written = sorted(p.name for p in fake.output_dir.iterdir())
        entries.append(await run_prompt(fake, http, **again["request"]["body"]))
        assert sorted(p.name for p in fake.output_dir.iterdir()) == written  # nothing new
        await upload(
            http, "key.png", OTHER, type="input", subfolder="keyframes_8fd0fd", overwrite="true"
        )
        entries.append(await run_prompt(fake, http, **changed["request"]["body"]))
    for entry, recorded in zip(
        entries, (first_history, again_history, changed_history), strict=True
    ):
        [(prompt_id, want)] = recorded["response"]["body"].items()
        assert scrub(entry) == scrub(want), prompt_id
    assert written == ["upl_8fd0fd_00001_.png"]
    # Each output holds the pixels of the bytes LoadImage read at the time.
    assert (png_pixels(output_bytes(fake, entries[0], "2")) == png_pixels(FIRST)).all()
    assert (png_pixels(output_bytes(fake, entries[2], "2")) == png_pixels(OTHER)).all()
    assert [r["outcome"] for r in fake.stats["runs"]] == ["success"] * 3


async def test_a_missing_input_is_the_recorded_400_and_nothing_is_queued(fake: FakeComfy) -> None:
    missing = recorded_http(7)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        answer = await http.post("/prompt", json=missing["request"]["body"])
    assert (answer.status_code, answer.json()) == (400, missing["response"]["body"])
    assert fake.stats["runs"] == []


async def test_inverting_an_uploaded_picture_writes_its_pixel_inverse(fake: FakeComfy) -> None:
    data, pixels = every_value_png(seed=7)
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        answer = await upload(http, "pic.png", data, subfolder="in")
        entry = await run_prompt(fake, http, invert_workflow(f"in/{answer['name']}", "inv"))
    saved = png_pixels(output_bytes(fake, entry, "3"))
    assert saved.shape == pixels.shape
    assert (saved == inverted_as_comfyui_saves(pixels)).all()
    # float32 truncation: 255 - v, or one less (real ComfyUI does the same:
    # tests/comfy/test_contract_upload.py checks it against a real server).
    off = (255 - pixels.astype(int)) - saved.astype(int)
    assert set(np.unique(off)) == {0, 1}


async def test_the_same_bytes_again_replay_and_new_bytes_render_again(fake: FakeComfy) -> None:
    workflow = invert_workflow("in/pic.png", "inv")
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        await upload(http, "pic.png", FIRST, subfolder="in")
        first = await run_prompt(fake, http, workflow)
        await upload(http, "pic.png", FIRST, subfolder="in", overwrite="true")
        same = await run_prompt(fake, http, workflow)
        await upload(http, "pic.png", OTHER, subfolder="in", overwrite="true")
        new = await run_prompt(fake, http, workflow)
    cached = [e["status"]["messages"][1][1]["nodes"] for e in (first, same, new)]
    assert cached == [[], ["1", "2", "3"], []]
    names = [e["outputs"]["3"]["images"][0]["filename"] for e in (first, same, new)]
    assert names == ["inv_00001_.png", "inv_00001_.png", "inv_00002_.png"]
    assert sorted(p.name for p in fake.output_dir.iterdir()) == ["inv_00001_.png", "inv_00002_.png"]
    expected = inverted_as_comfyui_saves(png_pixels(OTHER))
    assert (png_pixels(output_bytes(fake, new, "3")) == expected).all()


async def test_bytes_that_are_not_an_image_fail_when_load_image_runs(fake: FakeComfy) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        await upload(http, "bad.png", NOT_A_VIDEO)
        entry = await run_prompt(fake, http, invert_workflow("bad.png", "bad"))
    assert entry["status"]["status_str"] == "error"
    [error] = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert (error["node_type"], error["exception_type"]) == (
        "LoadImage",
        "PIL.UnidentifiedImageError",
    )
    assert error["exception_message"].startswith("cannot identify image file")


# -- videos: LoadVideo → GetVideoComponents → ImageFromBatch ----------------------------


async def test_image_from_batch_4095_of_an_uploaded_video_is_its_last_frame(
    fake: FakeComfy,
) -> None:
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        # The video is the fake's own: an animated PNG of 5 pictures, LoadImage,
        # CreateVideo, SaveVideo.
        frames = await upload(http, "frames.png", animated_png(5), subfolder="in")
        made = await run_prompt(
            fake, http, video_from_frames_workflow(f"in/{frames['name']}", "video/clip")
        )
        mp4 = output_bytes(fake, made, "3")
        clip = await raw_upload(
            http,
            {"image": {"filename": "clip.mp4", "content_type": "video/mp4"}, "subfolder": "in"},
            mp4,
        )
        entry = await run_prompt(fake, http, last_frame_workflow("in/clip.mp4", "last"))
    assert clip.json() == {"name": "clip.mp4", "subfolder": "in", "type": "input"}
    decoded = decoded_frames(mp4)
    assert len(decoded) == 5
    assert not (decoded[-1] == decoded[0]).all()  # so picking the last one shows
    assert (png_pixels(output_bytes(fake, entry, "4")) == decoded[-1]).all()


async def test_repeat_and_from_batch_pick_frames_like_comfyui(fake: FakeComfy) -> None:
    workflow = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "frames.png"}},
        "2": {"class_type": "RepeatImageBatch", "inputs": {"image": ["1", 0], "amount": 2}},
        "3": {
            "class_type": "ImageFromBatch",
            "inputs": {"image": ["2", 0], "batch_index": 2, "length": 4096},
        },
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "b"}},
    }
    async with fake.serve() as url, httpx.AsyncClient(base_url=url) as http:
        await upload(http, "frames.png", animated_png(3))
        entry = await run_prompt(fake, http, workflow)
    # Frames 0 1 2 repeated twice: 0 1 2 0 1 2; from index 2, the length is clamped to
    # the 4 images left: 2 0 1 2.
    with Image.open(io.BytesIO(animated_png(3))) as apng:
        frames = [np.array(f.convert("RGB")) for f in ImageSequence.Iterator(apng)]
    files = entry["outputs"]["4"]["images"]
    assert [f["filename"] for f in files] == [f"b_0000{i}_.png" for i in range(1, 5)]
    saved = [png_pixels((fake.output_dir / f["filename"]).read_bytes()) for f in files]
    assert [[(s == f).all() for f in frames] for s in saved] == [
        [False, False, True],
        [True, False, False],
        [False, True, False],
        [False, False, True],
    ]


# -- ComfyClient.upload_input against the fake -------------------------------------------


async def test_upload_input_answers_the_stored_name_and_the_prompt_name(fake: FakeComfy) -> None:
    async with fake.serve() as url, ComfyClient(url, name="gpu0") as client:
        first = await client.upload_input(FIRST, "key.png", subfolder="comfy_assets")
        same = await client.upload_input(FIRST, "key.png", subfolder="comfy_assets")
        renamed = await client.upload_input(OTHER, "key.png", subfolder="comfy_assets")
        replaced = await client.upload_input(
            OTHER, "key.png", subfolder="comfy_assets", overwrite=True
        )
        top = await client.upload_input(FIRST, "top.png")
    assert (first.name, first.subfolder, first.type) == ("key.png", "comfy_assets", "input")
    assert same == first and replaced == first
    assert renamed.name == "key (1).png"
    assert renamed.prompt_name == "comfy_assets/key (1).png"
    assert top.prompt_name == "top.png"
    assert (fake.input_dir / "comfy_assets" / "key.png").read_bytes() == OTHER
    assert fake.stats["uploads"] == 5


async def test_a_refused_upload_is_permanent_and_a_500_is_transient(fake: FakeComfy) -> None:
    async with fake.serve() as url, ComfyClient(url, name="gpu0") as client:
        with pytest.raises(InputRejected) as refused:
            await client.upload_input(FIRST, "key.png", subfolder="../../etc")
        with pytest.raises(ServerError) as error:
            await client.upload_input(FIRST, "key.png", type="models")
        with pytest.raises(ValueError, match=r'upload file name "\.\./evil\.png"'):
            await client.upload_input(FIRST, "../evil.png")
    assert not refused.value.transient and refused.value.status == 400
    assert str(refused.value) == (
        "gpu0: POST /upload/image ../../etc/key.png 400, refused, no reason given (ComfyUI "
        "answers so for a subfolder or name that leaves its input folder, or a request "
        "without a file)"
    )
    assert error.value.transient and error.value.status == 500
    assert fake.stats["requests"]["POST /upload/image"] == 2  # the bad name was not sent
    assert fake.stats["uploads"] == 0


@pytest.mark.parametrize(
    "answer, reason",
    [
        ({"name": "../evil.png", "subfolder": "s", "type": "input"}, "'..' in it"),
        ({"name": "a/b.png", "subfolder": "s", "type": "input"}, "a path separator in it"),
        ({"name": "b\n.png", "subfolder": "s", "type": "input"}, "control character U+000A"),
        ({"name": "b.png", "subfolder": "other", "type": "input"}, "not those sent"),
    ],
)
async def test_an_unsafe_or_foreign_answer_is_unexpected(
    answer: dict[str, str], reason: str, monkeypatch: pytest.MonkeyPatch, fake: FakeComfy
) -> None:
    from fake_comfy.upload import UploadAnswer

    monkeypatch.setattr(
        "fake_comfy.server.store_upload", lambda post, folders: UploadAnswer(200, answer)
    )
    async with fake.serve() as url, ComfyClient(url, name="gpu0") as client:
        with pytest.raises(UnexpectedAnswer, match=re.escape(reason)) as info:
            await client.upload_input(FIRST, "b.png", subfolder="s")
    assert not info.value.transient
    assert "\n" not in str(info.value)
