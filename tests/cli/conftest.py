"""The command tests' fake: one served in a thread, each node 5 ms."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fake_comfy import FakeComfy


@pytest.fixture
def fake() -> FakeComfy:
    """A fake ComfyUI whose nodes take 5 ms."""
    return FakeComfy(prompt_seconds=0.005)


@pytest.fixture
def url(fake: FakeComfy) -> Iterator[str]:
    """The base URL of ``fake``, served in a thread of this process."""
    with fake.serve_in_thread(port=0) as served:
        yield served
