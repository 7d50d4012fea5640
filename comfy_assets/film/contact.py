"""A contact sheet: one frame of every shot, labelled, in a grid (a PNG)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
from PIL import Image, ImageDraw, ImageFont

from comfy_assets.film.encode import atomic_output, fit
from comfy_assets.film.probe import MediaError, MediaInfo, load_image, probe


@dataclass(frozen=True)
class ContactSheet:
    """A PNG of one tile per clip; ``tiles`` are the thumbnails' (left, top, right, bottom)
    boxes in pixels, in clip order."""

    path: Path
    tiles: list[tuple[int, int, int, int]]


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
    beneath (``labels`` default to 1, 2, ...; a label may have several lines, each cut to
    the tile's width with "…"). Thumbnails keep the first clip's aspect ratio;
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
    lines = max(label.count("\n") + 1 for label in labels)
    label_height = 4 + 14 * lines
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
        sheet.paste(fit(_middle_image(info), thumb_width, thumb_height), (left, top))
        tiles.append((left, top, left + thumb_width, top + thumb_height))
        for n, text in enumerate(label.split("\n")):
            text = _fit(text, font, thumb_width - 8)
            place = (left + 4, top + thumb_height + 2 + 14 * n)
            draw.text(place, text, font=font, fill=(235, 235, 235))
    with atomic_output(Path(out)) as tmp:
        sheet.save(tmp, format="PNG")
    return ContactSheet(path=Path(out), tiles=tiles)


def _fit(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int) -> str:
    """``text``, cut with "…" to at most ``width`` pixels in ``font``."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def _middle_image(info: MediaInfo) -> Image.Image:
    """The image itself, or the frame shown half way through a video."""
    if info.kind == "image":
        return load_image(info.path)
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
