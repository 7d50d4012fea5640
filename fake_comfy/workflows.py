"""The recorded workflows (API format), as fresh dicts for tests and demos.

Each validates against the recorded /object_info and runs on the fake (and on a real
ComfyUI v0.8.0 without models, where they were recorded).
"""

from __future__ import annotations

from typing import Any


def solid_and_inverted(
    color: int = 0x3366CC, width: int = 64, height: int = 64, batch_size: int = 1
) -> dict[str, Any]:
    """success.json: EmptyImage → SaveImage "solid", and → ImageInvert → SaveImage
    "inverted". Two output nodes ("3", "4"), run in the order 1, 3, 2, 4."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": batch_size, "color": color},
        },
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {
            "class_type": "SaveImage",
            "inputs": {"images": ["1", 0], "filename_prefix": "solid"},
        },
        "4": {
            "class_type": "SaveImage",
            "inputs": {"images": ["2", 0], "filename_prefix": "inverted"},
        },
    }


def single_image(
    prefix: str = "still",
    color: int = 0x808080,
    width: int = 64,
    height: int = 64,
    batch_size: int = 1,
) -> dict[str, Any]:
    """EmptyImage → SaveImage `prefix` (may hold a subfolder, e.g. "shots/a"): one output ("2")."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": batch_size, "color": color},
        },
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }


def video(
    frames: int = 24,
    fps: float = 24.0,
    color: int = 0xCC3333,
    width: int = 128,
    height: int = 72,
    prefix: str = "video/shot",
) -> dict[str, Any]:
    """video.json: EmptyImage (one frame per batch item) → CreateVideo → SaveVideo (H.264
    MP4 of frames / fps seconds, listed under "images" with "animated": [true])."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": frames, "color": color},
        },
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


def mask_error(color: int = 255) -> dict[str, Any]:
    """execution_error.json: ImageToMask with channel "alpha" on an RGB image fails at
    node "2" with IndexError, on the real server and on the fake."""
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": color},
        },
        "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "alpha"}},
        "3": {"class_type": "MaskToImage", "inputs": {"mask": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "mask"}},
    }


def blur_chain(
    color: int = 99, width: int = 64, height: int = 64, batch_size: int = 1
) -> dict[str, Any]:
    """interrupt_reconnect.json's slow prompt: EmptyImage → ImageBlur x3 → SaveImage "slow"
    (five nodes; on the fake each takes prompt_seconds)."""
    prompt: dict[str, Any] = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": width, "height": height, "batch_size": batch_size, "color": color},
        }
    }
    for node in ("2", "3", "4"):
        prompt[node] = {
            "class_type": "ImageBlur",
            "inputs": {"image": [str(int(node) - 1), 0], "blur_radius": 31, "sigma": 10.0},
        }
    prompt["5"] = {
        "class_type": "SaveImage",
        "inputs": {"images": ["4", 0], "filename_prefix": "slow"},
    }
    return prompt
