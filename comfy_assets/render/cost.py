"""What a batch cost in GPU time, what three retry strategies are expected to cost, and
what its model loads took.

Pure arithmetic on attempt records, so the numbers can go straight into Dagster metadata.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
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


def model_load_cost(tries: Sequence[ModelTry]) -> ModelLoadCost:
    """Count the tries whose server had to load a model and that ran (GPU seconds known),
    and estimate what each load took: the try's GPU seconds less the median GPU seconds
    of the tries of the same models that loaded nothing (of any models when there are
    none; nothing when no try loaded nothing, so the whole try counts), never below 0.
    ComfyUI does not report the time a loader took, so this is the seed's cost model
    with its largest term: a prompt whose model is loaded costs its usual time."""
    plain: dict[tuple[str, ...], list[float]] = {}
    for t in tries:
        if not t.loaded and t.gpu_seconds is not None:
            plain.setdefault(tuple(t.models), []).append(t.gpu_seconds)
    everyone = [s for seconds in plain.values() for s in seconds]
    by_server: dict[str, list[float]] = {}
    for t in tries:
        if not t.loaded or t.gpu_seconds is None:
            continue
        usual = plain.get(tuple(t.models)) or everyone
        extra = t.gpu_seconds - (statistics.median(usual) if usual else 0.0)
        by_server.setdefault(t.server or "-", []).append(max(extra, 0.0))
    return ModelLoadCost(
        loads=sum(len(s) for s in by_server.values()),
        gpu_seconds=round(sum(sum(s) for s in by_server.values()), 1),
        by_server={name: (len(s), round(sum(s), 1)) for name, s in sorted(by_server.items())},
    )
