"""From rendered shots to a film: the gate, then stills, slates and the concat.

The gate looks at every shot before anything is written. Under "delivery" every problem
blocks the film. Under "draft" a shot that failed for good, an optional shot that is not
done, or a shot whose media is broken or the wrong length is replaced by a slate (a card
saying which shot is missing and why), and the film is marked draft. A shot in an unknown
state, or a required shot that is still pending/submitted/rendering/failed_retryable,
blocks in both modes: nobody can tell yet what it will be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from comfy_assets.film.concat import ConcatInfo, concat
from comfy_assets.film.contact import contact_sheet
from comfy_assets.film.probe import VIDEO_SUFFIXES, MediaError, MediaInfo, probe
from comfy_assets.film.stills import slate, still_clip
from comfy_assets.jobs.states import UNFINISHED, State

KNOWN_STATES = frozenset(state.value for state in State)
# Not finished yet: the shot may still succeed or fail, so no verdict can be given.
DEFAULT_HOLD_S = 2.0  # a slate or still for a shot without a usable duration_s
DEFAULT_SIZE = (1280, 720)  # only when no shot gives a size (every shot is a slate)
DEFAULT_FPS = Fraction(24)
_SLATE_REASON_CHARS = 160  # a traceback does not fit on a card

Verdict = Literal["ok", "degraded", "blocked"]


@dataclass
class Shot:
    """One storyboard shot and what its job produced.

    ``shot`` orders the film; ``files`` are the job's outputs (video or image; the first
    video by suffix is used, else the first file); ``duration_s`` is the expected length in
    seconds (None: a video's own length is taken); ``reason`` is the job's error if any.
    """

    shot: int
    job_id: str
    state: str
    files: list[Path] = field(default_factory=list)
    duration_s: float | None = None
    optional: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class Policy:
    """``mode`` "delivery" (every problem blocks) or "draft" (problems become slates);
    ``duration_tolerance`` is the allowed |probed - expected| as a fraction of the expected
    duration (never less than one frame)."""

    mode: Literal["delivery", "draft"] = "delivery"
    duration_tolerance: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in ("delivery", "draft"):
            raise ValueError(f"policy mode must be 'delivery' or 'draft', got {self.mode!r}")
        if self.duration_tolerance < 0:
            raise ValueError(f"duration_tolerance must be >= 0, got {self.duration_tolerance}")


@dataclass(frozen=True)
class ShotVerdict:
    """The gate's word on one shot.

    ``verdict``: "ok" (used as rendered), "degraded" (accepted only under draft) or "blocked".
    ``placeholder``: the film shows a slate instead of the shot's media. ``duration_s``: the
    seconds the shot will last in the film (None when blocked). ``file``/``media``: the output
    chosen and its probe, when it probed cleanly.
    """

    shot: int
    job_id: str
    verdict: Verdict
    reason: str
    placeholder: bool = False
    duration_s: float | None = None
    file: Path | None = None
    media: MediaInfo | None = None

    def line(self) -> str:
        """``shot 3 (job <id>): blocked: failed_fatal: IndexError ...``"""
        return f"shot {self.shot} (job {self.job_id}): {self.verdict}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values for metadata (no MediaInfo)."""
        return {
            "shot": self.shot,
            "job_id": self.job_id,
            "verdict": self.verdict,
            "reason": self.reason,
            "placeholder": self.placeholder,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
            "file": None if self.file is None else str(self.file),
        }


@dataclass(frozen=True)
class GateResult:
    """Every shot's verdict in shot order. ``passed``: no shot blocked (and there are shots);
    ``draft``: the film relies on the draft policy (some shot is degraded)."""

    passed: bool
    draft: bool
    mode: str
    verdicts: list[ShotVerdict]

    @property
    def blocked(self) -> list[int]:
        """Shot numbers that block the film."""
        return [v.shot for v in self.verdicts if v.verdict == "blocked"]

    @property
    def degraded(self) -> list[int]:
        """Shot numbers accepted only under draft."""
        return [v.shot for v in self.verdicts if v.verdict == "degraded"]

    @property
    def placeholders(self) -> list[int]:
        """Shot numbers the film shows as slates."""
        return [v.shot for v in self.verdicts if v.placeholder]

    def describe(self) -> str:
        """A summary line, then one line per shot that is missing or bad, with its reason."""
        if not self.verdicts:
            return f"gate blocked ({self.mode}): no shots"
        bad = [v for v in self.verdicts if v.verdict != "ok"]
        if not self.passed:
            # Shots that only degrade (a slate under draft) are listed after the ones
            # that block, under their own heading.
            blocking = [v for v in bad if v.verdict == "blocked"]
            others = [v for v in bad if v.verdict != "blocked"]
            head = (
                f"gate blocked ({self.mode}): {len(blocking)} of {len(self.verdicts)} "
                "shots block the film"
            )
            lines = [head, *(v.line() for v in blocking)]
            if others:
                lines += ["degraded, not blocking:", *(v.line() for v in others)]
            return "\n".join(lines)
        if self.draft:
            head = f"gate passed as draft: {len(bad)} of {len(self.verdicts)} shots degraded"
        else:
            head = f"gate passed ({self.mode}): all {len(self.verdicts)} shots ok"
        return "\n".join([head, *(v.line() for v in bad)])

    def to_dict(self) -> dict[str, Any]:
        """Plain values for Dagster metadata."""
        return {
            "passed": self.passed,
            "draft": self.draft,
            "mode": self.mode,
            "shots": len(self.verdicts),
            "blocked": self.blocked,
            "degraded": self.degraded,
            "placeholders": self.placeholders,
            "verdicts": [v.to_dict() for v in self.verdicts],
        }


class GateBlocked(Exception):
    """The gate refused the film; ``result`` says which shots and why (str: describe())."""

    def __init__(self, result: GateResult) -> None:
        super().__init__(result.describe())
        self.result = result


@dataclass(frozen=True)
class FilmResult:
    """A written film: ``concat`` the joined file (its ``path``, ``duration_s`` probed from
    it in seconds, ``mode`` "copy" or "reencode", ``clips`` the shot count), ``gate`` the
    verdicts it was cut from (``degraded`` and ``placeholders`` shot numbers, ``draft`` True
    when any shot was degraded: the MP4's ``comment`` tag then starts with "DRAFT"), and
    its ``contact_sheet`` (a PNG)."""

    concat: ConcatInfo
    contact_sheet: Path
    gate: GateResult

    def to_dict(self) -> dict[str, Any]:
        """Plain values for Dagster metadata."""
        return {
            "path": str(self.concat.path),
            "duration_s": round(self.concat.duration_s, 3),
            "shot_count": self.concat.clips,
            "degraded": self.gate.degraded,
            "placeholders": self.gate.placeholders,
            "draft": self.gate.draft,
            "concat_mode": self.concat.mode,
            "concat_reason": self.concat.reason,
            "contact_sheet": str(self.contact_sheet),
            "gate": self.gate.to_dict(),
        }


# ---------------------------------------------------------------- gate


def gate(shots: list[Shot], policy: Policy) -> GateResult:
    """Judge every shot, in ``shot`` order, without writing anything (files are probed).

    A shot is ok when it succeeded and its media file exists, decodes fully and (a video)
    lasts duration_s within the tolerance; an image is ok when it decodes and has a
    duration_s to be held for. See the module docstring for what draft relaxes. Two shots
    with the same number block both. Returns a GateResult; raises nothing for bad shots.
    """
    counts: dict[int, list[str]] = {}
    for s in shots:
        counts.setdefault(s.shot, []).append(s.job_id)
    verdicts = []
    for s in sorted(shots, key=lambda s: s.shot):
        if len(counts[s.shot]) > 1:
            verdicts.append(_blocked(s, f"shot number used by jobs {', '.join(counts[s.shot])}"))
        else:
            verdicts.append(_judge(s, policy))
    passed = bool(verdicts) and all(v.verdict != "blocked" for v in verdicts)
    draft = any(v.verdict == "degraded" for v in verdicts)
    return GateResult(passed=passed, draft=draft, mode=policy.mode, verdicts=verdicts)


def _judge(s: Shot, policy: Policy) -> ShotVerdict:
    draft = policy.mode == "draft"
    if s.state not in KNOWN_STATES:
        return _blocked(s, f"unknown state {s.state!r}")
    if s.state in UNFINISHED:
        if draft and s.optional:
            return _slate(s, f"optional shot not finished ({s.state})")
        return _blocked(s, f"not finished: {s.state}")
    if s.state == "failed_fatal":
        reason = f"failed_fatal: {s.reason or 'no reason recorded'}"
        return _slate(s, reason) if draft else _blocked(s, reason)
    if s.state == "degraded" and not draft:
        return _blocked(s, f"degraded: {s.reason or 'no reason recorded'}")
    problem, chosen, media = _check_media(s, policy)
    if problem:
        if s.state == "degraded":
            problem = f"degraded ({s.reason or 'no reason recorded'}) and {problem}"
        return _slate(s, problem, chosen) if draft else _blocked(s, problem, chosen)
    assert media is not None
    held = media.duration_s if media.kind == "video" else s.duration_s
    if s.state == "degraded":
        return ShotVerdict(
            s.shot,
            s.job_id,
            "degraded",
            f"degraded: {s.reason or 'no reason recorded'}; its render is used",
            duration_s=held,
            file=chosen,
            media=media,
        )
    return ShotVerdict(s.shot, s.job_id, "ok", "ok", duration_s=held, file=chosen, media=media)


def _check_media(s: Shot, policy: Policy) -> tuple[str, Path | None, MediaInfo | None]:
    """(problem or "", the file chosen, its probe) for a finished shot."""
    if s.duration_s is not None and s.duration_s <= 0:
        return f"invalid duration_s {s.duration_s}", None, None
    chosen = pick_file(s.files)
    if chosen is None:
        return "no output file", None, None
    if not chosen.exists():
        return f"output file missing: {chosen}", chosen, None
    try:
        media = probe(chosen)
    except MediaError as e:
        return f"bad media: {e}", chosen, None
    if media.kind == "image":
        if s.duration_s is None:
            return "image shot has no duration_s to be held for", chosen, media
        return "", chosen, media
    assert media.duration_s is not None and media.fps is not None
    if s.duration_s is not None:
        allowed = max(policy.duration_tolerance * s.duration_s, 1 / media.fps)
        if abs(media.duration_s - s.duration_s) > allowed:
            return (
                f"duration {media.duration_s:.3f} s, expected {s.duration_s:.3f} s "
                f"± {allowed:.3f} s",
                chosen,
                media,
            )
    return "", chosen, media


def pick_file(files: list[Path]) -> Path | None:
    """The output of a shot the gate reads: the first video by suffix, else the first
    file; None for none."""
    paths = [Path(f) for f in files]
    videos = [p for p in paths if p.suffix.lower() in VIDEO_SUFFIXES]
    if videos:
        return videos[0]
    return paths[0] if paths else None


def _blocked(s: Shot, reason: str, file: Path | None = None) -> ShotVerdict:
    return ShotVerdict(s.shot, s.job_id, "blocked", reason, file=file)


def _slate(s: Shot, reason: str, file: Path | None = None) -> ShotVerdict:
    return ShotVerdict(
        s.shot,
        s.job_id,
        "degraded",
        f"{reason}; placeholder slate {_hold_s(s):g} s",
        placeholder=True,
        duration_s=_hold_s(s),
        file=file,
    )


def _hold_s(s: Shot) -> float:
    return s.duration_s if s.duration_s is not None and s.duration_s > 0 else DEFAULT_HOLD_S


# ---------------------------------------------------------------- film


def build_film(
    shots: list[Shot],
    policy: Policy,
    out: Path,
    *,
    work_dir: Path,
    width: int | None = None,
    height: int | None = None,
    fps: float | Fraction | None = None,
) -> FilmResult:
    """Gate the shots, then write the film to ``out`` (MP4) and ``<out stem>.contact.png``.

    Videos are used as rendered, images become stills of duration_s, placeholders become
    slates of duration_s (2 s if unknown); stills and slates go to ``work_dir``. The film's
    size and fps are width/height/fps if given, else the first usable video's, else the
    first image's (rounded down to even), else 1280x720 at 24 fps.

    Raises GateBlocked (nothing written under ``out``) when the gate blocks, MediaError
    when writing or concatenating fails (``out`` is then not written either).
    """
    result = gate(shots, policy)
    if not result.passed:
        raise GateBlocked(result)
    out = Path(out)
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    film_width, film_height, rate = _film_format(result.verdicts, width, height, fps)
    clips = []
    for v in result.verdicts:
        assert v.duration_s is not None  # every shot that passed has a length
        still: Path | Image.Image
        if v.placeholder:
            lines = [f"SHOT {v.shot} MISSING", v.reason[:_SLATE_REASON_CHARS], f"job {v.job_id}"]
            still = slate(lines, film_width, film_height)
            clip = work_dir / f"shot{v.shot:04d}-slate.mp4"
        elif v.media is not None and v.media.kind == "image":
            assert v.file is not None
            still = v.file
            clip = work_dir / f"shot{v.shot:04d}-still.mp4"
        else:
            assert v.file is not None
            clips.append(v.file)
            continue
        still_clip(still, v.duration_s, clip, width=film_width, height=film_height, fps=rate)
        clips.append(clip)
    metadata = {"comment": _comment(result)}
    names = [f"shot {v.shot}" for v in result.verdicts]
    joined = concat(
        clips, out, width=film_width, height=film_height, fps=rate, metadata=metadata, names=names
    )
    # Three 160 px tiles a row: 480 px fit the metadata column of Dagster's UI.
    sheet = contact_sheet(
        clips,
        out.with_name(f"{out.stem}.contact.png"),
        columns=3,
        labels=names,
    )
    return FilmResult(joined, sheet.path, result)


def _film_format(
    verdicts: list[ShotVerdict],
    width: int | None,
    height: int | None,
    fps: float | Fraction | None,
) -> tuple[int, int, Fraction | float]:
    """(width, height, fps) of the film: given values first, then the shots' media."""
    used = [v.media for v in verdicts if v.media is not None and not v.placeholder]
    videos = [m for m in used if m.kind == "video"]
    source = videos[0] if videos else (used[0] if used else None)
    size = (source.width, source.height) if source is not None else DEFAULT_SIZE
    rate: Fraction | float = videos[0].rate if videos and videos[0].rate else DEFAULT_FPS
    w = width if width is not None else max(2, size[0] - size[0] % 2)
    h = height if height is not None else max(2, size[1] - size[1] % 2)
    return w, h, fps if fps is not None else rate


def _comment(result: GateResult) -> str:
    if not result.draft:
        return f"{len(result.verdicts)} shots"
    parts = [
        f"{v.shot} ({'slate' if v.placeholder else 'degraded'})"
        for v in result.verdicts
        if v.verdict == "degraded"
    ]
    return "DRAFT: shots " + ", ".join(parts)
