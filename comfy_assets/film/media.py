"""Media files for films: probe, encode stills and slates, concatenate, contact sheets.

PyAV decodes and encodes; the ffmpeg binary that imageio-ffmpeg ships runs the concat
demuxer for stream copies. Films are video only: audio streams are not carried over.
Every output is written under a temporary name in its folder and then renamed, so a crash
never leaves a half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import imageio_ffmpeg
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

# Suffixes taken to be videos when a job lists several outputs (films.py picks by these).
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi", ".gif"})

_X264_OPTIONS = {"crf": "18", "preset": "veryfast"}
_SLATE_BACKGROUND = (24, 24, 28)
_SLATE_TITLE = (255, 190, 60)
_SLATE_TEXT = (235, 235, 235)


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
    fps: float | None = None
    rate: Fraction | None = None
    time_base: Fraction | None = None
    codec_config: str = ""

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return (self.width, self.height)


@dataclass(frozen=True)
class ConcatInfo:
    """A concatenated film: ``mode`` "copy" (stream copy) or "reencode" (libx264), ``reason``
    why it was re-encoded ("" for a copy), and the probed result (seconds, pixels, fps)."""

    path: Path
    mode: Literal["copy", "reencode"]
    reason: str
    duration_s: float
    frames: int
    width: int
    height: int
    fps: float
    clips: int


@dataclass(frozen=True)
class ContactSheet:
    """A PNG of one tile per clip; ``tiles`` are the thumbnails' (left, top, right, bottom)
    boxes in pixels, in clip order."""

    path: Path
    tiles: list[tuple[int, int, int, int]]


# ---------------------------------------------------------------- probe


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
            fps=float(rate),
            rate=Fraction(rate),
            time_base=Fraction(tb) if tb is not None else None,
            codec_config=hashlib.sha256(extradata).hexdigest()[:16] if extradata else "",
        )


# ---------------------------------------------------------------- writing


@contextmanager
def _atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``out`` (same suffix, so tools pick the format) and
    rename it to ``out`` only if the block finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{uuid.uuid4().hex[:8]}.partial{out.suffix}")
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _as_rate(fps: float | Fraction) -> Fraction:
    rate = fps if isinstance(fps, Fraction) else Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return rate


def _check_size(width: int, height: int) -> None:
    # yuv420p halves the chroma planes: libx264 refuses odd sizes.
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"width and height must be positive and even, got {width}x{height}")


def _frame_count(duration_s: float, rate: Fraction) -> int:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    return max(1, round(Fraction(duration_s).limit_denominator(1_000_000) * rate))


@contextmanager
def _h264_writer(
    path: Path,
    width: int,
    height: int,
    rate: Fraction,
    metadata: Mapping[str, str] | None = None,
) -> Iterator[_FrameSink]:
    container = av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"})
    try:
        # Metadata must be set before the first packet writes the header.
        container.metadata.update(dict(metadata or {}))
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(_X264_OPTIONS)
        sink = _FrameSink(container, stream, rate)
        yield sink
        for packet in stream.encode():
            container.mux(packet)
    finally:
        container.close()


class _FrameSink:
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


def _fit(image: Image.Image, width: int, height: int) -> Image.Image:
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


def _hold(
    image: Image.Image, duration_s: float, out: Path, width: int, height: int, fps: float | Fraction
) -> Path:
    _check_size(width, height)
    rate = _as_rate(fps)
    count = _frame_count(duration_s, rate)
    frame = av.VideoFrame.from_image(_fit(image, width, height)).reformat(format="yuv420p")
    with _atomic_output(out) as tmp, _h264_writer(tmp, width, height, rate) as sink:
        for _ in range(count):
            sink.write(frame)
    return out


def _load_image(path: Path) -> Image.Image:
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(path, f"cannot read image: {e}") from e


def still_clip(
    image: Path,
    duration_s: float,
    out: Path,
    *,
    width: int,
    height: int,
    fps: float | Fraction,
) -> Path:
    """Write ``image`` held for ``duration_s`` seconds as an H.264 yuv420p MP4 at ``out``.

    The image is scaled to fit width x height (pixels, even) and centred on black; the clip has
    round(duration_s * fps) frames (at least one). Returns ``out``. Raises MediaError if the
    image cannot be read, ValueError for a non-positive duration or fps or an odd size.
    """
    return _hold(_load_image(Path(image)), duration_s, Path(out), width, height, fps)


def slate_clip(
    text_lines: list[str],
    duration_s: float,
    out: Path,
    *,
    width: int,
    height: int,
    fps: float | Fraction,
) -> Path:
    """Write a placeholder card (dark background, first line as a title, the others below,
    Pillow's default font) held for ``duration_s`` seconds as an H.264 MP4 at ``out``.

    Same frame count rule and errors as :func:`still_clip`. Returns ``out``.
    """
    return _hold(
        _render_slate(text_lines, width, height), duration_s, Path(out), width, height, fps
    )


def _render_slate(text_lines: list[str], width: int, height: int) -> Image.Image:
    card = Image.new("RGB", (width, height), _SLATE_BACKGROUND)
    draw = ImageDraw.Draw(card)
    title_font = ImageFont.load_default(size=max(9, height // 8))
    body_font = ImageFont.load_default(size=max(8, height // 16))
    rows: list[tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont, tuple[int, int, int]]] = []
    for i, line in enumerate(text_lines):
        font = title_font if i == 0 else body_font
        colour = _SLATE_TITLE if i == 0 else _SLATE_TEXT
        rows.extend((part, font, colour) for part in _wrap(draw, line, font, width * 0.9))
    heights = [_line_height(font) + max(2, height // 40) for _, font, _ in rows]
    y = max(0, (height - sum(heights)) // 2)
    for (text, font, colour), row_height in zip(rows, heights, strict=True):
        text_width = _text_box(draw, text, font)[0]
        draw.text(((width - text_width) // 2, y), text, font=font, fill=colour)
        y += row_height
    return card


def _text_box(
    draw: ImageDraw.ImageDraw, text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont
) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text or " ", font=font)
    return int(right - left), int(bottom - top)


def _line_height(font: ImageFont.FreeTypeFont | ImageFont.ImageFont) -> int:
    if isinstance(font, ImageFont.FreeTypeFont):
        ascent, descent = font.getmetrics()
        return ascent + descent
    return int(font.getbbox("Ag")[3])


def _wrap(
    draw: ImageDraw.ImageDraw,
    line: str,
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont,
    max_width: float,
) -> list[str]:
    """Split ``line`` into pieces no wider than max_width pixels (a single long word stays)."""
    for chars in range(max(len(line), 1), 0, -1):
        pieces = textwrap.wrap(line, chars, break_long_words=True) or [""]
        if all(_text_box(draw, p, font)[0] <= max_width for p in pieces):
            return pieces
    return [line]


# ---------------------------------------------------------------- concat


def _copy_params(info: MediaInfo) -> dict[str, object]:
    return {
        "codec": info.codec,
        "size": f"{info.width}x{info.height}",
        "pix_fmt": info.pix_fmt,
        "time_base": info.time_base,
        "fps": info.rate,
        "codec_config": info.codec_config,
    }


def _reencode_reason(infos: list[MediaInfo], width: int, height: int, rate: Fraction) -> str:
    """Why the clips cannot be stream-copied into a width x height, rate film ("" if they can)."""
    first = infos[0]
    if (first.width, first.height) != (width, height):
        return f"target size {width}x{height} differs from {first.path.name} {first.width}x{first.height}"
    if first.rate != rate:
        return f"target fps {float(rate):g} differs from {first.path.name} {first.fps:g}"
    if first.codec != "h264" or first.pix_fmt != "yuv420p":
        return f"{first.path.name} is {first.codec}/{first.pix_fmt}, not h264/yuv420p"
    reference = _copy_params(first)
    for info in infos[1:]:
        for key, value in _copy_params(info).items():
            if value != reference[key]:
                return f"{info.path.name} {key} {value} differs from {first.path.name} {reference[key]}"
    return ""


def concat(
    clips: list[Path],
    out: Path,
    *,
    width: int | None = None,
    height: int | None = None,
    fps: float | Fraction | None = None,
    metadata: Mapping[str, str] | None = None,
) -> ConcatInfo:
    """Join video ``clips`` in order into an MP4 at ``out`` (video only).

    When every clip has the same codec parameters (h264/yuv420p, size, pix_fmt, time base,
    fps, SPS/PPS) and matches the target, the streams are copied with FFmpeg's concat demuxer;
    otherwise every clip is re-encoded with libx264 to the target size (letterboxed) and fps,
    which default to the first clip's. Each clip keeps its own duration rounded to whole frames.
    ``metadata`` goes into the container (e.g. {"comment": "DRAFT ..."}).
    The written film is probed and its frame count checked before it is renamed to ``out``.

    Raises ValueError for no clips, MediaError for a clip that is broken or an image (make a
    still clip of it first), a failed ffmpeg run, or a film with the wrong frame count.
    """
    if not clips:
        raise ValueError("concat needs at least one clip")
    out = Path(out)
    infos = [probe(Path(c)) for c in clips]
    for info in infos:
        if info.kind != "video":
            raise MediaError(info.path, "is an image, not a video: make a still clip of it first")
    first = infos[0]
    width = first.width if width is None else width
    height = first.height if height is None else height
    rate = first.rate if fps is None else _as_rate(fps)
    assert rate is not None  # probe always sets a video's rate
    reason = _reencode_reason(infos, width, height, rate)
    with _atomic_output(out) as tmp:
        if reason:
            _check_size(width, height)
            expected = _reencode(infos, tmp, width, height, rate, metadata)
        else:
            _ffmpeg_concat_copy(infos, tmp, metadata, out)
            expected = sum(info.frames for info in infos)
        result = probe(tmp)
        if result.frames != expected:
            raise MediaError(out, f"film has {result.frames} frames, expected {expected}")
    assert result.duration_s is not None and result.fps is not None
    return ConcatInfo(
        path=out,
        mode="reencode" if reason else "copy",
        reason=reason,
        duration_s=result.duration_s,
        frames=result.frames,
        width=result.width,
        height=result.height,
        fps=result.fps,
        clips=len(infos),
    )


def _ffmpeg_concat_copy(
    infos: list[MediaInfo], tmp: Path, metadata: Mapping[str, str] | None, out: Path
) -> None:
    with tempfile.TemporaryDirectory(prefix="concat-") as work:
        listing = Path(work) / "list.txt"
        # Concat-list quoting: a ' inside '...' is written '\''.
        lines = ["file '" + str(i.path.resolve()).replace("'", "'\\''") + "'" for i in infos]
        listing.write_text("\n".join(lines) + "\n", encoding="utf-8")
        command = [
            imageio_ffmpeg.get_ffmpeg_exe(),
            "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
            "-f", "concat", "-safe", "0", "-i", str(listing),
            "-map", "0:v:0", "-c", "copy", "-movflags", "+faststart",
        ]  # fmt: skip
        for key, value in (metadata or {}).items():
            command += ["-metadata", f"{key}={value}"]
        command += ["-f", "mp4", str(tmp)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise MediaError(
                out,
                f"ffmpeg concat (stream copy) exited {done.returncode}: {done.stderr.strip()[-2000:]}",
            )


def _reencode(
    infos: list[MediaInfo],
    tmp: Path,
    width: int,
    height: int,
    rate: Fraction,
    metadata: Mapping[str, str] | None,
) -> int:
    """Encode every clip in turn into ``tmp``; returns the number of frames written."""
    with _h264_writer(tmp, width, height, rate, metadata) as sink:
        for info in infos:
            converted: tuple[av.VideoFrame, av.VideoFrame] | None = None
            for frame in _retimed(info, rate):
                if converted is None or converted[0] is not frame:
                    if (frame.width, frame.height) == (width, height):
                        target = frame.reformat(format="yuv420p")
                    else:
                        fitted = _fit(frame.to_image(), width, height)
                        target = av.VideoFrame.from_image(fitted).reformat(format="yuv420p")
                    converted = (frame, target)
                sink.write(converted[1])
        return sink.count


def _retimed(info: MediaInfo, rate: Fraction) -> Iterator[av.VideoFrame]:
    """The clip's frames resampled to ``rate``: for each output tick, the last source frame
    shown at that time; round(duration_s * rate) frames in all."""
    assert info.duration_s is not None and info.rate is not None
    count = _frame_count(info.duration_s, rate)
    with av.open(str(info.path)) as container:
        stream = container.streams.video[0]
        try:
            decoded = container.decode(stream)
            current = next(decoded)
            start = current.time or 0.0
            index = 0
            upcoming = next(decoded, None)
            for k in range(count):
                t = start + float(k / rate) + 1e-6
                while upcoming is not None and _when(upcoming, index + 1, start, info.rate) <= t:
                    current, upcoming = upcoming, next(decoded, None)
                    index += 1
                yield current
        except av.FFmpegError as e:
            raise MediaError(info.path, f"undecodable while re-encoding: {e}") from e


def _when(frame: av.VideoFrame, index: int, start: float, rate: Fraction) -> float:
    """A frame's presentation time in seconds (from its index when it has no timestamp)."""
    return frame.time if frame.time is not None else start + float(index / rate)


# ---------------------------------------------------------------- contact sheet


def contact_sheet(
    clips: list[Path],
    out: Path,
    *,
    columns: int = 6,
    thumb_width: int = 160,
    labels: list[str] | None = None,
) -> ContactSheet:
    """Write a PNG with one tile per clip (the frame in the middle of each video, or the image
    itself), ``columns`` tiles a row, each ``thumb_width`` pixels wide with its label printed
    beneath (``labels`` default to 1, 2, ...). Thumbnails keep the first clip's aspect ratio;
    others are letterboxed. Raises ValueError for no clips or mismatched labels, MediaError
    for a broken clip.
    """
    if not clips:
        raise ValueError("contact_sheet needs at least one clip")
    if columns < 1 or thumb_width < 2:
        raise ValueError(f"columns must be >= 1 and thumb_width >= 2, got {columns}, {thumb_width}")
    labels = labels if labels is not None else [str(i + 1) for i in range(len(clips))]
    if len(labels) != len(clips):
        raise ValueError(f"{len(labels)} labels for {len(clips)} clips")
    infos = [probe(Path(c)) for c in clips]
    thumb_height = max(2, round(thumb_width * infos[0].height / infos[0].width))
    font = ImageFont.load_default(size=12)
    label_height = 18
    cols = min(columns, len(infos))
    rows = -(-len(infos) // cols)
    sheet = Image.new(
        "RGB", (cols * thumb_width, rows * (thumb_height + label_height)), (16, 16, 16)
    )
    draw = ImageDraw.Draw(sheet)
    tiles: list[tuple[int, int, int, int]] = []
    for i, (info, label) in enumerate(zip(infos, labels, strict=True)):
        left = (i % cols) * thumb_width
        top = (i // cols) * (thumb_height + label_height)
        sheet.paste(_fit(_middle_image(info), thumb_width, thumb_height), (left, top))
        tiles.append((left, top, left + thumb_width, top + thumb_height))
        draw.text((left + 4, top + thumb_height + 2), label, font=font, fill=(235, 235, 235))
    with _atomic_output(Path(out)) as tmp:
        sheet.save(tmp, format="PNG")
    return ContactSheet(path=Path(out), tiles=tiles)


def _middle_image(info: MediaInfo) -> Image.Image:
    """The image itself, or the frame shown half way through a video."""
    if info.kind == "image":
        return _load_image(info.path)
    assert info.duration_s is not None
    with av.open(str(info.path)) as container:
        stream = container.streams.video[0]
        tb = stream.time_base
        begin = float(stream.start_time * tb) if stream.start_time is not None and tb else 0.0
        middle = begin + info.duration_s / 2
        try:
            if tb:
                container.seek(int(middle / tb), stream=stream, backward=True)
            chosen: av.VideoFrame | None = None
            for frame in container.decode(stream):
                if chosen is not None and frame.time is not None and frame.time > middle:
                    break
                chosen = frame
        except av.FFmpegError as e:
            raise MediaError(info.path, f"undecodable while taking a thumbnail: {e}") from e
    if chosen is None:
        raise MediaError(info.path, "no frame decoded for the contact sheet")
    return chosen.to_image()
