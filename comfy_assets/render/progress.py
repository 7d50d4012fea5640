"""How far a batch has come (``Progress``): what a progress bar, a Dagster observation or a
log line shows while jobs render. The batch calls its ``on_progress`` each time a job
ends, one way or another."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Ended = Literal["done", "dead_lettered", "not_run"]


@dataclass(frozen=True)
class Progress:
    """``total`` jobs of the batch; ``done`` (succeeded, degraded, or done before),
    ``dead_lettered`` (now or before), ``not_run`` (left for another run: stopped, or
    its claim went to another worker); ``elapsed_s`` since the batch began (seconds)."""

    total: int
    done: int = 0
    dead_lettered: int = 0
    not_run: int = 0
    elapsed_s: float = 0.0

    @property
    def ended(self) -> int:
        return self.done + self.dead_lettered + self.not_run

    @property
    def remaining(self) -> int:
        return self.total - self.ended

    @property
    def jobs_per_s(self) -> float | None:
        """Jobs ended per second so far; None before the first."""
        return self.ended / self.elapsed_s if self.ended and self.elapsed_s > 0 else None

    @property
    def left_s(self) -> float | None:
        """Seconds until the last job ends at the rate so far; None before the first."""
        rate = self.jobs_per_s
        return self.remaining / rate if rate else None

    def line(self) -> str:
        """``12/20 done, 1 dead-lettered, 7 left`` (for logs)."""
        text = f"{self.done}/{self.total} done"
        if self.dead_lettered:
            text += f", {self.dead_lettered} dead-lettered"
        if self.not_run:
            text += f", {self.not_run} not run"
        return f"{text}, {self.remaining} left"


def log_every(
    log: Callable[[str], None],
    seconds: float,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[Progress], None]:
    """An ``on_progress`` that gives ``log`` the line ``12/20 done, ...`` for the first
    job to end, then at most once every ``seconds`` of ``clock``, and always for the last."""
    last = [-math.inf]

    def on_progress(progress: Progress) -> None:
        now = clock()
        if progress.remaining == 0 or now - last[0] >= seconds:
            last[0] = now
            log(progress.line())

    return on_progress
