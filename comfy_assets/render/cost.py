"""What a batch cost in GPU time, what three retry strategies are expected to cost, and
what its model loads took.

Pure arithmetic on attempt records, so the numbers can go straight into Dagster metadata.
"""

from __future__ import annotations

import statistics
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

OUTCOMES = ("success", "transient", "permanent")


@dataclass(frozen=True)
class AttemptCost:
    """One attempt of one job: ``seconds`` of GPU time it took, and how it ended."""

    job_id: str
    seconds: float
    outcome: Literal["success", "transient", "permanent"]


def cost_report(attempts: list[AttemptCost], shots: int) -> dict[str, float | int | None]:
    """GPU time spent by ``attempts`` and the expected time of three strategies for ``shots``.

    Observed, over all attempts (seconds rounded to 0.1):
      gpu_seconds = successful + wasted (transient and permanent failures);
      failure_rate p = failed attempts / attempts (rounded to 0.0001; ratios to 0.001);
      mean_shot_s t = mean seconds of a successful attempt (of any attempt if none succeeded).

    Expected total seconds for n = ``shots``, taking every attempt to cost t and to fail
    independently with probability p (a permanent failure counts like any other: the model
    does not know it will fail again):
      skip_failures      = n * t               (render once, accept about n * p holes)
      rerun_whole_batch  = n * t / (1 - p)^n   (a batch is clean with probability (1 - p)^n,
                                                so 1 / (1 - p)^n batches are expected)
      tiered_retry       = n * t / (1 - p)     (each shot needs 1 / (1 - p) attempts)
    A strategy that never finishes (p == 1) is None.

    Returns a flat dict of plain numbers. Raises ValueError for no attempts, shots < 1, a
    negative duration or an unknown outcome.
    """
    if not attempts:
        raise ValueError("cost_report needs at least one attempt")
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    for a in attempts:
        if a.outcome not in OUTCOMES:
            raise ValueError(f"job {a.job_id}: unknown outcome {a.outcome!r}")
        if a.seconds < 0:
            raise ValueError(f"job {a.job_id}: negative seconds {a.seconds}")
    successes = [a.seconds for a in attempts if a.outcome == "success"]
    success_s = sum(successes)
    total_s = sum(a.seconds for a in attempts)
    failures = len(attempts) - len(successes)
    p = failures / len(attempts)
    t = success_s / len(successes) if successes else total_s / len(attempts)
    n = shots
    clean_batch = (1 - p) ** n
    return {
        "shots": n,
        "attempts": len(attempts),
        "failed_attempts": failures,
        "transient_failures": sum(a.outcome == "transient" for a in attempts),
        "permanent_failures": sum(a.outcome == "permanent" for a in attempts),
        "gpu_seconds": round(total_s, 1),
        "gpu_seconds_success": round(success_s, 1),
        "gpu_seconds_wasted": round(total_s - success_s, 1),
        "failure_rate": round(p, 4),
        "mean_shot_s": round(t, 3),
        "expected_missing_shots_skip": round(n * p, 2),
        "expected_batches_rerun": round(1 / clean_batch, 3) if clean_batch > 0 else None,
        "expected_attempts_per_shot_tiered": round(1 / (1 - p), 3) if p < 1 else None,
        "expected_s_skip_failures": round(n * t, 1),
        "expected_s_rerun_whole_batch": round(n * t / clean_batch, 1) if clean_batch > 0 else None,
        "expected_s_tiered_retry": round(n * t / (1 - p), 1) if p < 1 else None,
    }


class ModelTry(Protocol):
    """What ``model_load_cost`` reads of a try (``store.ModelLoadRecord`` has it);
    read-only, as a frozen record's fields are."""

    @property
    def server(self) -> str | None: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def gpu_seconds(self) -> float | None: ...


@dataclass(frozen=True)
class ModelLoadCost:
    """Model loads of a batch and the GPU seconds they took: in all, and per server as
    ``{server: (loads, seconds)}`` (seconds rounded to 0.1)."""

    loads: int
    gpu_seconds: float
    by_server: dict[str, tuple[int, float]]


def model_load_cost(tries: Iterable[ModelTry]) -> ModelLoadCost:
    """Count the tries whose server had to load a model and that ran (GPU seconds known),
    and estimate what each load took: the try's GPU seconds less the median GPU seconds
    of the tries of the same models that loaded nothing (of any models when there are
    none; nothing when no try loaded nothing, so the whole try counts), never below 0.
    ComfyUI does not report the time a loader took, so this is the seed's cost model
    with its largest term: a prompt whose model is loaded costs its usual time."""
    tally = ModelCostTally()
    tally.add(tries)
    return tally.cost()


class ModelCostTally:
    """``model_load_cost`` of tries given a page at a time (``add``): it holds the GPU
    seconds of the tries that loaded nothing (8 bytes each, for their medians) and the
    models, server and GPU seconds of those that loaded, not the tries."""

    def __init__(self) -> None:
        self.plain: dict[tuple[str, ...], array[float]] = {}
        self.loads: list[tuple[tuple[str, ...], str, float]] = []
        self.tries = 0  # every try added, run or not

    def add(self, tries: Iterable[ModelTry]) -> None:
        """Count ``tries`` in."""
        for t in tries:
            self.tries += 1
            if t.gpu_seconds is None:
                continue
            if t.loaded:
                self.loads.append((tuple(t.models), t.server or "-", t.gpu_seconds))
            else:
                self.plain.setdefault(tuple(t.models), array("d")).append(t.gpu_seconds)

    def cost(self) -> ModelLoadCost:
        """The ``model_load_cost`` of every try added."""
        usual = {models: statistics.median(seconds) for models, seconds in self.plain.items()}
        everyone = [s for seconds in self.plain.values() for s in seconds]
        anyone = statistics.median(everyone) if everyone else 0.0
        by_server: dict[str, list[float]] = {}
        for models, server, seconds in self.loads:
            extra = seconds - usual.get(models, anyone)
            by_server.setdefault(server, []).append(max(extra, 0.0))
        return ModelLoadCost(
            loads=sum(len(s) for s in by_server.values()),
            gpu_seconds=round(sum(sum(s) for s in by_server.values()), 1),
            by_server={name: (len(s), round(sum(s), 1)) for name, s in sorted(by_server.items())},
        )
