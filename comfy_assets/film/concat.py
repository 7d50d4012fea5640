"""Shots into one film: FFmpeg's concat demuxer with stream copy when the shots agree,
else a re-encode to one size and frame rate (saying why)."""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import av
import imageio_ffmpeg

from comfy_assets.film.encode import (
    as_rate,
    atomic_output,
    check_size,
    fit,
    frame_count,
    h264_writer,
)
from comfy_assets.film.probe import MediaError, MediaInfo, probe


@dataclass(frozen=True)
class ConcatInfo:
    """A concatenated film: ``media`` the written film as probed (at its final path;
    seconds, pixels, fps, frames), ``mode`` "copy" (stream copy) or "reencode" (libx264),
    ``reason`` why it was re-encoded ("" for a copy), ``clips`` how many were joined."""

    media: MediaInfo
    mode: Literal["copy", "reencode"]
    reason: str
    clips: int

    @property
    def path(self) -> Path:
        """Where the film is."""
        return self.media.path

    @property
    def duration_s(self) -> float:
        """The film's length in seconds (probed: a video always has one)."""
        assert self.media.duration_s is not None
        return self.media.duration_s


def _copy_params(info: MediaInfo) -> dict[str, object]:
    return {
        "codec": info.codec,
        "size": f"{info.width}x{info.height}",
        "pix_fmt": info.pix_fmt,
        "time_base": info.time_base,
        "fps": info.rate,
        "codec_config": info.codec_config,
    }


def _reencode_reason(
    infos: list[MediaInfo], names: list[str], width: int, height: int, rate: Fraction
) -> str:
    """Why the clips cannot be stream-copied into a width x height, rate film ("" if they
    can); each clip named by ``names`` (``shot 1``, or its file's name)."""
    first, name = infos[0], names[0]
    if (first.width, first.height) != (width, height):
        return f"target size {width}x{height} differs from {name} {first.width}x{first.height}"
    if first.rate != rate:
        return f"target fps {float(rate):g} differs from {name} {first.fps:g}"
    if first.codec != "h264" or first.pix_fmt != "yuv420p":
        return f"{name} is {first.codec}/{first.pix_fmt}, not h264/yuv420p"
    reference = _copy_params(first)
    for info, other in zip(infos[1:], names[1:], strict=True):
        for key, value in _copy_params(info).items():
            if value != reference[key]:
                return f"{other} {key} {value} differs from {name} {reference[key]}"
    return ""


def concat(
    clips: list[Path],
    out: Path,
    *,
    width: int | None = None,
    height: int | None = None,
    fps: float | Fraction | None = None,
    metadata: Mapping[str, str] | None = None,
    names: list[str] | None = None,
) -> ConcatInfo:
    """Join video ``clips`` in order into an MP4 at ``out`` (video only).

    When every clip has the same codec parameters (h264/yuv420p, size, pix_fmt, time base,
    fps, SPS/PPS) and matches the target, the streams are copied with FFmpeg's concat demuxer;
    otherwise every clip is re-encoded with libx264 to the target size (letterboxed) and fps,
    which default to the first clip's. Each clip keeps its own duration rounded to whole frames.
    ``metadata`` goes into the container (e.g. {"comment": "DRAFT ..."}). ``names``: what
    the reason for a re-encode calls each clip (``shot 1``; default its file's name).
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
    rate = first.rate if fps is None else as_rate(fps)
    assert rate is not None  # probe always sets a video's rate
    if names is not None and len(names) != len(infos):
        raise ValueError(f"{len(names)} names for {len(infos)} clips")
    named = names if names is not None else [info.path.name for info in infos]
    reason = _reencode_reason(infos, named, width, height, rate)
    with atomic_output(out) as tmp:
        if reason:
            check_size(width, height)
            expected = _reencode(infos, tmp, width, height, rate, metadata)
        else:
            _ffmpeg_concat_copy(infos, tmp, metadata, out)
            expected = sum(info.frames for info in infos)
        result = probe(tmp)
        if result.frames != expected:
            raise MediaError(out, f"film has {result.frames} frames, expected {expected}")
    # Probed under its temporary name: the film is at ``out`` now.
    media = dataclasses.replace(result, path=out)
    return ConcatInfo(media, "reencode" if reason else "copy", reason, clips=len(infos))


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
    with h264_writer(tmp, width, height, rate, metadata) as sink:
        for info in infos:
            converted: tuple[av.VideoFrame, av.VideoFrame] | None = None
            for frame in _retimed(info, rate):
                if converted is None or converted[0] is not frame:
                    if (frame.width, frame.height) == (width, height):
                        target = frame.reformat(format="yuv420p")
                    else:
                        fitted = fit(frame.to_image(), width, height)
                        target = av.VideoFrame.from_image(fitted).reformat(format="yuv420p")
                    converted = (frame, target)
                sink.write(converted[1])
        return sink.count


def _retimed(info: MediaInfo, rate: Fraction) -> Iterator[av.VideoFrame]:
    """The clip's frames resampled to ``rate``: for each output tick, the last source frame
    shown at that time; round(duration_s * rate) frames in all."""
    assert info.duration_s is not None and info.rate is not None
    count = frame_count(info.duration_s, rate)
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
