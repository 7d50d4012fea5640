"""Clips from still images: a rendered image held for a shot's duration, and slates (a
card naming a missing or broken shot and why) in a draft film."""

from __future__ import annotations

import textwrap
from fractions import Fraction
from pathlib import Path

import av
from PIL import Image, ImageDraw, ImageFont

from comfy_assets.film import encode
from comfy_assets.film.probe import load_image

_SLATE_BACKGROUND = (24, 24, 28)

_SLATE_TITLE = (255, 190, 60)

_SLATE_TEXT = (235, 235, 235)


def still_clip(
    image: Path | Image.Image,
    duration_s: float,
    out: Path,
    *,
    width: int,
    height: int,
    fps: float | Fraction,
) -> Path:
    """Write ``image`` (an image file, or a picture such as a :func:`slate`) held for
    ``duration_s`` seconds as an H.264 yuv420p MP4 at ``out``.

    The image is scaled to fit width x height (pixels, even) and centred on black; the clip has
    round(duration_s * fps) frames (at least one). Returns ``out``. Raises MediaError if the
    image file cannot be read, ValueError for a non-positive duration or fps or an odd size.
    """
    picture = image if isinstance(image, Image.Image) else load_image(Path(image))
    out = Path(out)
    encode.check_size(width, height)
    rate = encode.as_rate(fps)
    count = encode.frame_count(duration_s, rate)
    frame = av.VideoFrame.from_image(encode.fit(picture, width, height)).reformat(format="yuv420p")
    with encode.atomic_output(out) as tmp, encode.h264_writer(tmp, width, height, rate) as sink:
        for _ in range(count):
            sink.write(frame)
    return out


def slate(text_lines: list[str], width: int, height: int) -> Image.Image:
    """A placeholder card of width x height pixels naming a missing or broken shot: dark
    background, the first line as a title, the others below, Pillow's default font."""
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
