"""Real output files, byte-for-byte as ComfyUI v0.8.0 writes them, and the input files
its loaders read.

- PNG: Pillow, `compress_level` 4 (SaveImage) or 1 (PreviewImage), a `tEXt` chunk "prompt"
  (json.dumps of the prompt) then one per extra_pnginfo key. The fake's PNGs of the
  success.json workflow have the sha256 of the recorded files.
- MP4: PyAV `h264` (libx264), yuv420p, `rate = Fraction(round(fps * 1000), 1000)`, one
  frame per batch item, container metadata as JSON strings (video.json: the same bytes but
  for the muxer's version tag, `Lavf<version>`, which is the installed FFmpeg's).
- WEBP: Pillow animated WEBP (SaveAnimatedWEBP).
- Pictures (not solid colours): float32 arrays saved as SaveImage does,
  `clip(255 * x, 0, 255).astype(uint8)` then Pillow; videos read back as PyAV decodes
  them for GetVideoComponents (rgb24 frames) and copied stream by stream for SaveVideo
  of a LoadVideo file (comfy_api VideoFromFile).

Names follow folder_paths.get_save_image_path: `<prefix>_<counter:05>_.<ext>`, the counter
being one more than the highest already in the folder for that prefix, shared by all
extensions. Blocking work (encoding, writing) is meant to run in a thread.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

import av
import numpy as np
from PIL import Image

T = TypeVar("T")
R = TypeVar("R")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_IEND = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
_IHDR_END = 8 + 25  # signature, then the IHDR chunk (4 length + 4 type + 13 data + 4 crc)


class SaveOutsideOutput(Exception):
    """A filename_prefix whose folder escapes the output folder; the message is ComfyUI's
    ("**** ERROR: Saving image outside the output folder is not allowed. ...")."""


@dataclass(frozen=True)
class Reservation:
    """Names reserved for one save: files `<stem>_<counter:05>_.<ext>` from `first` on."""

    folder: Path  # absolute folder the files go to
    subfolder: str  # as reported in the UI output ("" or e.g. "video")
    stem: str  # file name prefix without the counter
    first: int  # counter of the first file

    def filename(self, index: int, ext: str, batch_number: int = 0) -> str:
        """Name of the `index`-th file of this reservation (index 0 = `first`)."""
        stem = self.stem.replace("%batch_num%", str(batch_number))
        return f"{stem}_{self.first + index:05}_.{ext}"


def _expand_vars(prefix: str, width: int, height: int) -> str:
    # folder_paths.compute_vars: the server-side % variables.
    now = time.localtime()
    for key, value in (
        ("%width%", width),
        ("%height%", height),
        ("%year%", now.tm_year),
        ("%month%", f"{now.tm_mon:02}"),
        ("%day%", f"{now.tm_mday:02}"),
        ("%hour%", f"{now.tm_hour:02}"),
        ("%minute%", f"{now.tm_min:02}"),
        ("%second%", f"{now.tm_sec:02}"),
    ):
        prefix = prefix.replace(key, str(value))
    return prefix


class OutputFolder:
    """Allocates file names in one ComfyUI directory (output or temp).

    The real server rescans the folder on every save and takes one more than the highest
    counter there (folder_paths.get_save_image_path), so deleting the newest files makes
    it reuse their names (cache_replay.json). The fake keeps counters in memory and reads
    the disk again only when the newest file it wrote is gone: the same names, without a
    folder listing per save.
    """

    def __init__(self, root: Path, kind: str) -> None:
        self.root = Path(os.path.abspath(root))
        self.kind = kind  # "output" or "temp": the `type` of the UI entries
        self._counters: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def reserve(self, prefix: str, count: int, width: int = 0, height: int = 0) -> Reservation:
        """Reserves `count` consecutive counters for `prefix` (may hold a subfolder).

        Raises SaveOutsideOutput when the prefix's folder is outside the root.
        """
        if "%" in prefix:
            prefix = _expand_vars(prefix, width, height)
        norm = os.path.normpath(prefix)
        subfolder = os.path.dirname(norm)
        stem = os.path.basename(norm)
        root = str(self.root)
        folder = os.path.abspath(os.path.join(root, subfolder))
        common = os.path.commonpath((root, folder))
        if common != root:
            raise SaveOutsideOutput(
                "**** ERROR: Saving image outside the output folder is not allowed."
                f"\n full_output_folder: {folder}"
                f"\n         output_dir: {root}"
                f"\n         commonpath: {common}"
            )
        key = (folder, os.path.normcase(stem))
        with self._lock:
            first = self._counters.get(key)
            if first is None or not _newest_exists(Path(folder), stem, first - 1):
                first = _next_counter(Path(folder), stem)
            self._counters[key] = first + count
        return Reservation(Path(folder), subfolder, stem, first)


_EXTENSIONS = ("png", "mp4", "webp")  # what the fake's output nodes write


def _newest_exists(folder: Path, stem: str, counter: int) -> bool:
    """Whether the file of ``counter`` (the newest one reserved) is still on disk."""
    if "%batch_num%" in stem:
        return True  # names vary per image of a batch: keep the counter
    return any(os.path.exists(folder / f"{stem}_{counter:05}_.{ext}") for ext in _EXTENSIONS)


def _next_counter(folder: Path, stem: str) -> int:
    """One more than the highest counter of `<stem>_NNNNN_*` in `folder` (1 if none)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        folder.mkdir(parents=True, exist_ok=True)
        return 1
    best = 0
    cut = len(stem)
    for name in names:
        if os.path.normcase(name[:cut]) != os.path.normcase(stem) or name[cut : cut + 1] != "_":
            continue
        try:
            digits = int(name[cut + 1 :].split("_")[0])
        except ValueError:
            digits = 0
        best = max(best, digits)
    return best + 1


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Float32 pixels in [0, 1] as SaveImage and SaveVideo store them:
    `np.clip(255. * x, 0, 255).astype(np.uint8)`, which truncates."""
    return np.clip(np.float32(255.0) * pixels, 0, 255).astype(np.uint8)


def pixel_bytes(pixel: tuple[float, float, float]) -> tuple[int, int, int]:
    """An RGB float32 pixel in [0, 1] as SaveImage stores it:
    `np.clip(255. * x, 0, 255).astype(np.uint8)` (truncates: 1 - 0.8 saves as 50, not 51)."""
    values = np.clip(np.float32(255.0) * np.asarray(pixel, dtype=np.float32), 0, 255)
    r, g, b = (int(v) for v in values.astype(np.uint8))
    return r, g, b


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


class _PngCache:
    """Pixel part (IHDR, IDAT chunks) of solid-colour PNGs by (width, height, rgb, level)."""

    def __init__(self, size: int = 64) -> None:
        self._items: OrderedDict[tuple[int, int, tuple[int, int, int], int], tuple[bytes, bytes]]
        self._items = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def parts(
        self, width: int, height: int, rgb: tuple[int, int, int], level: int
    ) -> tuple[bytes, bytes]:
        key = (width, height, rgb, level)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        pixels = np.empty((height, width, 3), dtype=np.uint8)
        pixels[:, :] = rgb
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=level)
        data = buf.getvalue()
        parts = (data[8:_IHDR_END], data[_IHDR_END:-12])
        with self._lock:
            self._items[key] = parts
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return parts


_PNG_CACHE = _PngCache()


def solid_png(
    width: int, height: int, rgb: tuple[int, int, int], texts: list[tuple[str, str]], level: int
) -> bytes:
    """A PNG of one colour with `tEXt` chunks, identical to Pillow's `save(pnginfo=...)`:
    the text chunks sit between IHDR and IDAT. Texts must be latin-1 (json.dumps is ASCII)."""
    ihdr, idat = _PNG_CACHE.parts(width, height, rgb, level)
    text = b"".join(
        _chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1")) for k, v in texts
    )
    return PNG_SIGNATURE + ihdr + text + idat + _IEND


def png_texts(
    prompt: dict[str, Any] | None, extra_pnginfo: dict[str, Any] | None
) -> list[tuple[str, str]]:
    """SaveImage's metadata: "prompt" first, then each extra_pnginfo key (e.g. "workflow")."""
    texts = []
    if prompt is not None:
        texts.append(("prompt", json.dumps(prompt)))
    for key, value in (extra_pnginfo or {}).items():
        texts.append((str(key), json.dumps(value)))
    return texts


def write_pngs(
    pictures: list[tuple[Path, np.ndarray]], texts: list[tuple[str, str]], level: int
) -> None:
    """Writes each (path, float32 array (height, width, 3)) as SaveImage does: Pillow
    PNG with the `tEXt` chunks and compression ``level``. Blocking; raises OSError."""
    from PIL.PngImagePlugin import PngInfo

    for path, pixels in pictures:
        info = PngInfo()
        for key, value in texts:
            info.add_text(key, value)
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(to_uint8(pixels)).save(path, pnginfo=info, compress_level=level)


def pillow(call: Callable[[T], R], arg: T) -> R:
    """node_helpers.pillow: ``call(arg)``, tried once more with Pillow's
    LOAD_TRUNCATED_IMAGES set when it raises OSError, UnidentifiedImageError or
    ValueError (a truncated file then loads what it has)."""
    from PIL import ImageFile, UnidentifiedImageError

    previous = None
    try:
        return call(arg)
    except (OSError, UnidentifiedImageError, ValueError):
        previous = ImageFile.LOAD_TRUNCATED_IMAGES
        ImageFile.LOAD_TRUNCATED_IMAGES = True
        return call(arg)
    finally:
        if previous is not None:
            ImageFile.LOAD_TRUNCATED_IMAGES = previous


def read_video(path: Path) -> tuple[np.ndarray, Fraction, bool]:
    """The frames of the first video stream of ``path`` as uint8 RGB (frames, height,
    width, 3), its average rate (1 when unknown) and whether the file has an audio
    stream (comfy_api VideoFromFile.get_components). Blocking; raises av.FFmpegError,
    OSError, StopIteration (no video stream)."""
    with av.open(str(path), mode="r") as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        stream = next(s for s in container.streams if s.type == "video")
        rate = Fraction(stream.average_rate) if stream.average_rate else Fraction(1)
        has_audio = any(s.type == "audio" for s in container.streams)
    if not frames:
        return np.zeros((0, 3, 0, 0), dtype=np.uint8), rate, has_audio
    return np.stack(frames), rate, has_audio


def video_size(path: Path) -> tuple[int, int]:
    """(width, height) of the first video stream (VideoFromFile.get_dimensions). Raises
    ValueError without one, av.FFmpegError for a file that is not a video."""
    with av.open(str(path), mode="r") as container:
        for stream in container.streams:
            if stream.type == "video":
                return stream.width, stream.height
    raise ValueError(f"No video stream found in file '{path}'")


def can_copy_streams(path: Path, fmt: str, codec: str) -> bool:
    """SaveVideo copies LoadVideo's streams unless the format or codec asked for ("auto",
    "mp4", "h264") is not the file's own (VideoFromFile.save_to ``reuse_streams``)."""
    with av.open(str(path), mode="r") as container:
        names = container.format.name.split(",")
        video = container.streams.video
        encoding = video[0].codec.name if len(video) > 0 else None
    if fmt != "auto" and fmt not in names:
        return False
    return codec == "auto" or encoding is None or codec == encoding


def copy_video(src: Path, dst: Path, metadata: dict[str, Any]) -> None:
    """Copies the video, audio and subtitle packets of ``src`` into ``dst`` with the
    container metadata of ``src`` plus ``metadata`` (JSON text, strings as they are),
    as VideoFromFile.save_to does. Blocking; raises OSError, av.FFmpegError."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with (
        av.open(str(src), mode="r") as container,
        av.open(str(dst), mode="w", options={"movflags": "use_metadata_tags"}) as out,
    ):
        for key, value in container.metadata.items():
            if key not in metadata:
                out.metadata[key] = value
        for key, value in metadata.items():
            out.metadata[key] = value if isinstance(value, str) else json.dumps(value)
        streams = {}
        for stream in container.streams:
            if stream.type in ("video", "audio", "subtitle"):
                streams[stream] = out.add_stream_from_template(template=stream, opaque=True)
        for packet in container.demux():
            if packet.stream in streams and packet.dts is not None:
                packet.stream = streams[packet.stream]
                out.mux(packet)


def write_files(paths_and_bytes: list[tuple[Path, bytes]]) -> None:
    """Writes each file (blocking; run it in a thread). Raises OSError."""
    for path, data in paths_and_bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def write_mp4(
    path: Path,
    width: int,
    height: int,
    rgb: tuple[int, int, int],
    frames: int,
    fps: float,
    metadata: dict[str, Any],
) -> None:
    """Writes an H.264 MP4 of `frames` solid frames at `fps` (duration frames / fps seconds).

    Width and height are rounded down to even numbers (yuv420p needs them even).
    Blocking; run it in a thread. Raises OSError / av.FFmpegError.
    """
    width = max(2, width - width % 2)
    height = max(2, height - height % 2)
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:, :] = rgb
    rgb_frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
    _encode_mp4(path, width, height, (rgb_frame for _ in range(frames)), fps, metadata)


def write_mp4_frames(path: Path, pixels: np.ndarray, fps: float, metadata: dict[str, Any]) -> None:
    """Writes an H.264 MP4 of float32 frames (frames, height, width, 3) in [0, 1], each
    stored as `(frame * 255).clamp(0, 255).byte()` (VideoFromComponents.save_to).
    Blocking; run it in a thread. Raises OSError / av.FFmpegError: an odd width or height
    fails in libx264 (av.error.ExternalError), as on a real server."""
    frames = (av.VideoFrame.from_ndarray(to_uint8(p), format="rgb24") for p in pixels)
    _encode_mp4(path, pixels.shape[2], pixels.shape[1], frames, fps, metadata)


def _encode_mp4(
    path: Path,
    width: int,
    height: int,
    frames: Iterable[av.VideoFrame],
    fps: float,
    metadata: dict[str, Any],
) -> None:
    """comfy_api VideoFromComponents.save_to: H.264 yuv420p at `fps`, metadata as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # comfy_api VideoFromComponents.save_to, as v0.8.0 runs it.
    with av.open(str(path), mode="w", options={"movflags": "use_metadata_tags"}) as out:
        for key, value in metadata.items():
            out.metadata[key] = json.dumps(value)
        stream = out.add_stream("h264", rate=Fraction(round(fps * 1000), 1000))
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        for rgb_frame in frames:
            # A fresh frame each time: the encoder stamps each one with its own pts.
            out.mux(stream.encode(rgb_frame.reformat(format="yuv420p")))
        out.mux(stream.encode(None))


def write_webp(
    path: Path,
    width: int,
    height: int,
    rgb: tuple[int, int, int],
    frames: int,
    fps: float,
    lossless: bool,
    quality: int,
    method: str,
    prompt: dict[str, Any] | None,
    extra_pnginfo: dict[str, Any] | None,
    pictures: np.ndarray | None = None,
) -> None:
    """Writes SaveAnimatedWEBP's file: all frames in one animated WEBP with EXIF metadata;
    `frames` solid ones of `rgb`, or `pictures`, float32 (frames, height, width, 3).

    Blocking; run it in a thread. Raises OSError.
    """
    if pictures is not None:
        images = [Image.fromarray(to_uint8(p)) for p in pictures]
    else:
        pixels = np.empty((height, width, 3), dtype=np.uint8)
        pixels[:, :] = rgb
        images = [Image.fromarray(pixels)] * frames
    image = images[0]
    exif = image.getexif()
    if prompt is not None:
        exif[0x0110] = f"prompt:{json.dumps(prompt)}"
    tag = 0x010F
    for key, value in (extra_pnginfo or {}).items():
        exif[tag] = f"{key}:{json.dumps(value)}"
        tag -= 1
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(
        str(path),
        format="WEBP",
        save_all=True,
        duration=int(1000.0 / fps),
        append_images=images[1:],
        exif=exif,
        lossless=lossless,
        quality=quality,
        method={"default": 4, "fastest": 0, "slowest": 6}.get(method, 4),
    )
