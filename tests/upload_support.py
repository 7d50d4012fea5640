"""Pictures, videos and workflows of the input-file tests, on the fake and a real ComfyUI
(data/recorded/upload.json)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
from PIL import Image

RECORDED = Path(__file__).resolve().parent.parent / "data" / "recorded"
TOKEN = "8fd0fd"  # the recording's own suffix of names, replaced by a fresh one per run


def upload_recording() -> dict[str, Any]:
    return json.loads((RECORDED / "upload.json").read_text())


def with_token(value: Any, token: str) -> Any:
    """``value`` (JSON) with the recording's name suffix replaced by ``token``."""
    return json.loads(json.dumps(value).replace(TOKEN, token))


def solid_png(rgb: tuple[int, int, int], size: tuple[int, int] = (4, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def every_value_png(seed: int, size: tuple[int, int] = (48, 32)) -> tuple[bytes, np.ndarray]:
    """An RGB PNG whose channels hold every value 0..255 (then random ones), and its
    pixels as uint8 (height, width, 3)."""
    rng = np.random.default_rng(seed)
    width, height = size
    values = np.concatenate(
        [np.arange(256, dtype=np.uint8), rng.integers(0, 256, width * height * 3 - 256)]
    ).astype(np.uint8)
    pixels = rng.permutation(values).reshape(height, width, 3)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue(), pixels


def inverted_as_comfyui_saves(pixels: np.ndarray) -> np.ndarray:
    """LoadImage → ImageInvert → SaveImage in ComfyUI's float32 arithmetic:
    ``clip(255 * (1 - v / 255), 0, 255)`` truncated to uint8."""
    loaded = pixels.astype(np.float32) / 255.0
    return np.clip(255.0 * (np.float32(1.0) - loaded), 0, 255).astype(np.uint8)


def animated_png(frames: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """An APNG of ``frames`` different pictures (a bar moving right over a gradient):
    LoadImage reads it as a batch of ``frames`` images."""
    width, height = size
    pictures = []
    for i in range(frames):
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
        pixels[..., 2] = 40 * i
        bar = (i * width) // frames
        pixels[:, bar : bar + width // frames, 1] = 255
        pictures.append(Image.fromarray(pixels))
    out = io.BytesIO()
    pictures[0].save(out, format="PNG", save_all=True, append_images=pictures[1:], duration=100)
    return out.getvalue()


def decoded_frames(mp4: bytes) -> list[np.ndarray]:
    """Every frame of an MP4 as RGB uint8, as PyAV decodes it."""
    with av.open(io.BytesIO(mp4)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def png_pixels(data: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


def invert_workflow(image: str, prefix: str) -> dict[str, Any]:
    """LoadImage ``image`` → ImageInvert → SaveImage ``prefix``."""
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": image}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }


def video_from_frames_workflow(image: str, prefix: str, fps: float = 8.0) -> dict[str, Any]:
    """LoadImage (an animated PNG: a batch) → CreateVideo → SaveVideo ``prefix``."""
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": image}},
        "2": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": fps}},
        "3": {
            "class_type": "SaveVideo",
            "inputs": {
                "video": ["2", 0],
                "filename_prefix": prefix,
                "format": "mp4",
                "codec": "h264",
            },
        },
    }


def last_frame_workflow(video: str, prefix: str) -> dict[str, Any]:
    """LoadVideo → GetVideoComponents → ImageFromBatch(4095, 1) → SaveImage: the batch
    index is clamped to the last frame (comfy_extras/nodes_images.py)."""
    return {
        "1": {"class_type": "LoadVideo", "inputs": {"file": video}},
        "2": {"class_type": "GetVideoComponents", "inputs": {"video": ["1", 0]}},
        "3": {
            "class_type": "ImageFromBatch",
            "inputs": {"image": ["2", 0], "batch_index": 4095, "length": 1},
        },
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}},
    }


async def raw_upload(
    http: httpx.AsyncClient, multipart: dict[str, Any], data: bytes | None
) -> httpx.Response:
    """POST /upload/image with the fields of a recorded request (upload.json's
    ``multipart``): the image (with ``data``) when it has one, the other fields as sent."""
    files: dict[str, Any] = {}
    image = multipart.get("image")
    if image is not None:
        assert data is not None
        files["image"] = (image["filename"], data, image["content_type"])
    for key, value in multipart.items():
        if key != "image":
            files[key] = (None, value)
    return await http.post("/upload/image", files=files)
