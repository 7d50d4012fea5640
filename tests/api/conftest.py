"""What the API tests share: a fresh RabbitMQ queue a test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.api_support import fresh_queue


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    """A fresh queue name; the queue and its ``.dead`` are deleted at the end."""
    async with fresh_queue() as name:
        yield name
