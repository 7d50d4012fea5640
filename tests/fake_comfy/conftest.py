"""The fake ComfyUI tests' fake: one in process, each node a millisecond."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_comfy import FakeComfy
from tests.fake_comfy.recordings import NODE_S


@pytest.fixture
def fake(tmp_path: Path) -> FakeComfy:
    """A fake whose nodes take ``NODE_S`` and whose outputs go below ``tmp_path``."""
    return FakeComfy(prompt_seconds=NODE_S, output_dir=tmp_path / "out")
