"""The same protocol assertions against the fake server and, when ``COMFYUI_URL`` is set,
against a real ComfyUI (model-free workflows only, so any install can run them)."""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from comfy_assets.comfy.client import ComfyClient
from comfy_assets.comfy.download import download_outputs
from comfy_assets.comfy.errors import PromptRejected
from comfy_assets.comfy.follow import PromptFollower, PromptOutcome
from fake_comfy import FakeComfy
from tests.render.test_download import sink
from tests.support import fake_or_real_url

pytestmark = pytest.mark.timeout(120)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def image_workflow(color: int) -> dict:
    """success.json: two SaveImage outputs (solid and inverted)."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": color},
        },
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {
            "class_type": "SaveImage",
            "inputs": {"images": ["1", 0], "filename_prefix": "contract_solid"},
        },
        "4": {
            "class_type": "SaveImage",
            "inputs": {"images": ["2", 0], "filename_prefix": "contract_inverted"},
        },
    }


def video_workflow(color: int) -> dict:
    """video.json: 24 frames → CreateVideo → SaveVideo under ``video/``."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 128, "height": 72, "batch_size": 24, "color": color},
        },
        "2": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": 24.0}},
        "3": {
            "class_type": "SaveVideo",
            "inputs": {
                "video": ["2", 0],
                "filename_prefix": "video/contract_shot",
                "format": "mp4",
                "codec": "h264",
            },
        },
    }


def error_workflow(color: int) -> dict:
    """execution_error.json: ImageToMask alpha of an RGB image → IndexError."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": color},
        },
        "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "alpha"}},
        "3": {"class_type": "MaskToImage", "inputs": {"mask": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "mask"}},
    }


@pytest.fixture(
    params=["fake", pytest.param("real", marks=pytest.mark.real_comfyui)],
)
async def server_url(request, tmp_path) -> AsyncIterator[str]:
    fake = FakeComfy(prompt_seconds=0.01, output_dir=tmp_path / "fake-output")
    async with fake_or_real_url(request.param, fake) as url:
        yield url


async def run(client: ComfyClient, workflow: dict) -> tuple[PromptOutcome, int]:
    client_id, prompt_id = uuid.uuid4().hex, str(uuid.uuid4())
    async with PromptFollower(client, client_id, poll_s=0.2) as follower:
        post = await client.post_prompt(workflow, prompt_id=prompt_id, client_id=client_id)
        outcome = await follower.wait(prompt_id, post.number, deadline_s=100)
    return outcome, post.number


def color() -> int:
    return random.randrange(0, 0xFFFFFF)  # a fresh input, so no run is served from cache


async def test_system_stats_has_a_version_and_devices_with_memory(server_url):
    async with ComfyClient(server_url) as client:
        stats = await client.system_stats()
        queue = await client.queue()
    assert stats.comfyui_version
    assert stats.devices
    for device in stats.devices:
        assert device.name and device.type
        assert 0 <= device.vram_free <= device.vram_total
    assert len(queue.running) <= 1  # one prompt at a time per server (README fact 1)
    assert queue.length == len(queue.running) + len(queue.pending)


async def test_two_output_image_workflow_is_followed_and_downloaded(server_url, tmp_path):
    dest = tmp_path / "dest"
    async with ComfyClient(server_url) as client:
        outcome, number = await run(client, image_workflow(color()))
        assert outcome.status == "success"
        assert outcome.history is not None and outcome.history.number == number
        files = await download_outputs(client, outcome.history, sink(dest))
    assert sorted(f.node_id for f in files) == ["3", "4"]
    for f in files:
        data = (dest / f.path).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f.bytes, f.sha256)
    assert len({f.sha256 for f in files}) == 2  # solid and inverted differ
    assert not [p for p in Path(dest).rglob("*.part")]


async def test_validation_error_is_a_400_naming_the_node(server_url):
    bad = image_workflow(color())
    bad["1"]["inputs"]["width"] = -5
    async with ComfyClient(server_url) as client:
        with pytest.raises(PromptRejected) as info:
            await client.post_prompt(bad, prompt_id=str(uuid.uuid4()), client_id="c")
    assert info.value.error_type == "prompt_outputs_failed_validation"
    assert list(info.value.node_errors) == ["1"]
    assert "node 1 (EmptyImage): Value -5 smaller than min of 1 [width]" in str(info.value)


async def test_video_is_listed_under_images_and_downloads_as_mp4(server_url, tmp_path):
    async with ComfyClient(server_url) as client:
        outcome, _ = await run(client, video_workflow(color()))
        assert outcome.status == "success" and outcome.history is not None
        outputs = outcome.history.outputs["3"]
        assert outputs.get("animated") == [True]
        [video] = [f for f in outcome.history.output_files if f.type == "output"]
        assert (video.key, video.subfolder) == ("images", "video")
        assert video.filename.endswith(".mp4")
        files = await download_outputs(client, outcome.history, sink(tmp_path))
    [saved] = files
    assert saved.path == f"video/{video.filename}"
    assert (tmp_path / saved.path).read_bytes()[4:8] == b"ftyp"


async def test_node_exception_is_an_error_outcome(server_url):
    async with ComfyClient(server_url) as client:
        outcome, _ = await run(client, error_workflow(color()))
    assert outcome.status == "error"
    assert outcome.error is not None
    assert (outcome.error.node_id, outcome.error.exception_type) == ("2", "IndexError")


async def test_unknown_history_id_is_none(server_url):
    async with ComfyClient(server_url) as client:
        assert await client.history(str(uuid.uuid4())) is None
