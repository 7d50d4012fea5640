"""media.py on tiny clips written here with PyAV (128x72, 24 fps, solid colours)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from comfy_assets.film.concat import concat
from comfy_assets.film.contact import contact_sheet
from comfy_assets.film.probe import MediaError, probe
from comfy_assets.film.stills import slate, still_clip

RECORDED_VIDEO = Path(__file__).parents[2] / "data/recorded/files/video-shot_00001_.mp4"
RED, GREEN, BLUE = (230, 20, 20), (20, 230, 20), (20, 20, 230)
YELLOW, CYAN, MAGENTA, WHITE = (230, 230, 20), (20, 230, 230), (230, 20, 230), (240, 240, 240)


def write_clip(path: Path, colours: list[tuple[int, int, int]], *, fps: int = 24, size=(128, 72)):
    """One solid frame per entry of ``colours``, H.264 yuv420p MP4."""
    width, height = size
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i, colour in enumerate(colours):
            frame = av.VideoFrame.from_ndarray(
                np.full((height, width, 3), colour, np.uint8), format="rgb24"
            )
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def solid(path: Path, colour, frames: int, **kw) -> Path:
    return write_clip(path, [colour] * frames, **kw)


def frame_colours(path: Path) -> list[tuple[float, tuple[int, int, int]]]:
    """(time in seconds, centre pixel) of every decoded frame."""
    with av.open(str(path)) as container:
        out = []
        for frame in container.decode(video=0):
            rgb = frame.to_ndarray(format="rgb24")
            out.append(
                (
                    float(frame.time),
                    tuple(int(c) for c in rgb[rgb.shape[0] // 2, rgb.shape[1] // 2]),
                )
            )
        return out


def close(a, b, tol: int = 16) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b, strict=True))


def test_probe_reports_size_fps_and_duration_from_decoded_frames(tmp_path):
    info = probe(solid(tmp_path / "a.mp4", RED, 36))

    assert info.kind == "video"
    assert (info.width, info.height, info.fps, info.frames) == (128, 72, 24.0, 36)
    assert info.duration_s == pytest.approx(1.5)
    assert (info.codec, info.pix_fmt) == ("h264", "yuv420p")


def test_probe_of_a_png_is_an_image_with_its_size(tmp_path):
    path = tmp_path / "still.png"
    Image.new("RGB", (64, 40), RED).save(path)

    info = probe(path)

    assert (info.kind, info.size, info.duration_s, info.codec) == ("image", (64, 40), None, "png")


def _cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def _missing(d: Path) -> Path:
    return d / "nothing.mp4"


def _empty(d: Path) -> Path:
    (d / "empty.mp4").write_bytes(b"")
    return d / "empty.mp4"


def _half(d: Path) -> Path:
    return _cut(solid(d / "half.mp4", RED, 24), 0.5)


def _garbage(d: Path) -> Path:
    (d / "junk.mp4").write_bytes(b"not a video " * 40)
    return d / "junk.mp4"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_missing, "does not exist"),
        (_empty, "empty"),
        (_half, "truncated"),
        (_garbage, "cannot be opened"),
    ],
    ids=["missing", "empty", "half", "garbage"],
)
def test_probe_names_the_file_and_what_is_wrong(tmp_path, make, expected):
    path = make(tmp_path)

    with pytest.raises(MediaError) as caught:
        probe(path)

    assert str(path) in str(caught.value)
    assert expected in caught.value.problem


def test_truncated_png_is_undecodable(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), np.uint8)).save(path)
    _cut(path, 0.5)

    with pytest.raises(MediaError, match="undecodable image"):
        probe(path)


def test_a_cut_that_ffmpeg_still_decodes_is_caught_as_truncated(tmp_path):
    # The recorded ComfyUI MP4 cut at 90 % loses only its trailing metadata box: every
    # frame still decodes, but the file is not what the server wrote.
    path = tmp_path / "shot.mp4"
    path.write_bytes(RECORDED_VIDEO.read_bytes())
    assert probe(path).frames == 24
    _cut(path, 0.9)

    with pytest.raises(MediaError, match="truncated: 'moov' box"):
        probe(path)


def test_six_matching_clips_are_stream_copied_into_the_sum_of_their_durations(tmp_path):
    colours = [RED, GREEN, BLUE, YELLOW, CYAN, MAGENTA]
    frames = [24, 12, 36, 24, 18, 30]
    clips = [
        solid(tmp_path / f"s{i}.mp4", c, n)
        for i, (c, n) in enumerate(zip(colours, frames, strict=True))
    ]

    result = concat(clips, tmp_path / "film.mp4")

    assert result.mode == "copy", result.reason
    film = probe(tmp_path / "film.mp4")
    assert film.duration_s == pytest.approx(sum(frames) / 24, abs=1e-6)
    assert film.frames == sum(frames) == result.media.frames
    seen = [c for _, c in frame_colours(tmp_path / "film.mp4")]
    starts = np.cumsum([0, *frames[:-1]])
    for start, count, colour in zip(starts, frames, colours, strict=True):
        assert close(seen[start], colour) and close(seen[start + count - 1], colour)


def test_mixed_sizes_and_rates_are_reencoded_to_the_first_clip(tmp_path):
    clips = [
        solid(tmp_path / "a.mp4", RED, 24),
        solid(tmp_path / "b.mp4", GREEN, 18, size=(160, 90)),
        solid(tmp_path / "c.mp4", BLUE, 30, fps=30),  # 1 s at 30 fps -> 24 frames at 24 fps
    ]

    result = concat(clips, tmp_path / "film.mp4")

    assert result.mode == "reencode"
    assert "b.mp4" in result.reason
    film = probe(tmp_path / "film.mp4")
    assert (film.width, film.height, film.fps) == (128, 72, 24.0)
    assert film.duration_s == pytest.approx(1 + 0.75 + 1, abs=1e-6)
    colours = frame_colours(tmp_path / "film.mp4")
    assert close(colours[30][1], GREEN) and close(colours[50][1], BLUE)


def test_the_reason_for_a_reencode_names_clips_by_the_names_given(tmp_path):
    # The film names its clips by shot: ComfyUI's counter files say nothing of the shot.
    clips = [
        solid(tmp_path / "shot_00005_.mp4", RED, 24),
        solid(tmp_path / "shot_00002_.mp4", GREEN, 24, size=(160, 90)),
    ]

    result = concat(clips, tmp_path / "film.mp4", names=["shot 1", "shot 2"])

    assert result.mode == "reencode"
    assert "shot 2" in result.reason and "shot 1" in result.reason
    assert "_.mp4" not in result.reason


def test_copy_is_refused_when_a_target_size_is_asked_for(tmp_path):
    clips = [solid(tmp_path / "a.mp4", RED, 12), solid(tmp_path / "b.mp4", GREEN, 12)]

    result = concat(clips, tmp_path / "film.mp4", width=64, height=36)

    assert result.mode == "reencode"
    assert (probe(tmp_path / "film.mp4").width, result.media.height) == (64, 36)


def test_still_clip_holds_the_image_for_its_duration_letterboxed(tmp_path):
    image = tmp_path / "red.png"
    Image.new("RGB", (64, 64), RED).save(image)

    still_clip(image, 1.5, tmp_path / "still.mp4", width=128, height=72, fps=24)

    info = probe(tmp_path / "still.mp4")
    assert (info.duration_s, info.frames, info.size) == (1.5, 36, (128, 72))
    with av.open(str(tmp_path / "still.mp4")) as container:
        rgb = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert close(rgb[36, 64], RED)
    assert close(rgb[36, 4], (0, 0, 0))  # a square image in a 16:9 frame is pillarboxed


def test_slate_is_a_dark_card_with_text_of_the_given_length(tmp_path):
    still_clip(
        slate(["SHOT 3 MISSING", "failed_fatal: IndexError"], 128, 72),
        2.0,
        tmp_path / "slate.mp4",
        width=128,
        height=72,
        fps=24,
    )

    info = probe(tmp_path / "slate.mp4")
    assert info.duration_s == 2.0
    with av.open(str(tmp_path / "slate.mp4")) as container:
        luma = next(container.decode(video=0)).to_ndarray(format="gray")
    assert luma.mean() < 60  # dark background
    assert (luma > 150).sum() > 20  # and some bright text


def test_contact_sheet_has_one_tile_per_clip_showing_its_middle_frame(tmp_path):
    colours = [RED, GREEN, BLUE, YELLOW, CYAN, MAGENTA, WHITE]
    # First half black, second half the colour: only the middle frame shows the colour.
    clips = [
        write_clip(tmp_path / f"c{i}.mp4", [(0, 0, 0)] * 12 + [c] * 12)
        for i, c in enumerate(colours)
    ]

    sheet = contact_sheet(clips, tmp_path / "sheet.png", columns=3, thumb_width=80)

    assert len(sheet.tiles) == 7
    image = Image.open(sheet.path).convert("RGB")
    assert image.width == 3 * 80
    assert len({top for _, top, _, _ in sheet.tiles}) == 3  # rows of 3, 3, 1
    for (left, top, right, bottom), colour in zip(sheet.tiles, colours, strict=True):
        assert close(image.getpixel(((left + right) // 2, (top + bottom) // 2)), colour)


def test_a_failed_concat_leaves_nothing_under_the_output_name(tmp_path):
    image = tmp_path / "still.png"
    Image.new("RGB", (64, 64), RED).save(image)
    clips = [solid(tmp_path / "a.mp4", RED, 12), image]
    out = tmp_path / "out" / "film.mp4"

    with pytest.raises(MediaError, match="is an image"):
        concat(clips, out)

    assert not out.exists()
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
