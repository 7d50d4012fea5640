"""What a batch cost in GPU time, and what three retry strategies are expected to cost.

Pure arithmetic on attempt records, so the numbers can go straight into Dagster metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
        "mean_shot_s": round(t, 1),
        "expected_missing_shots_skip": round(n * p, 2),
        "expected_batches_rerun": round(1 / clean_batch, 3) if clean_batch > 0 else None,
        "expected_attempts_per_shot_tiered": round(1 / (1 - p), 3) if p < 1 else None,
        "expected_s_skip_failures": round(n * t, 1),
        "expected_s_rerun_whole_batch": round(n * t / clean_batch, 1) if clean_batch > 0 else None,
        "expected_s_tiered_retry": round(n * t / (1 - p), 1) if p < 1 else None,
    }
