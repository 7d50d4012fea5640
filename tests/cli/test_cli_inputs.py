"""Hostile input files through ``comfy-assets run`` as a user runs it: every one refused
at validation on its own line (file:line:field), exit 2, nothing posted to the server;
a link out of the job file's folder is rendered only with ``--follow-input-links``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from comfy_assets.store import Store
from fake_comfy import FakeComfy
from tests.render.test_inputs_render import output_of, picture, pixels_of
from tests.support import ROOT, WORKFLOWS, job_id
from tests.upload_support import inverted_as_comfyui_saves

MAX_INPUT_BYTES = 1000


@pytest.fixture
def url() -> Iterator[str]:
    with FakeComfy(prompt_seconds=0.005).serve_in_thread(port=0) as served:
        yield served


def posts(url: str) -> int:
    """How many prompts the server at ``url`` took, from its GET /fake/stats."""
    stats = httpx.get(f"{url}/fake/stats").raise_for_status().json()
    return sum(p["posted"] for p in stats["prompts"].values())


def run(jobs: Path, url: str, store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "comfy_assets.cli", "run", "--jobs", str(jobs)]
    argv += ["--server", f"gpu0={url}", "--store", str(store), "--poll-s", "0.05", *extra]
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def line(n: int, inputs: dict) -> dict:
    return {"id": job_id(n, "cli-inputs"), "workflow": "invert_picture.json", "inputs": inputs}


def job_file(folder: Path, *lines: dict) -> Path:
    (folder / "invert_picture.json").write_text((WORKFLOWS / "invert_picture.json").read_text())
    path = folder / "jobs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """``jobs/`` with a small picture ``ok.png``, a large ``big.png``, ``bell\\x07.png``
    and ``plate.png``, a link to ``outside/plate.png``; ``outside/`` beside it."""
    jobs, outside = tmp_path / "jobs", tmp_path / "outside"
    picture(jobs / "ok.png", 1, (4, 4))
    picture(jobs / "big.png", 2, (32, 32))
    picture(jobs / "bell\x07.png", 3, (4, 4))
    picture(outside / "plate.png", 4, (4, 4))
    (jobs / "plate.png").symlink_to(outside / "plate.png")
    assert (jobs / "ok.png").stat().st_size <= MAX_INPUT_BYTES < (jobs / "big.png").stat().st_size
    return jobs, outside


def test_every_hostile_input_is_an_error_of_its_line_and_nothing_is_posted(
    folders: tuple[Path, Path], url: str, tmp_path: Path
) -> None:
    jobs, outside = folders
    path = job_file(
        jobs,
        line(1, {"1.image": "ok.png"}),
        line(2, {"1.image": str(outside / "plate.png")}),
        line(3, {"1.image": "plate.png"}),
        line(4, {"1.image": "gone.png"}),
        line(5, {"1.image": "big.png"}),
        line(6, {"1.image": "bell\x07.png"}),
        line(7, {"1.image": "../outside/plate.png"}),
        line(8, {"1.image": {"job": job_id(9, "cli-inputs"), "node": "3"}}),
        line(9, {"1.image": {"job": job_id(8, "cli-inputs"), "node": "3"}}),
    )
    store = tmp_path / "store"

    done = run(path, url, store, "--max-input-bytes", str(MAX_INPUT_BYTES))

    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    where = f"{path}:{{}}: inputs.1.image: "
    expected = {
        2: f'"{str(outside)[:20]}',  # long: shortened, then "... is an absolute path"
        3: '"plate.png" is a link that leads out of the job file\'s folder',
        4: f'"gone.png": no such file ({jobs / "gone.png"})',
        5: f'"big.png": over the limit of {MAX_INPUT_BYTES} bytes (--max-input-bytes',
        6: 'the path "bell\\u0007.png" holds a control character (U+0007)',
        7: "\"../outside/plate.png\" has a '..' component",
        8: "a cycle of chained jobs",
        9: "a cycle of chained jobs",
    }
    for n, message in expected.items():
        assert where.format(n) + message in done.stderr, (n, done.stderr)
    said = dict(x.split(": inputs.1.image: ", 1) for x in done.stderr.splitlines())
    assert said[f"error: {path}:2"].endswith(
        " is an absolute path; write it relative to the job file's folder"
    )
    assert said[f"{path}:3"].endswith(
        "refused unless links may be followed "
        "(--follow-input-links, or COMFY_ASSETS_FOLLOW_INPUT_LINKS=1 in Dagster)"
    )
    assert len(said) == 8  # one line each, and none for the good line 1
    assert f"{path}:1:" not in done.stderr  # the good line is not blamed
    assert "\x07" not in done.stderr  # the control character is shown escaped, not rung
    assert posts(url) == 0
    assert not store.exists()


def test_a_link_out_of_the_folder_is_rendered_with_follow_input_links(
    folders: tuple[Path, Path], url: str, tmp_path: Path
) -> None:
    jobs, outside = folders
    path = job_file(jobs, line(1, {"1.image": "plate.png"}))

    refused = run(path, url, tmp_path / "store")
    assert refused.returncode == 2, refused.stderr
    assert f"{path}:1: inputs.1.image: " in refused.stderr
    assert posts(url) == 0

    followed = run(path, url, tmp_path / "store", "--follow-input-links")
    assert followed.returncode == 0, followed.stderr
    assert posts(url) == 1
    store = Store(tmp_path / "store")
    out = pixels_of(output_of(store, "jobs", job_id(1, "cli-inputs")))
    assert np.array_equal(out, inverted_as_comfyui_saves(pixels_of(outside / "plate.png")))
    store.close()
