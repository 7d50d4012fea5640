"""What each node class does in the fake: images traced through the graph.

An IMAGE is `Images(width, height, batch, pixel, pixels)`. A solid batch (EmptyImage)
carries one float32 RGB pixel in [0, 1] (`channel / 0xFF`) and no array: saving it takes
the fast paths of fake_comfy.media. A batch read from a file (LoadImage, the frames of a
LoadVideo) carries `pixels`, a float32 array (batch, height, width, 3) in [0, 1] as
ComfyUI's tensors are. The float32 arithmetic is ComfyUI's (nodes.py, comfy_extras,
comfy_api; v0.8.0), so saved bytes match the real files: LoadImage divides the uint8
values by 255 in float32, ImageInvert is `1.0 - image`, SaveImage truncates
`clip(255 * x, 0, 255)` to uint8 (so an inverted value can come out one below 255 - v).

Nodes the fake cannot render (KSampler, loaders of models) pass an `Opaque` value along;
an output fed by one saves a 64x64 grey image. ImageBlur passes its image on unchanged
(right for a solid colour, not for real pictures).

Run-time failures are raised as NodeFailure and become `execution_error` messages.
"""

from __future__ import annotations

import asyncio
import random
import string
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

import av
import numpy as np

from fake_comfy import media, recorded
from fake_comfy.inputs import Folders

T = TypeVar("T")


@dataclass(frozen=True)
class Images:
    """A batch of images: sizes in pixels; `pixel` float32 RGB in [0, 1] of a solid batch;
    `pixels` the float32 array (batch, height, width, 3) of a batch of real pictures
    (then `pixel` is unused). Make the latter with `Images.of`."""

    width: int
    height: int
    batch: int
    pixel: tuple[float, float, float]
    pixels: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, pixels: np.ndarray) -> Images:
        """A batch of real pictures from a float32 array (batch, height, width, 3)."""
        batch, height, width = pixels.shape[:3]
        return cls(int(width), int(height), int(batch), (0.0, 0.0, 0.0), pixels)

    def array(self) -> np.ndarray:
        """The float32 array (batch, height, width, 3), made for a solid batch."""
        if self.pixels is not None:
            return self.pixels
        out = np.empty((self.batch, self.height, self.width, 3), dtype=np.float32)
        out[...] = np.asarray(self.pixel, dtype=np.float32)
        return out


@dataclass(frozen=True)
class Mask:
    """A batch of masks: one float32 `value` in [0, 1] of a solid batch, or `values`, the
    float32 array (batch, height, width)."""

    width: int
    height: int
    batch: int
    value: float
    values: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, values: np.ndarray) -> Mask:
        """A mask batch from a float32 array (batch, height, width)."""
        batch, height, width = values.shape
        return cls(int(width), int(height), int(batch), 0.0, values)


@dataclass(frozen=True)
class Latent:
    """EmptyLatentImage's batch, in image pixels."""

    width: int
    height: int
    batch: int


@dataclass(frozen=True)
class Video:
    """CreateVideo's frames (one per image of the batch) and rate in frames per second
    (comfy_api VideoFromComponents)."""

    images: Images
    fps: float


@dataclass(frozen=True)
class VideoFile:
    """LoadVideo's video: a file of the input folder, read when a node needs its frames
    (comfy_api VideoFromFile: nothing is decoded before)."""

    path: Path


@dataclass(frozen=True)
class Opaque:
    """Any value the fake does not model (MODEL, CLIP, CONDITIONING, AUDIO ...)."""

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


def cuda_failure() -> NodeFailure:
    """A CUDA fault as PyTorch (2.8 and newer) raises it on a broken GPU, in ComfyUI's
    execution_error shape: ``"{ex}\n{tips}"`` with no tips (v0.8.0 execution.py)."""
    tb = recorded.index_error()["traceback"][:4]
    return NodeFailure(recorded.CUDA_EXCEPTION_TYPE, recorded.CUDA_MESSAGE + "\n", tb)


def full_disk_failure() -> NodeFailure:
    """The recorded full output disk (full_disk.json: OSError in the saving node)."""
    rec = recorded.full_disk_error()
    return NodeFailure(rec["exception_type"], rec["exception_message"], rec["traceback"])


def word_failure(word: str) -> NodeFailure:
    """The failure of script word ``word`` (error, oom or cuda)."""
    if word == "error":
        return index_error_failure()
    return oom_failure() if word == "oom" else cuda_failure()


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
# Nodes that read files: run in a thread, their failures are the node's (execution_error).
READS_FILES = frozenset({"LoadImage", "GetVideoComponents"})


def image_batch(value: Any) -> int:
    """How many images an IMAGE input holds."""
    return _as_images(value).batch


def _as_images(value: Any) -> Images:
    if isinstance(value, Images):
        return value
    if isinstance(value, Latent):
        return Images(value.width, value.height, value.batch, _GREY)
    return Images(64, 64, 1, _GREY)


def _f32(x: float) -> float:
    return float(np.float32(x))


def runs_in_thread(class_type: str, inputs: dict[str, Any]) -> bool:
    """Whether ``compute`` of this node may block: it reads a file, or works on arrays."""
    if class_type in READS_FILES:
        return True
    return any(isinstance(v, Images) and v.pixels is not None for v in inputs.values())


def compute(
    class_type: str, inputs: dict[str, Any], folders: Folders | None = None
) -> tuple[Any, ...]:
    """The outputs (one per output slot) of a non-output node; ``folders`` resolve the
    file names of LoadImage and LoadVideo (fake_comfy.inputs).

    Raises NodeFailure for what fails on the real server too: ImageToMask with channel
    "alpha" on an RGB image (the recorded IndexError), a file that is not an image or a
    video (the exception of Pillow or PyAV, as ComfyUI reports it).
    """
    node = _NODES.get(class_type)
    if node is None:
        return tuple(Opaque(class_type) for _ in range(4))
    return node(inputs, folders)


def _empty_image(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    color = int(inputs["color"])
    pixel = tuple(_f32(((color >> shift) & 0xFF) / 0xFF) for shift in (16, 8, 0))
    return (Images(int(inputs["width"]), int(inputs["height"]), int(inputs["batch_size"]), pixel),)


def _load_image_node(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    path = _input_path(folders, inputs["image"])
    return _node_reads(lambda: _load_image(path))


def _load_video_node(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (VideoFile(Path(_input_path(folders, inputs["file"]))),)


def _video_components_node(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return _video_components(inputs["video"])


def _image_from_batch(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (_from_batch(_as_images(inputs["image"]), inputs["batch_index"], inputs["length"]),)


def _repeat_image_batch(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    img, amount = _as_images(inputs["image"]), int(inputs["amount"])
    if img.pixels is not None:
        return (Images.of(np.tile(img.pixels, (amount, 1, 1, 1))),)  # image.repeat
    return (Images(img.width, img.height, img.batch * amount, img.pixel),)


def _image_invert(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    img = _as_images(inputs["image"])
    if img.pixels is not None:
        return (Images.of(np.float32(1.0) - img.pixels),)
    pixel = tuple(_f32(np.float32(1.0) - np.float32(c)) for c in img.pixel)
    return (Images(img.width, img.height, img.batch, pixel),)


def _image_blur(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (_as_images(inputs["image"]),)  # see the module docstring


def _image_to_mask(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    img = _as_images(inputs["image"])
    channels = ["red", "green", "blue", "alpha"]
    index = channels.index(inputs["channel"])
    if index >= 3:
        raise index_error_failure()
    if img.pixels is not None:
        return (Mask.of(np.ascontiguousarray(img.pixels[..., index])),)
    return (Mask(img.width, img.height, img.batch, img.pixel[index]),)


def _mask_to_image(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    mask = inputs["mask"]
    if not isinstance(mask, Mask):
        mask = Mask(64, 64, 1, 0.5)
    if mask.values is not None:
        return (Images.of(np.repeat(mask.values[..., None], 3, axis=-1)),)
    return (Images(mask.width, mask.height, mask.batch, (mask.value,) * 3),)


def _create_video(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (Video(_as_images(inputs["images"]), float(inputs["fps"])),)


def _empty_latent(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (Latent(int(inputs["width"]), int(inputs["height"]), int(inputs["batch_size"])),)


def _ksampler(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    latent = inputs.get("latent_image")
    return (latent if isinstance(latent, Latent) else Opaque("KSampler"),)


def _vae_decode(inputs: dict[str, Any], folders: Folders | None) -> tuple[Any, ...]:
    return (_as_images(inputs.get("samples")),)


# The nodes ``compute`` runs, by class type; any other gives four opaque outputs.
_NODES: dict[str, Callable[[dict[str, Any], Folders | None], tuple[Any, ...]]] = {
    "EmptyImage": _empty_image,
    "LoadImage": _load_image_node,
    "LoadVideo": _load_video_node,
    "GetVideoComponents": _video_components_node,
    "ImageFromBatch": _image_from_batch,
    "RepeatImageBatch": _repeat_image_batch,
    "ImageInvert": _image_invert,
    "ImageBlur": _image_blur,
    "ImageToMask": _image_to_mask,
    "MaskToImage": _mask_to_image,
    "CreateVideo": _create_video,
    "EmptyLatentImage": _empty_latent,
    "KSampler": _ksampler,
    "VAEDecode": _vae_decode,
}


def _input_path(folders: Folders | None, name: Any) -> str:
    if folders is None:
        raise RuntimeError("fake_comfy: a node reading a file needs the server's folders")
    return folders.annotated_path(str(name))


def _node_reads(read: Callable[[], T]) -> T:
    """``read()``, whose exceptions (a missing file, bytes that are not an image or a
    video) are the node's failure, as ComfyUI reports any exception of a node."""
    try:
        return read()
    except Exception as ex:
        raise _failure_from(ex) from ex


def _load_image(path: str) -> tuple[Images, Mask]:
    """nodes.LoadImage.load_image: every frame of the file's size (an animated PNG is a
    batch), RGB as uint8 / 255 in float32; the mask is 1 - alpha, or a 64x64 zero mask
    for a picture without transparency."""
    from PIL import Image, ImageOps, ImageSequence

    img = media.pillow(Image.open, path)
    images: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    size = None
    for frame in ImageSequence.Iterator(img):
        frame = media.pillow(ImageOps.exif_transpose, frame)
        if frame.mode == "I":
            frame = frame.point(lambda i: i * (1 / 255))
        image = frame.convert("RGB")
        if size is None:
            size = image.size
        if image.size != size:
            continue
        images.append(np.array(image).astype(np.float32) / 255.0)
        if "A" in frame.getbands():
            alpha = np.array(frame.getchannel("A")).astype(np.float32) / 255.0
            masks.append(1.0 - alpha)
        elif frame.mode == "P" and "transparency" in frame.info:
            alpha = np.array(frame.convert("RGBA").getchannel("A")).astype(np.float32) / 255.0
            masks.append(1.0 - alpha)
        else:
            masks.append(np.zeros((64, 64), dtype=np.float32))
        if img.format == "MPO":
            break  # ComfyUI ignores every frame of an MPO but the first
    return Images.of(np.stack(images)), Mask.of(np.stack(masks))


def _video_components(video: Any) -> tuple[Any, ...]:
    """GetVideoComponents: (images, audio, fps). A file's frames are decoded as RGB
    uint8 / 255 in float32 and its rate is the stream's average rate (comfy_api
    VideoFromFile.get_components); audio is None without an audio stream."""
    if isinstance(video, VideoFile):
        frames, rate, has_audio = _node_reads(lambda: media.read_video(video.path))
        pixels = frames.astype(np.float32) / np.float32(255.0)
        audio = Opaque("AUDIO") if has_audio else None
        return (Images.of(pixels), audio, float(rate))
    if isinstance(video, Video):
        return (video.images, None, float(video.fps))
    return (_as_images(video), None, 30.0)


def _from_batch(img: Images, batch_index: Any, length: Any) -> Images:
    """ImageFromBatch: ``length`` images from ``batch_index``, the index clamped to the
    batch's last image and the length to what is left (comfy_extras/nodes_images.py)."""
    index = min(img.batch - 1, int(batch_index))
    count = min(img.batch - index, int(length))
    if img.pixels is not None:
        return Images.of(img.pixels[index : index + count].copy())
    return Images(img.width, img.height, len(range(img.batch)[index : index + count]), img.pixel)


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
    "animated": [True] (video.json). Raises NodeFailure for a prefix escaping the folder,
    a failed write (OSError), a prefix with a NUL byte (ValueError), an empty batch, a video of an odd width or height (libx264
    refuses it: av.error.ExternalError), or a LoadVideo file that is not a video."""
    try:
        if class_type == "SaveVideo":
            return await _save_video(inputs, ctx)
        if class_type == "SaveAnimatedWEBP":
            return await _save_webp(inputs, ctx)
        if class_type in ("SaveImage", "PreviewImage"):
            return await _save_images(class_type, inputs, ctx)
        if class_type == "SaveImageWebsocket":
            # Its images go out on the socket (stepping.py); nothing is saved, and its
            # UI output is empty, so /history lists no outputs for it (progress.json).
            _first_image(_as_images(inputs.get("images")))
            return {}
    except (media.SaveOutsideOutput, OSError, IndexError, ValueError, av.FFmpegError) as ex:
        # ValueError: a prefix with a NUL byte, refused by os calls as in ComfyUI's
        # folder_paths.get_save_image_path.
        raise _failure_from(ex) from ex
    raise ValueError(f"fake_comfy cannot run output node {class_type}")


def _first_image(img: Images) -> None:
    """Raises IndexError for an empty batch, as ComfyUI's ``images[0]`` does."""
    if img.batch < 1:
        raise IndexError("index 0 is out of bounds for dimension 0 with size 0")


async def _save_images(class_type: str, inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    img = _as_images(inputs.get("images"))
    _first_image(img)
    if class_type == "PreviewImage":
        # nodes.PreviewImage: temp folder, random suffix, faster compression.
        suffix = "".join(random.choice(string.ascii_lowercase) for _ in range(5))
        folder, prefix, level = ctx.temp, f"ComfyUI_temp_{suffix}", 1
    else:
        folder, prefix, level = ctx.output, str(inputs.get("filename_prefix", "ComfyUI")), 4
    res = folder.reserve(prefix, img.batch, img.width, img.height)
    texts = media.png_texts(ctx.prompt, ctx.extra_pnginfo)
    names = [res.filename(i, "png", batch_number=i) for i in range(img.batch)]
    if img.pixels is not None:
        pictures = [(res.folder / n, img.pixels[i]) for i, n in enumerate(names)]
        await asyncio.to_thread(media.write_pngs, pictures, texts, level)
        return {"images": [_entry(res, n, folder.kind) for n in names]}
    data = media.solid_png(img.width, img.height, media.pixel_bytes(img.pixel), texts, level)
    files = [(res.folder / n, data) for n in names]
    if len(data) * len(names) <= INLINE_WRITE_BYTES:
        media.write_files(files)  # a thread hop costs more CPU than a small write
    else:
        await asyncio.to_thread(media.write_files, files)
    return {"images": [_entry(res, n, folder.kind) for n in names]}


async def _save_video(inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    video = inputs.get("video")
    prefix = str(inputs.get("filename_prefix", "video/ComfyUI"))
    # SaveVideo: extra_pnginfo keys first, then "prompt".
    metadata = dict(ctx.extra_pnginfo or {})
    metadata["prompt"] = ctx.prompt
    if isinstance(video, VideoFile):
        return await _save_video_file(video, inputs, prefix, metadata, ctx)
    if not isinstance(video, Video):
        video = Video(_as_images(video), 30.0)
    img = video.images
    _first_image(img)
    res = ctx.output.reserve(prefix, 1, img.width, img.height)
    name = res.filename(0, "mp4")
    if img.pixels is not None:
        await asyncio.to_thread(
            media.write_mp4_frames, res.folder / name, img.pixels, video.fps, metadata
        )
    else:
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


async def _save_video_file(
    video: VideoFile,
    inputs: dict[str, Any],
    prefix: str,
    metadata: dict[str, Any],
    ctx: SaveContext,
) -> dict[str, Any]:
    """SaveVideo of LoadVideo's file: its streams copied with the metadata added when the
    format and codec asked for are its own ("auto" is), else its frames encoded anew
    (comfy_api VideoFromFile.save_to)."""
    width, height = _node_reads(lambda: media.video_size(video.path))
    res = ctx.output.reserve(prefix, 1, width, height)
    name = res.filename(0, "mp4")
    fmt, codec = str(inputs.get("format", "auto")), str(inputs.get("codec", "auto"))

    def write() -> None:
        if media.can_copy_streams(video.path, fmt, codec):
            media.copy_video(video.path, res.folder / name, metadata)
            return
        frames, rate, _ = media.read_video(video.path)
        pixels = frames.astype(np.float32) / np.float32(255.0)
        media.write_mp4_frames(res.folder / name, pixels, float(Fraction(rate)), metadata)

    await asyncio.to_thread(_node_reads, write)
    return {"images": [_entry(res, name, "output")], "animated": [True]}


async def _save_webp(inputs: dict[str, Any], ctx: SaveContext) -> dict[str, Any]:
    img = _as_images(inputs.get("images"))
    _first_image(img)
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
        img.pixels,
    )
    return {"images": [_entry(res, name, "output")], "animated": [True]}
