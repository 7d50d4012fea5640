"""``comfy-assets film``: a storyboard rendered into the store, cut into a film, exit codes."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from comfy_assets.cli.film import add_film_parser
from comfy_assets.comfy.servers import ServerSpec
from comfy_assets.film.probe import probe
from comfy_assets.jobs.model import JobFile
from comfy_assets.jobs.parse import load_job_file
from comfy_assets.render.run import run_batch_sync
from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.support import fast_config, write_jobs

REPO = Path(__file__).resolve().parents[2]
FILM_S = 7.75  # 1.0 + 1.5 + 2.0 + 1.0 + 1.25 + 1.0


def film(*argv: str) -> int:
    """Parse and run ``comfy-assets film ARGV`` as cli.main would (not yet in COMMANDS)."""
    parser = argparse.ArgumentParser(prog="comfy-assets")
    add_film_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["film", *argv])
    return int(args.func(args))


def render(job_file: JobFile, store_dir: Path, script: list[str]) -> None:
    """Render as ``comfy-assets run`` would: partition = file stem, one fake server."""
    fake = FakeComfy(script=script, prompt_seconds=0.005)
    with fake.serve_in_thread(port=0) as url, Store(store_dir) as store:
        run_batch_sync(
            job_file,
            partition=job_file.path.stem,
            servers=[ServerSpec("gpu0", url)],
            store=store,
            config=fast_config(),
        )


def test_a_rendered_storyboard_prints_the_film_path_and_a_summary(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    render(load_job_file(storyboard), tmp_path / "store", [])

    code = film("--jobs", str(storyboard), "--store", str(tmp_path / "store"))

    assert code == 0
    path_line, summary = capsys.readouterr().out.splitlines()
    assert Path(path_line) == tmp_path / "store" / "storyboard" / "film.mp4"
    assert probe(Path(path_line)).duration_s == pytest.approx(FILM_S, abs=1 / 24)
    assert summary == "film: 6 shots, 7.750 s, delivery, concat reencode"
    assert (tmp_path / "store" / "storyboard" / "film.contact.png").is_file()


def test_out_puts_the_film_elsewhere(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    render(load_job_file(storyboard), tmp_path / "store", [])
    out = tmp_path / "cuts" / "reel.mp4"

    code = film("--jobs", str(storyboard), "--store", str(tmp_path / "store"), "--out", str(out))

    assert code == 0
    assert capsys.readouterr().out.splitlines()[0] == str(out)
    assert probe(out).duration_s == pytest.approx(FILM_S, abs=1 / 24)
    assert (tmp_path / "cuts" / "reel.contact.png").is_file()
    assert not (tmp_path / "store" / "storyboard" / "film.mp4").exists()


def test_out_over_a_rendered_shot_is_refused_and_the_shot_kept(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = load_job_file(storyboard)
    render(job_file, tmp_path / "store", [])
    with Store(tmp_path / "store") as store:
        first = job_file.jobs[0].id
        (shot,) = [store.job_dir("storyboard", first) / f.path for f in store.files(first)]
    before = shot.read_bytes()

    code = film("--jobs", str(storyboard), "--store", str(tmp_path / "store"), "--out", str(shot))

    assert code == 2
    assert f"is inside the folder of job {first}" in capsys.readouterr().err
    assert shot.read_bytes() == before


def test_a_blocked_gate_exits_1_listing_each_bad_shot_and_writes_nothing(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = load_job_file(storyboard)
    render(job_file, tmp_path / "store", ["ok"] * 5 + ["error"])
    with Store(tmp_path / "store") as store:
        (shot2,) = [
            store.job_dir("storyboard", job_file.jobs[1].id) / f.path
            for f in store.files(job_file.jobs[1].id)
        ]
    shot2.write_bytes(shot2.read_bytes()[:2000])

    code = film("--jobs", str(storyboard), "--store", str(tmp_path / "store"))

    assert code == 1
    head, *lines = capsys.readouterr().out.splitlines()
    assert head == "gate blocked (delivery): 2 of 6 shots block the film"
    assert len(lines) == 2
    assert lines[0].startswith(f"  shot 2 (job {job_file.jobs[1].id}): blocked: bad media:")
    assert "truncated" in lines[0]
    assert lines[1].startswith(f"  shot 6 (job {job_file.jobs[5].id}): blocked: failed_fatal:")
    assert "IndexError" in lines[1]
    folder = tmp_path / "store" / "storyboard"
    assert not (folder / "film.mp4").exists()
    assert not list(folder.glob(".film-work-*"))


def test_policy_draft_cuts_a_draft_with_a_slate_for_the_failed_shot(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    render(load_job_file(storyboard), tmp_path / "store", ["ok"] * 5 + ["error"])

    code = film("--jobs", str(storyboard), "--store", str(tmp_path / "store"), "--policy", "draft")

    assert code == 0
    path_line, summary = capsys.readouterr().out.splitlines()
    assert summary == (
        "film: 6 shots, 7.750 s, DRAFT (degraded shots 6; slates for shots 6), concat reencode"
    )
    assert probe(Path(path_line)).duration_s == pytest.approx(FILM_S, abs=1 / 24)


def test_bad_input_exits_2_with_a_reason(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = tmp_path / "store"
    render(load_job_file(storyboard), store_dir, [])
    invalid = tmp_path / "jobs" / "invalid.jsonl"
    invalid.write_text('{"id": "not-a-uuid", "workflow": "x.json"}\n')
    stills = write_jobs(tmp_path / "stills", 2)

    cases = {
        "cannot read": ["--jobs", str(tmp_path / "missing.jsonl"), "--store", str(store_dir)],
        "invalid.jsonl:1": ["--jobs", str(invalid), "--store", str(store_dir)],
        "no job has a shot number": ["--jobs", str(stills), "--store", str(store_dir)],
        "no result store": ["--jobs", str(storyboard), "--store", str(tmp_path / "nowhere")],
        "holds none of the jobs": [
            "--jobs", str(storyboard), "--store", str(store_dir), "--partition", "other",
        ],
        f"--out {store_dir} is a folder: give the film's file name, such as "
        f"{store_dir / 'film.mp4'}": [
            "--jobs", str(storyboard), "--store", str(store_dir), "--out", str(store_dir),
        ],
        f"--out {tmp_path}/out/reel.txt: the film is an MP4 file: give a name ending in "
        f".mp4, such as {tmp_path}/out/reel.mp4": [
            "--jobs", str(storyboard), "--store", str(store_dir),
            "--out", str(tmp_path / "out" / "reel.txt"),
        ],
        f"--out {storyboard}/reel.mp4: its folder can't be made (File exists)": [
            "--jobs", str(storyboard), "--store", str(store_dir),
            "--out", str(storyboard / "reel.mp4"),
        ],
    }  # fmt: skip
    for expected, argv in cases.items():
        assert film(*argv) == 2, expected
        captured = capsys.readouterr()
        assert expected in captured.err
        assert captured.out == ""
    assert not (tmp_path / "nowhere").exists()  # a mistyped store is not created
    assert not (tmp_path / "out").exists()  # nor the folder of a refused --out
    assert not list(store_dir.rglob("film.mp4"))

    with pytest.raises(SystemExit) as exit_info:
        film("--jobs", str(storyboard), "--store", str(store_dir), "--policy", "final")
    assert exit_info.value.code == 2


def test_a_film_that_cannot_be_written_is_one_line_and_exit_1(
    storyboard: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = tmp_path / "store"
    render(load_job_file(storyboard), store_dir, [])
    cuts = tmp_path / "cuts"
    cuts.mkdir()
    # A read-only mount: the tests run as root, whom file modes do not stop.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(cuts)], check=True)
    try:
        code = film(
            "--jobs", str(storyboard), "--store", str(store_dir), "--out", str(cuts / "r.mp4")
        )
    finally:
        subprocess.run(["umount", str(cuts)], check=True)
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [captured.err.splitlines()[0]] and captured.err.startswith(
        "error: the film was not written: "
    )
    assert "Read-only file system" in captured.err
    assert not list(cuts.iterdir())
