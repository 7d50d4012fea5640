"""What each node class does in the fake: solid-colour images traced through the graph.

An IMAGE is `Images(width, height, batch, pixel)` with a float32 RGB pixel in [0, 1]
(EmptyImage fills a tensor with `channel / 0xFF`); the float32 arithmetic is ComfyUI's, so
saved bytes match the real files. Nodes the fake cannot render (KSampler, loaders) pass an
`Opaque` value along; an output fed by one saves a 64x64 grey image.

Run-time failures are raised as NodeFailure and become `execution_error` messages.
"""

from __future__ import annotations

import asyncio
import random
import string
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from fake_comfy import media, recorded


@dataclass(frozen=True)
class Images:
    """A batch of solid images: sizes in pixels, `pixel` float32 RGB in [0, 1]."""

    width: int
    height: int
    batch: int
    pixel: tuple[float, float, float]


@dataclass(frozen=True)
class Mask:
    """A batch of solid masks with one float32 value in [0, 1]."""

    width: int
    height: int
    batch: int
    value: float


@dataclass(frozen=True)
class Latent:
    """EmptyLatentImage's batch, in image pixels."""

    width: int
    height: int
    batch: int


@dataclass(frozen=True)
class Video:
    """CreateVideo's frames (one per image of the batch) and rate in frames per second."""

    images: Images
    fps: float


@dataclass(frozen=True)
class Opaque:
    """Any value the fake does not model (MODEL, CLIP, CONDITIONING ...)."""

    class_type: str


class NodeFailure(Exception):
    """A node failed while executing: the fields of ComfyUI's `execution_error`.

    exception_message ends with "\\n" plus the tips (ComfyUI formats "{ex}\\n{tips}").
    """

    def __init__(self, exception_type: str, exception_message: str, tb: list[str]) -> None:
        super().__init__(f"{exception_type}: {exception_message}")
        self.exception_type = exception_type
        self.exception_message = exception_message
        self.traceback = tb


def index_error_failure() -> NodeFailure:
    """The recorded IndexError (execution_error.json)."""
    rec = recorded.index_error()
    return NodeFailure(rec["exception_type"], rec["exception_message"], rec["traceback"])


def oom_failure() -> NodeFailure:
    """A GPU out-of-memory in ComfyUI's shape (README fact 9: synthesised, not recorded)."""
    tb = recorded.index_error()["traceback"][:4] + recorded.OOM_TRACEBACK_TAIL
    message = f"{recorded.OOM_TORCH_MESSAGE}\n{recorded.OOM_TIPS}"
    return NodeFailure(recorded.OOM_EXCEPTION_TYPE, message, tb)


def _failure_from(ex: BaseException) -> NodeFailure:
    klass = type(ex)
    name = (
        klass.__qualname__
        if klass.__module__ == "builtins"
        else f"{klass.__module__}.{klass.__qualname__}"
    )
    return NodeFailure(name, f"{ex}\n", traceback.format_tb(ex.__traceback__))


_GREY = (0.5, 0.5, 0.5)
INLINE_WRITE_BYTES = 1 << 20  # images up to this size are written on the loop thread


def _as_images(value: Any) -> Images:
    if isinstance(value, Images):
        return value
    if isinstance(value, Latent):
        return Images(value.width, value.height, value.batch, _GREY)
    return Images(64, 64, 1, _GREY)


def _f32(x: float) -> float:
    return float(np.float32(x))


def compute(class_type: str, inputs: dict[str, Any]) -> tuple[Any, ...]:
    """The outputs (one per output slot) of a non-output node.

    Raises NodeFailure for what fails on the real server too: ImageToMask with channel
    "alpha" on an RGB image (the recorded IndexError).
    """
    if class_type == "EmptyImage":
        color = int(inputs["color"])
        pixel = tuple(_f32(((color >> shift) & 0xFF) / 0xFF) for shift in (16, 8, 0))
        return (
            Images(int(inputs["width"]), int(inputs["height"]), int(inputs["batch_size"]), pixel),
        )
    if class_type == "ImageInvert":
        img = _as_images(inputs["image"])
        pixel = tuple(_f32(np.float32(1.0) - np.float32(c)) for c in img.pixel)
        return (Images(img.width, img.height, img.batch, pixel),)
    if class_type == "ImageBlur":
        return (_as_images(inputs["image"]),)  # a blurred solid colour is the same colour
    if class_type == "ImageToMask":
        img = _as_images(inputs["image"])
        channels = ["red", "green", "blue", "alpha"]
        index = channels.index(inputs["channel"])
        if index >= 3:
            raise index_error_failure()
        return (Mask(img.width, img.height, img.batch, img.pixel[index]),)
    if class_type == "MaskToImage":
        mask = inputs["mask"]
        if not isinstance(mask, Mask):
            mask = Mask(64, 64, 1, 0.5)
        return (Images(mask.width, mask.height, mask.batch, (mask.value,) * 3),)
    if class_type == "CreateVideo":
        return (Video(_as_images(inputs["images"]), float(inputs["fps"])),)
    if class_type == "EmptyLatentImage":
        return (Latent(int(inputs["width"]), int(inputs["height"]), int(inputs["batch_size"])),)
    if class_type == "KSampler":
        latent = inputs.get("latent_image")
        return (latent if isinstance(latent, Latent) else Opaque(class_type),)
    if class_type == "VAEDecode":
        return (_as_images(inputs.get("samples")),)
    return tuple(Opaque(class_type) for _ in range(4))


@dataclass
class SaveContext:
    """Where and with what metadata output nodes save."""

    output: media.OutputFolder
    temp: media.OutputFolder
    prompt: dict[str, Any]  # the prompt as queued: PNG "prompt" text, MP4 metadata
    extra_pnginfo: dict[str, Any] | None


def _entry(res: media.Reservation, name: str, kind: str) -> dict[str, str]:
    return {"filename": name, "subfolder": res.subfolder, "type": kind}


async def save(class_type: str, inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    """Runs an output node: writes its files (in a thread) and returns its UI output, e.g.
    {"images": [{"filename", "subfolder", "type"}]} or, for videos and animated WEBP, with
    "animated": [True] (video.json). Raises NodeFailure for a prefix escaping the folder
    or a failed write (OSError)."""
    try:
        if class_type == "SaveVideo":
            return await _save_video(inputs, ctx)
        if class_type == "SaveAnimatedWEBP":
            return await _save_webp(inputs, ctx)
        if class_type in ("SaveImage", "PreviewImage"):
            return await _save_images(class_type, inputs, ctx)
    except (media.SaveOutsideOutput, OSError) as ex:
        raise _failure_from(ex) from ex
    raise ValueError(f"fake_comfy cannot run output node {class_type}")


async def _save_images(class_type: str, inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    img = _as_images(inputs.get("images"))
    if class_type == "PreviewImage":
        # nodes.PreviewImage: temp folder, random suffix, faster compression.
        suffix = "".join(random.choice(string.ascii_lowercase) for _ in range(5))
        folder, prefix, level = ctx.temp, f"ComfyUI_temp_{suffix}", 1
    else:
        folder, prefix, level = ctx.output, str(inputs.get("filename_prefix", "ComfyUI")), 4
    res = folder.reserve(prefix, img.batch, img.width, img.height)
    data = media.solid_png(
        img.width,
        img.height,
        media.pixel_bytes(img.pixel),
        media.png_texts(ctx.prompt, ctx.extra_pnginfo),
        level,
    )
    names = [res.filename(i, "png", batch_number=i) for i in range(img.batch)]
    files = [(res.folder / n, data) for n in names]
    if len(data) * len(names) <= INLINE_WRITE_BYTES:
        media.write_files(files)  # a thread hop costs more CPU than a small write
    else:
        await asyncio.to_thread(media.write_files, files)
    return {"images": [_entry(res, n, folder.kind) for n in names]}


async def _save_video(inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    video = inputs.get("video")
    if not isinstance(video, Video):
        video = Video(_as_images(video), 30.0)
    img = video.images
    res = ctx.output.reserve(
        str(inputs.get("filename_prefix", "video/ComfyUI")), 1, img.width, img.height
    )
    name = res.filename(0, "mp4")
    # SaveVideo: extra_pnginfo keys first, then "prompt".
    metadata = dict(ctx.extra_pnginfo or {})
    metadata["prompt"] = ctx.prompt
    await asyncio.to_thread(
        media.write_mp4,
        res.folder / name,
        img.width,
        img.height,
        media.pixel_bytes(img.pixel),
        img.batch,
        video.fps,
        metadata,
    )
    return {"images": [_entry(res, name, "output")], "animated": [True]}


async def _save_webp(inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    img = _as_images(inputs.get("images"))
    res = ctx.output.reserve(
        str(inputs.get("filename_prefix", "ComfyUI")), 1, img.width, img.height
    )
    name = res.filename(0, "webp")
    await asyncio.to_thread(
        media.write_webp,
        res.folder / name,
        img.width,
        img.height,
        media.pixel_bytes(img.pixel),
        img.batch,
        float(inputs.get("fps", 6.0)),
        bool(inputs.get("lossless", True)),
        int(inputs.get("quality", 80)),
        str(inputs.get("method", "default")),
        ctx.prompt,
        ctx.extra_pnginfo,
    )
    return {"images": [_entry(res, name, "output")], "animated": [True]}
