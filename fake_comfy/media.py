"""Real output files, byte-for-byte as ComfyUI v0.8.0 writes them for solid-colour images.

- PNG: Pillow, `compress_level` 4 (SaveImage) or 1 (PreviewImage), a `tEXt` chunk "prompt"
  (json.dumps of the prompt) then one per extra_pnginfo key. The fake's PNGs of the
  success.json workflow have the sha256 of the recorded files.
- MP4: PyAV `h264` (libx264), yuv420p, `rate = Fraction(round(fps * 1000), 1000)`, one
  frame per batch item, container metadata as JSON strings (video.json, same sha256).
- WEBP: Pillow animated WEBP (SaveAnimatedWEBP).

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
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

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
    path.parent.mkdir(parents=True, exist_ok=True)
    # comfy_api VideoFromComponents.save_to, as v0.8.0 runs it.
    with av.open(str(path), mode="w", options={"movflags": "use_metadata_tags"}) as out:
        for key, value in metadata.items():
            out.metadata[key] = json.dumps(value)
        stream = out.add_stream("h264", rate=Fraction(round(fps * 1000), 1000))
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        rgb_frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
        for _ in range(frames):
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
) -> None:
    """Writes SaveAnimatedWEBP's file: all frames in one animated WEBP with EXIF metadata.

    Blocking; run it in a thread. Raises OSError.
    """
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:, :] = rgb
    image = Image.fromarray(pixels)
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
        append_images=[image] * (frames - 1),
        exif=exif,
        lossless=lossless,
        quality=quality,
        method={"default": 4, "fastest": 0, "slowest": 6}.get(method, 4),
    )
