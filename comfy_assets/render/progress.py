"""How far a batch has come (``Progress``): what a progress bar, a Dagster observation or a
log line shows while jobs render. The batch calls its ``on_progress`` each time a job
ends, one way or another, and ``render/steering.py`` every few seconds with the time
left (``render/eta.py``), why the jobs left wait and how far the running ones are."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from comfy_assets.render.eta import format_left

# How the batch resolved a job: "degraded" counts as done (the draft policy accepted it).
Ended = Literal["done", "degraded", "dead_lettered", "not_run"]


@dataclass(frozen=True)
class Progress:
    """``total`` jobs of the batch; ``done`` (succeeded, degraded, or done before),
    ``dead_lettered`` (now or before), ``not_run`` (left for another run: stopped, or
    its claim went to another worker); ``elapsed_s`` since the batch began (seconds).
    ``estimate_s``: seconds left by the estimate (``render/eta.py``; None: none yet);
    ``waiting``: the jobs left by what they wait for, as ``(reason, count)`` in the
    vocabulary of ``render/steering.py``; ``running``: a line per running prompt
    (``job 1a2b3c4d on gpu0: node 3/7 KSampler, step 14/20``)."""

    total: int
    done: int = 0
    dead_lettered: int = 0
    not_run: int = 0
    elapsed_s: float = 0.0
    estimate_s: float | None = None
    waiting: tuple[tuple[str, int], ...] = ()
    running: tuple[str, ...] = ()

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
        """``12/40 done, 1 dead-lettered, 28 left, about 14 s to go`` (for logs; the
        estimate once there is one)."""
        text = f"{self.done}/{self.total} done"
        if self.dead_lettered:
            text += f", {self.dead_lettered} dead-lettered"
        if self.not_run:
            text += f", {self.not_run} not run"
        text += f", {self.remaining} left"
        if self.estimate_s is not None and self.remaining:
            text += ", " + format_left(self.estimate_s)
        return text

    def waiting_line(self) -> str | None:
        """``8 left: 5 waiting for a server, 2 for their upstream shot, 1 in backoff``
        (None when nothing is known of the jobs left)."""
        if not self.waiting or not self.remaining:
            return None
        return f"{self.remaining} left: " + ", ".join(f"{n} {why}" for why, n in self.waiting)

    def lines(self) -> list[str]:
        """``line``, then ``waiting_line`` and the running prompts, when known."""
        waiting = self.waiting_line()
        return [self.line(), *([waiting] if waiting else []), *self.running]


def log_every(
    log: Callable[[str], None],
    seconds: float,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[Progress], None]:
    """An ``on_progress`` that gives ``log`` the lines ``12/20 done, ...`` (``lines``, one
    call each) for the first job to end, then at most once every ``seconds`` of ``clock``, and always
    for the last."""
    last = [-math.inf]

    def on_progress(progress: Progress) -> None:
        now = clock()
        if progress.remaining == 0 or now - last[0] >= seconds:
            last[0] = now
            for line in progress.lines():
                log(line)

    return on_progress
