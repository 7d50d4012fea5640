"""Requests per client: a token bucket each, so one client's burst never takes the
API from the others (429 with ``Retry-After`` once its bucket is empty)."""

from __future__ import annotations

import math
import time


class RateLimit:
    """``rate_per_s`` requests a second per client, ``burst`` at once."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def take(self, client: str, now: float | None = None) -> float:
        """Take one request of ``client``'s: 0.0 when allowed, else the seconds until
        the next one is."""
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1.0 - tokens) / self.rate_per_s

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """A ``Retry-After`` value: whole seconds, at least 1."""
        return str(max(1, math.ceil(wait_s)))
