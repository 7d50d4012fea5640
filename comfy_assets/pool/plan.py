"""The plan beside the pool: which waiting jobs a free server takes, so that a batch loads
models as few times as it can and no server idles while loading would shorten the batch.

ComfyUI keeps the models it used loaded (``comfy.model_management``) and loading another
checkpoint from disk takes seconds to tens of seconds, so a job costs least on a server
that already **holds** its models. Words used here:

- a job's *models*: the model files its workflow loads; jobs with the same ``Needs``
  (node classes and model files, ``capabilities.py``) form a *group*;
- a server *holds* the models of the last prompt of ours that loaded any there (or that
  another process noted in the store: ``last_model`` of its server lease); a server
  started again, or that came back from being unreachable, holds nothing;
- ``prompt_s`` and ``load_s``: the median seconds of a prompt that loaded nothing, and
  what a load added to a prompt (all of a loading prompt's seconds while no other was
  measured), from the prompts of this pool (until measured: ``DEFAULT_PROMPT_S`` and
  ``DEFAULT_LOAD_S``).

What a free server takes (``Plan.choose``), among the groups it can run:

1. once the consumer asking has waited in line longer than a load takes, the oldest job:
   the estimates were wrong, and no job waits for ever for a server holding its model;
2. else the oldest job whose models the server holds (no load);
3. else the largest group no server holds: someone has to load it, and this one is free;
4. else the group where one more server saves the most: with ``h`` servers holding it and
   ``n`` jobs waiting, they finish ``prompt_s * n / h`` from now, and with this server too
   ``load_s + prompt_s * n / (h + 1)``: it switches if that is sooner
   (``prompt_s * n / (h * (h + 1)) > load_s``), else it waits (nothing is posted there),
   since the servers holding the model will be done before a load would be.

Jobs of one model so stay on the servers holding it, in the order they came; servers
change model when their own model's jobs run out and another model's backlog is worth a
load. Every process sharing the servers reads what each holds from the store.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from comfy_assets.comfy.capabilities import Needs

DEFAULT_PROMPT_S = 1.0  # seconds per prompt until one is measured
DEFAULT_LOAD_S = 10.0  # seconds a model load adds, until one is measured
SAMPLES = 64  # prompts kept for each median


def models_of(needs: Needs) -> frozenset[str]:
    """The model files a group loads."""
    return frozenset(file for _, _, file in needs.files)


def held_text(models: Iterable[str]) -> str | None:
    """What a server holds as the store keeps it (``last_model``): a JSON list of file
    names, None for nothing."""
    names = sorted(models)
    return json.dumps(names) if names else None


def parse_held(text: str | None) -> frozenset[str]:
    """``held_text`` read back; an older row holding one bare file name is that file."""
    if not text:
        return frozenset()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError:
            return frozenset({text})
        if isinstance(names, list):
            return frozenset(str(n) for n in names)
    return frozenset({text})


@dataclass(frozen=True)
class Demand:
    """A group's jobs waiting for a server: how many, and the arrival rank of the oldest
    (lower is older)."""

    count: int
    oldest: int


class Estimates:
    """Median prompt seconds without a load, and what a load adds (see the module
    docstring); ``record`` each prompt's seconds on its server."""

    def __init__(self) -> None:
        self._plain: deque[float] = deque(maxlen=SAMPLES)
        self._loading: deque[float] = deque(maxlen=SAMPLES)

    def record(self, seconds: float, loaded: bool) -> None:
        """One prompt took ``seconds`` from its POST's answer to its end; ``loaded``: its
        server was expected to load a model for it."""
        (self._loading if loaded else self._plain).append(seconds)

    @property
    def prompt_s(self) -> float:
        return statistics.median(self._plain) if self._plain else DEFAULT_PROMPT_S

    @property
    def load_s(self) -> float:
        if not self._loading:
            return DEFAULT_LOAD_S
        loading = statistics.median(self._loading)
        if not self._plain:  # no prompt without a load yet: count it all as the load
            return loading
        return max(loading - statistics.median(self._plain), 0.0)


class Plan:
    """What each server holds and can run, and ``choose``: the group a free server takes.

    ``servers``: the pool's server names. ``can_run(server, needs)``: whether a server's
    capabilities (read from its /object_info) cover ``needs``."""

    def __init__(self, servers: Iterable[str], can_run: Callable[[str, Needs], bool]) -> None:
        self.servers = list(servers)
        self.can_run = can_run
        self.held: dict[str, frozenset[str]] = {}
        self.estimates = Estimates()

    def holds(self, server: str) -> frozenset[str]:
        return self.held.get(server, frozenset())

    def oldest(self, server: str, demand: Mapping[Needs, Demand]) -> Needs | None:
        """Without the plan: the group of the oldest job ``server`` can run."""
        runnable = [g for g, d in demand.items() if d.count > 0 and self.can_run(server, g)]
        return min(runnable, key=lambda g: demand[g].oldest) if runnable else None

    def fits(self, server: str, needs: Needs) -> bool:
        """Whether ``server`` holds every model of ``needs`` (nothing to load)."""
        return models_of(needs) <= self.holds(server)

    def choose(
        self, server: str, demand: Mapping[Needs, Demand], waited_s: float = 0.0
    ) -> Needs | None:
        """The group free ``server`` takes a job of now, or None: it waits. ``waited_s``:
        how long the consumer asking has been in line."""
        runnable = [g for g, d in demand.items() if d.count > 0 and self.can_run(server, g)]
        if not runnable:
            return None
        load_s, prompt_s = self.estimates.load_s, self.estimates.prompt_s
        if waited_s >= load_s:
            return min(runnable, key=lambda g: demand[g].oldest)
        fitting = [g for g in runnable if self.fits(server, g)]
        if fitting:
            return min(fitting, key=lambda g: demand[g].oldest)
        best: Needs | None = None
        best_key: tuple[int, float, int] | None = None
        for g in runnable:
            d = demand[g]
            holders = sum(
                1
                for other in self.servers
                if other != server and self.fits(other, g) and self.can_run(other, g)
            )
            if holders == 0:
                key = (1, float(d.count), -d.oldest)
            else:
                gain = prompt_s * d.count / (holders * (holders + 1)) - load_s
                if gain <= 0:
                    continue
                key = (0, gain, -d.oldest)
            if best_key is None or key > best_key:
                best, best_key = g, key
        return best

    def assign(self, server: str, needs: Needs) -> bool:
        """A job of ``needs`` goes to ``server``: True when the server loads a model for
        it (it did not hold them all); it holds them from now on. A job that loads no
        model leaves what the server holds as it was."""
        models = models_of(needs)
        if not models:
            return False
        load = not models <= self.holds(server)
        if load:
            self.held[server] = models
        return load

    def forget(self, server: str) -> None:
        """``server`` holds nothing (it started again)."""
        self.held.pop(server, None)
