"""What the film tests share: the sample storyboard beside its workflow."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def storyboard(tmp_path: Path) -> Path:
    """A copy of the sample storyboard (six video shots) in ``tmp_path/jobs``, beside
    ``tmp_path/workflows/video_shot.json``; returns its path."""
    (tmp_path / "workflows").mkdir()
    shutil.copy(REPO / "data/workflows/video_shot.json", tmp_path / "workflows")
    (tmp_path / "jobs").mkdir()
    return Path(shutil.copy(REPO / "data/jobs/storyboard.jsonl", tmp_path / "jobs"))
