"""What a shot's file is: an image or a video, its size, frame rate, frames and length,
decoded to the end (PyAV) so a broken file is found before it reaches a film."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
from PIL import Image, UnidentifiedImageError

# Suffixes taken to be videos when a job lists several outputs (films.py picks by these).
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi", ".gif"})


class MediaError(Exception):
    """A media file is missing, empty, truncated or undecodable, or a tool failed on it.

    ``path`` is the file concerned, ``problem`` what is wrong with it.
    """

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class MediaInfo:
    """What a full decode of one file found.

    For a video, ``duration_s`` (seconds) and ``frames`` come from the decoded frames, not the
    container header. For a still image ``kind`` is "image", ``duration_s``/``fps``/``rate``/
    ``time_base`` are None, ``frames`` is 1 and ``pix_fmt`` is Pillow's mode ("RGB").
    ``codec_config`` is a digest of the codec's extradata (H.264 SPS/PPS): two clips can be
    stream-copied into one track only if it matches.
    """

    path: Path
    kind: Literal["video", "image"]
    width: int
    height: int
    codec: str
    pix_fmt: str
    frames: int
    size_bytes: int
    duration_s: float | None = None
    rate: Fraction | None = None
    time_base: Fraction | None = None
    codec_config: str = ""

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return (self.width, self.height)

    @property
    def fps(self) -> float | None:
        """Frames a second: ``rate`` as a float (None for a still image)."""
        return None if self.rate is None else float(self.rate)


def probe(path: Path) -> MediaInfo:
    """Decode every frame of ``path`` (a video, or a still image Pillow reads) and describe it.

    Raises MediaError naming the file for a missing or empty file, a truncated file (an MP4/MOV
    box running past the end of the file, fewer decoded frames or seconds than the header
    lists), a file with no video stream or no decodable frame, or a decode error.
    """
    path = Path(path)
    if not path.exists():
        raise MediaError(path, "does not exist")
    if not path.is_file():
        raise MediaError(path, "is not a file")
    size_bytes = path.stat().st_size
    if size_bytes == 0:
        raise MediaError(path, "is empty (0 bytes)")
    image = _probe_image(path, size_bytes)
    if image is not None:
        return image
    _check_iso_boxes(path, size_bytes)
    return _probe_video(path, size_bytes)


def _probe_image(path: Path, size_bytes: int) -> MediaInfo | None:
    """MediaInfo for a single-frame image, None if Pillow does not know the format (or it is
    animated: those are decoded as videos)."""
    try:
        with Image.open(path) as im:
            if getattr(im, "n_frames", 1) > 1:
                return None
            im.load()
            return MediaInfo(
                path=path,
                kind="image",
                width=im.width,
                height=im.height,
                codec=(im.format or "image").lower(),
                pix_fmt=im.mode,
                frames=1,
                size_bytes=size_bytes,
            )
    except UnidentifiedImageError:
        return None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        # Pillow knew the format (it got past identification) but could not decode it.
        raise MediaError(path, f"undecodable image: {e}") from e


def _check_iso_boxes(path: Path, size_bytes: int) -> None:
    """Walk the top-level boxes of an MP4/MOV file; a box running past the end means the file
    was cut short. FFmpeg tolerates some of those cuts (the trailing metadata box), we do not."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[4:8] != b"ftyp":
            return
        offset = 0
        while offset < size_bytes:
            f.seek(offset)
            header = f.read(16)
            if len(header) < 8:
                raise MediaError(path, f"truncated: partial box header at byte {offset}")
            box_size, box_type = struct.unpack(">I4s", header[:8])
            if box_size == 1:
                if len(header) < 16:
                    raise MediaError(path, f"truncated: partial box header at byte {offset}")
                box_size = struct.unpack(">Q", header[8:16])[0]
            elif box_size == 0:  # "extends to end of file"
                return
            if box_size < 8:
                raise MediaError(path, f"corrupt: box of {box_size} bytes at byte {offset}")
            if offset + box_size > size_bytes:
                name = box_type.decode("latin-1")
                raise MediaError(
                    path,
                    f"truncated: '{name}' box ends at byte {offset + box_size} "
                    f"but the file has {size_bytes} bytes",
                )
            offset += box_size


def _probe_video(path: Path, size_bytes: int) -> MediaInfo:
    try:
        container = av.open(str(path))
    except av.FFmpegError as e:
        raise MediaError(path, f"cannot be opened as media: {e}") from e
    with container:
        if not container.streams.video:
            raise MediaError(path, "has no video stream")
        stream = container.streams.video[0]
        tb = stream.time_base
        rate = stream.average_rate or stream.guessed_rate
        frames = 0
        start: Fraction | None = None
        end: Fraction | None = None
        timed = True
        pix_fmt = stream.codec_context.pix_fmt or ""
        try:
            for frame in container.decode(stream):
                frames += 1
                pix_fmt = pix_fmt or frame.format.name
                if frame.pts is None or tb is None:
                    timed = False
                    continue
                t0 = frame.pts * tb
                length = frame.duration * tb if frame.duration else (1 / rate if rate else 0)
                start = t0 if start is None else min(start, t0)
                end = t0 + length if end is None else max(end, t0 + length)
        except av.FFmpegError as e:
            raise MediaError(path, f"undecodable after {frames} frames: {e}") from e
        if frames == 0:
            raise MediaError(path, "no video frame could be decoded")
        if timed and start is not None and end is not None:
            duration = end - start
        elif rate:
            duration = Fraction(frames) / rate
        else:
            raise MediaError(path, "has neither timestamps nor a frame rate")
        if duration <= 0:
            raise MediaError(path, f"decoded {frames} frames lasting no time at all")
        if not rate:
            rate = Fraction(frames) / duration
        listed = stream.frames
        if listed and frames < listed:
            raise MediaError(path, f"truncated: decoded {frames} of the {listed} frames listed")
        if stream.duration and tb is not None:
            header_s = stream.duration * tb
            if duration + Fraction(3, 2) / rate < header_s:
                raise MediaError(
                    path,
                    f"truncated: decoded {float(duration):.3f} s of the "
                    f"{float(header_s):.3f} s listed",
                )
        extradata = stream.codec_context.extradata or b""
        return MediaInfo(
            path=path,
            kind="video",
            width=stream.codec_context.width,
            height=stream.codec_context.height,
            codec=stream.codec_context.name,
            pix_fmt=pix_fmt,
            frames=frames,
            size_bytes=size_bytes,
            duration_s=float(duration),
            rate=Fraction(rate),
            time_base=Fraction(tb) if tb is not None else None,
            codec_config=hashlib.sha256(extradata).hexdigest()[:16] if extradata else "",
        )


def load_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(path, f"cannot read image: {e}") from e
