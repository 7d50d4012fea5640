"""Writing H.264 files: frames through PyAV's encoder, each file complete or not there
(written beside and renamed), sizes and rates checked."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

import av
from PIL import Image

X264_OPTIONS = {"crf": "18", "preset": "veryfast"}


@contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out`` (same suffix, so tools pick the format) and
    rename it to ``out`` only if the block finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{uuid.uuid4().hex[:8]}.partial{out.suffix}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def as_rate(fps: float | Fraction) -> Fraction:
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return rate


def check_size(width: int, height: int) -> None:
    # yuv420p halves the chroma planes: libx264 refuses odd sizes.
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"width and height must be positive and even, got {width}x{height}")


def frame_count(duration_s: float, rate: Fraction) -> int:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    return max(1, round(Fraction(duration_s).limit_denominator(1_000_000) * rate))


@contextmanager
def h264_writer(
    path: Path,
    width: int,
    height: int,
    rate: Fraction,
    metadata: Mapping[str, str] | None = None,
) -> Iterator[FrameSink]:
    container = av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"})
    try:
        # Metadata must be set before the first packet writes the header.
        container.metadata.update(dict(metadata or {}))
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(X264_OPTIONS)
        sink = FrameSink(container, stream, rate)
        yield sink
        for packet in stream.encode():
            container.mux(packet)
    finally:
        container.close()


class FrameSink:
    """Encodes frames one after another at a constant rate (pts = frame index)."""

    def __init__(
        self, container: av.container.OutputContainer, stream: av.VideoStream, rate: Fraction
    ) -> None:
        self._container = container
        self._stream = stream
        self._time_base = 1 / rate
        self.count = 0

    def write(self, frame: av.VideoFrame) -> None:
        frame.pts = self.count
        frame.time_base = self._time_base
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        self.count += 1


def fit(image: Image.Image, width: int, height: int) -> Image.Image:
    """``image`` scaled to fit width x height, centred on black (letterbox/pillarbox)."""
    image = image.convert("RGB")
    if image.size == (width, height):
        return image
    scale = min(width / image.width, height / image.height)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    canvas = Image.new("RGB", (width, height))
    canvas.paste(
        image.resize(size, Image.Resampling.LANCZOS),
        ((width - size[0]) // 2, (height - size[1]) // 2),
    )
    return canvas
