"""The film gate and build_film on tiny solid-colour clips (128x72, 24 fps)."""

from __future__ import annotations

import json
from pathlib import Path

import av
import pytest
from PIL import Image

from comfy_assets.film.gate import GateBlocked, Policy, Shot, build_film, gate
from comfy_assets.film.probe import probe
from tests.film.test_media import solid

COLOURS = [
    (230, 20, 20),
    (20, 230, 20),
    (20, 20, 230),
    (230, 230, 20),
    (20, 230, 230),
    (230, 20, 230),
]
DELIVERY = Policy(mode="delivery")
DRAFT = Policy(mode="draft")


def centre_colours(path: Path) -> list[tuple[float, tuple[int, int, int]]]:
    with av.open(str(path)) as container:
        out = []
        for frame in container.decode(video=0):
            rgb = frame.to_ndarray(format="rgb24")
            out.append((float(frame.time), tuple(int(c) for c in rgb[36, 64])))
        return out


def colour_at(path: Path, t: float) -> tuple[int, int, int]:
    return [c for time, c in centre_colours(path) if time <= t + 1e-6][-1]


def close(a, b, tol: int = 16) -> bool:
    return all(abs(int(x) - int(y)) <= tol for x, y in zip(a, b, strict=True))


def storyboard(tmp_path: Path, frames=(24, 12, 36, 24, 18, 30)) -> list[Shot]:
    """Six succeeded shots, each a clip of its own colour lasting its duration_s."""
    shots = []
    for i, (n, colour) in enumerate(zip(frames, COLOURS, strict=False)):
        clip = solid(tmp_path / f"shot{i + 1}.mp4", colour, n)
        shots.append(
            Shot(shot=i + 1, job_id=f"j{i + 1}", state="succeeded", files=[clip], duration_s=n / 24)
        )
    return shots


def test_clean_storyboard_is_stream_copied_in_shot_order(tmp_path):
    shots = storyboard(tmp_path)
    shots.reverse()  # the job file order does not matter, the shot number does

    film = build_film(shots, DELIVERY, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert (film.concat.mode, film.gate.draft, film.gate.degraded, film.concat.clips) == (
        "copy",
        False,
        [],
        6,
    )
    probed = probe(tmp_path / "film.mp4")
    assert probed.duration_s == pytest.approx(sum(s.duration_s for s in shots), abs=1e-6)
    assert film.concat.duration_s == probed.duration_s
    assert close(colour_at(film.concat.path, 0.5), COLOURS[0])  # shot 1 first
    assert close(colour_at(film.concat.path, 1.25), COLOURS[1])
    assert close(colour_at(film.concat.path, 5.9), COLOURS[5])
    sheet = Image.open(film.contact_sheet)
    assert film.contact_sheet == tmp_path / "film.contact.png"
    assert sheet.size[0] == 3 * 160  # two rows of three 160-pixel tiles, labelled "shot N"
    assert sheet.size[1] == 2 * (round(160 * 72 / 128) + 18)


def test_mixed_sizes_are_reencoded_and_keep_the_durations(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    shots.append(
        Shot(
            3,
            "j3",
            "succeeded",
            [solid(tmp_path / "big.mp4", COLOURS[2], 18, size=(160, 90))],
            0.75,
        )
    )

    film = build_film(shots, DELIVERY, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert film.concat.mode == "reencode"
    probed = probe(film.concat.path)
    assert (probed.width, probed.height) == (128, 72)
    assert probed.duration_s == pytest.approx(2.75, abs=1e-6)


def test_image_shot_becomes_a_still_of_its_duration(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    image = tmp_path / "card.png"
    Image.new("RGB", (128, 72), COLOURS[3]).save(image)
    shots.insert(1, Shot(5, "j5", "succeeded", [image], 1.5))

    film = build_film(shots, DELIVERY, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert film.concat.duration_s == pytest.approx(3.5, abs=1e-6)
    assert probe(tmp_path / "work" / "shot0005-still.mp4").duration_s == 1.5
    assert close(colour_at(film.concat.path, 1.9), COLOURS[1])  # shot 2 then shot 5
    assert close(colour_at(film.concat.path, 2.05), COLOURS[3])


def test_truncated_and_wrong_length_clips_block_delivery_with_the_reason(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24, 24))
    cut = shots[1].files[0]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    shots[2].duration_s = 2.0  # the clip lasts 1 s

    result = gate(shots, DELIVERY)

    assert not result.passed
    assert [(v.shot, v.verdict) for v in result.verdicts] == [
        (1, "ok"),
        (2, "blocked"),
        (3, "blocked"),
    ]
    assert result.verdicts[1].reason.startswith(f"bad media: {cut}: truncated: '")
    assert "duration 1.000 s, expected 2.000 s" in result.verdicts[2].reason
    lines = result.describe().splitlines()
    assert lines[1].startswith("shot 2 (job j2): blocked: bad media: ")
    assert lines[2].startswith("shot 3 (job j3): blocked: duration 1.000 s")
    assert len(lines) == 3  # the ok shot is not listed


def test_a_clip_within_tolerance_passes(tmp_path):
    shots = storyboard(tmp_path, frames=(24,))
    shots[0].duration_s = 1.08  # 8 % off, tolerance 10 %

    assert gate(shots, DELIVERY).passed
    assert not gate(shots, Policy(mode="delivery", duration_tolerance=0.05)).passed


def test_failed_fatal_shot_blocks_delivery_and_writes_nothing(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24, 24))
    shots[2] = Shot(3, "j3", "failed_fatal", [], 1.0, reason="IndexError: tuple index out of range")
    out = tmp_path / "out" / "film.mp4"

    with pytest.raises(GateBlocked) as caught:
        build_film(shots, DELIVERY, out, work_dir=tmp_path / "work")

    assert "shot 3 (job j3): blocked: failed_fatal: IndexError: tuple index out of range" in str(
        caught.value
    )
    assert caught.value.result.blocked == [3]
    assert not out.exists() and not (tmp_path / "out" / "film.contact.png").exists()
    assert not (tmp_path / "work").exists()


def test_failed_fatal_shot_becomes_a_slate_of_its_length_in_a_draft_film(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24, 24))
    shots[1] = Shot(2, "j2", "failed_fatal", [], 1.5, reason="IndexError: tuple index out of range")

    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert (film.gate.draft, film.gate.degraded, film.gate.placeholders) == (True, [2], [2])
    assert film.concat.duration_s == pytest.approx(1 + 1.5 + 1, abs=1e-6)
    assert probe(film.concat.path).duration_s == pytest.approx(3.5, abs=1e-6)
    # The slate runs from 1.0 s to 2.5 s: dark, unlike the red and blue around it.
    assert close(colour_at(film.concat.path, 0.9), COLOURS[0])
    slate = colour_at(
        film.concat.path, 1.05
    )  # the centre pixel may fall on text: check it is not a neighbour
    assert not close(slate, COLOURS[0], tol=60) and not close(slate, COLOURS[2], tol=60)
    assert close(colour_at(film.concat.path, 2.55), COLOURS[2])
    with av.open(str(film.concat.path)) as container:
        frame = next(f for f in container.decode(video=0) if f.time >= 1.5)
        assert frame.to_ndarray(format="gray").mean() < 80
        assert container.metadata["comment"] == "DRAFT: shots 2 (slate)"
    assert "shot 2 (job j2): degraded: failed_fatal: IndexError" in film.gate.describe()


def test_unknown_or_unfinished_shots_block_in_both_modes(tmp_path):
    for policy in (DELIVERY, DRAFT):
        shots = storyboard(tmp_path, frames=(24, 24, 24))
        shots[0].state = "rendering"
        shots[1].state = "exploded"
        shots[2].state = "failed_retryable"

        result = gate(shots, policy)

        assert not result.passed
        assert [v.reason for v in result.verdicts] == [
            "not finished: rendering",
            "unknown state 'exploded'",
            "not finished: failed_retryable",
        ]


def test_optional_unfinished_shot_is_a_slate_in_draft_but_blocks_delivery(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    shots.append(Shot(3, "j3", "pending", [], 0.5, optional=True))

    assert gate(shots, DELIVERY).blocked == [3]
    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")
    assert film.gate.placeholders == [3]
    assert film.concat.duration_s == pytest.approx(2.5, abs=1e-6)


def test_degraded_job_render_is_used_under_draft_and_blocks_delivery(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    shots[1].state, shots[1].reason = "degraded", "fell back to 512px"

    assert gate(shots, DELIVERY).verdicts[1].reason == "degraded: fell back to 512px"
    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")
    assert (film.gate.draft, film.gate.degraded, film.gate.placeholders) == (True, [2], [])
    assert close(colour_at(film.concat.path, 1.5), COLOURS[1])  # its own render, not a slate


def test_broken_and_wrong_length_shots_become_slates_under_draft(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24, 24))
    shots[0].files = [tmp_path / "never-written.mp4"]
    shots[2].duration_s = 2.0

    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert film.gate.placeholders == [1, 3]
    assert film.concat.duration_s == pytest.approx(1 + 1 + 2, abs=1e-6)  # slates last duration_s
    reasons = {v.shot: v.reason for v in film.gate.verdicts}
    assert reasons[1].startswith("output file missing: ")
    assert reasons[3].startswith("duration 1.000 s, expected 2.000 s")


def test_slate_without_expected_duration_lasts_two_seconds(tmp_path):
    shots = storyboard(tmp_path, frames=(24,))
    shots.append(Shot(2, "j2", "failed_fatal", [], None, reason="OOM"))

    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")

    assert film.concat.duration_s == pytest.approx(3.0, abs=1e-6)


def test_two_jobs_with_one_shot_number_block(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    shots[1].shot = 1

    result = gate(shots, DRAFT)

    assert result.blocked == [1, 1]
    assert "shot number used by jobs j1, j2" in result.describe()


def test_gate_and_film_results_are_plain_json_for_metadata(tmp_path):
    shots = storyboard(tmp_path, frames=(24, 24))
    shots[1] = Shot(2, "j2", "failed_fatal", [], 1.0, reason="IndexError")

    film = build_film(shots, DRAFT, tmp_path / "film.mp4", work_dir=tmp_path / "work")
    as_json = json.loads(json.dumps(film.to_dict()))

    assert as_json["draft"] is True and as_json["placeholders"] == [2]
    assert as_json["gate"]["verdicts"][1]["verdict"] == "degraded"
