"""Exponential backoff with full jitter (M. Brooker, "Exponential Backoff And Jitter").

Pure: nothing here sleeps. The caller decides how to wait, so tests need no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# 2**MAX_EXPONENT stays a finite float; any cap a person would choose is far below it.
_MAX_EXPONENT = 512
_RNG = random.Random()


def backoff_delay(
    attempt: int,
    *,
    base_s: float = 2.0,
    cap_s: float = 60.0,
    jitter: bool = True,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry number ``attempt`` (1 = the first retry).

    Without jitter: ``min(cap_s, base_s * 2**(attempt - 1))``. With full jitter: a uniform
    draw from ``[0, that]``, so retries of many jobs do not arrive in lockstep. ``rng``
    makes the draw reproducible. Raises ``ValueError`` for ``attempt < 1`` or a negative
    ``base_s`` / ``cap_s``.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1 (1 = the first retry), got {attempt}")
    if base_s < 0 or cap_s < 0:
        raise ValueError(f"base_s and cap_s must be >= 0, got base_s={base_s}, cap_s={cap_s}")
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt - 1, _MAX_EXPONENT))
    if not jitter:
        return ceiling
    return (rng or _RNG).uniform(0.0, ceiling)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a job is tried.

    ``attempts`` counts every try, the first included (4 = one try and three retries).
    Delays are in seconds; ``timeout_s`` bounds one attempt (seconds).
    """

    attempts: int = 4
    base_delay_s: float = 2.0
    max_delay_s: float = 60.0
    jitter: bool = True
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(
                f"RetryPolicy delays must be >= 0, got base_delay_s={self.base_delay_s}, "
                f"max_delay_s={self.max_delay_s}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"RetryPolicy.timeout_s must be > 0, got {self.timeout_s}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (1 = the first retry); see backoff_delay."""
        return backoff_delay(
            attempt,
            base_s=self.base_delay_s,
            cap_s=self.max_delay_s,
            jitter=self.jitter,
            rng=rng,
        )

    def can_retry(self, attempts_made: int) -> bool:
        """True if another try is allowed after ``attempts_made`` tries (first one included)."""
        return attempts_made < self.attempts
