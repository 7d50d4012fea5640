"""When a batch will be done: an estimate from the measured seconds of its prompts.

Each prompt of ours that leaves a server is measured (seconds from its POST's answer to
its end: ``Pool.prompt_listeners``), by *workflow*: the group of jobs with the same
``Needs``, i.e. the same node classes and model files (``comfy/capabilities.py``); a
prompt whose server loaded a model for it is kept apart, and what a load adds comes
from the pool's plan (``pool/plan.py``). The time left is::

    work = sum over waiting jobs of their workflow's mean seconds (without a load)
         + a load for each waiting workflow no server holds
         + sum over running prompts of what their mean has left of it
    left = work / servers

where ``servers`` is how many prompts of this batch ran at once over the last
``WINDOW_S`` seconds since its first POST (its share of the servers it can use: a batch
sharing them with another gets about half), never more than the servers it can use now.
A workflow not measured yet counts at the mean of those that are (a workflow measured
only with loads, at those less a load); before any prompt is measured there is no
estimate.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

WINDOW_S = 120.0  # seconds of the recent past the batch's share of servers is taken from
SAMPLES = 64  # prompts kept per workflow


def format_left(seconds: float) -> str:
    """``about 14 s to go``, ``about 3 min to go``, ``about 2 h 5 min to go`` (seconds
    rounded to the unit shown; at least 1 s)."""
    if seconds < 59.5:
        return f"about {max(round(seconds), 1)} s to go"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min to go"
    hours, minutes = divmod(minutes, 60)
    return f"about {hours} h {minutes} min to go"


@dataclass(frozen=True)
class Running:
    """A prompt of the batch on a server now: its workflow and seconds since its POST."""

    workflow: Hashable
    elapsed_s: float


class Estimator:
    """Measured prompt seconds per workflow and the batch's recent parallelism.

    ``clock``: monotonic seconds (``time.monotonic``; tests give their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started: float | None = None  # the first POST's answer (clock time)
        self._seconds: dict[Hashable, deque[float]] = {}
        self._loading: dict[Hashable, deque[float]] = {}
        self._ended: deque[tuple[float, float]] = deque()  # (end time, seconds), recent
        self._busy = 0.0  # their seconds summed

    def prompt_ended(
        self, workflow: Hashable, seconds: float, loaded: bool = False, load_s: float = 0.0
    ) -> None:
        """One prompt of ``workflow`` took ``seconds`` (POST answered to its end);
        ``loaded``: its server loaded a model for it, which takes about ``load_s``."""
        if not seconds >= 0:  # NaN or negative: a clock problem, not a measure
            return
        kept = self._loading if loaded else self._seconds
        # Before any prompt without a load, the plan counts a loading prompt whole as
        # its load: nothing would be left of it.
        plain = seconds - load_s if loaded and 0 < load_s < seconds else seconds
        kept.setdefault(workflow, deque(maxlen=SAMPLES)).append(plain)
        now = self.clock()
        self.saw_running(seconds)
        self._ended.append((now, seconds))
        self._busy += seconds
        self._drop_old(now)

    def _drop_old(self, now: float) -> None:
        while self._ended and self._ended[0][0] < now - WINDOW_S:
            self._busy -= self._ended.popleft()[1]

    def saw_running(self, elapsed_s: float) -> None:
        """A prompt of the batch has run for ``elapsed_s`` seconds now."""
        posted = self.clock() - elapsed_s
        if self.started is None or posted < self.started:
            self.started = posted

    def mean_s(self, workflow: Hashable) -> float | None:
        """Mean seconds of ``workflow``'s prompts without a load; of all measured ones
        when it has none (those with a load, less the load, last); None before the
        first."""
        for kept in (self._seconds, self._loading):
            own = kept.get(workflow)
            if own:
                return sum(own) / len(own)
        for kept in (self._seconds, self._loading):
            every = [s for q in kept.values() for s in q]
            if every:
                return sum(every) / len(every)
        return None

    def parallel(self, running: Iterable[Running], usable: int) -> float:
        """How many prompts of the batch ran at once over the last ``WINDOW_S`` seconds
        (busy seconds in the window over its length), between 1 and ``usable``."""
        now = self.clock()
        if self.started is None:
            return float(max(usable, 1))
        start = max(now - WINDOW_S, self.started)
        span = now - start
        if span <= 0:
            return float(max(usable, 1))
        self._drop_old(now)
        # Prompts that ended in the window, counted whole: one that began before it
        # adds at most a prompt's seconds to a window of minutes.
        busy = min(self._busy, span * max(usable, 1))
        busy += sum(min(r.elapsed_s, span) for r in running)
        measured = busy / span
        return float(min(max(measured, 1.0), max(usable, 1)))

    def left_s(
        self,
        waiting: Mapping[Hashable, int],
        running: Iterable[Running],
        usable: int,
        loads: int = 0,
        load_s: float = 0.0,
    ) -> float | None:
        """Seconds until the batch's last job ends; None before any prompt is measured
        (or with nothing measured to go by). ``waiting``: jobs not running, by workflow;
        ``running``: prompts on a server now; ``usable``: servers the batch can use;
        ``loads``: model loads still to come, ``load_s`` seconds each."""
        running = list(running)
        for r in running:
            self.saw_running(r.elapsed_s)
        work = loads * load_s
        for workflow, count in waiting.items():
            mean = self.mean_s(workflow)
            if mean is None:
                return None
            work += mean * count
        for r in running:
            mean = self.mean_s(r.workflow)
            if mean is None:
                return None
            work += max(mean - r.elapsed_s, 0.0)
        return work / self.parallel(running, usable)
