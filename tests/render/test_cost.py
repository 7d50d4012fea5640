"""cost_report on examples small enough to check by hand."""

from __future__ import annotations

import pytest

from comfy_assets.render.cost import AttemptCost, cost_report


def test_spent_seconds_failure_rate_and_three_strategies_by_hand():
    attempts = [
        AttemptCost("a", 10.0, "success"),
        AttemptCost("b", 6.0, "transient"),
        AttemptCost("b", 20.0, "success"),
        AttemptCost("c", 30.0, "success"),
    ]

    report = cost_report(attempts, shots=2)

    # p = 1/4, t = (10 + 20 + 30) / 3 = 20 s, n = 2
    assert report["gpu_seconds"] == 66.0
    assert report["gpu_seconds_success"] == 60.0
    assert report["gpu_seconds_wasted"] == 6.0
    assert report["failure_rate"] == 0.25
    assert report["mean_shot_s"] == 20.0
    assert report["expected_s_skip_failures"] == 40.0  # 2 * 20
    assert report["expected_missing_shots_skip"] == 0.5  # 2 * 0.25
    assert report["expected_s_tiered_retry"] == 53.3  # 40 / 0.75
    assert report["expected_attempts_per_shot_tiered"] == 1.333
    assert report["expected_s_rerun_whole_batch"] == 71.1  # 40 / 0.75^2
    assert report["expected_batches_rerun"] == 1.778


def test_rerunning_the_whole_batch_grows_with_the_number_of_shots():
    attempts = [AttemptCost("a", 10.0, "success")] * 9 + [AttemptCost("b", 10.0, "permanent")]

    small, large = cost_report(attempts, shots=2), cost_report(attempts, shots=40)

    # p = 0.1: tiered retry costs 1/0.9 per shot whatever n; a clean batch of 40 needs 0.9^-40 tries.
    assert large["expected_s_tiered_retry"] / large["expected_s_skip_failures"] == pytest.approx(
        1 / 0.9, abs=1e-3
    )
    assert small["expected_batches_rerun"] == 1.235
    assert large["expected_batches_rerun"] == 67.655
    assert large["permanent_failures"] == 1 and large["transient_failures"] == 0


def test_no_failures_makes_all_strategies_equal():
    report = cost_report([AttemptCost("a", 12.34, "success")], shots=3)

    assert report["failure_rate"] == 0.0
    assert report["expected_s_skip_failures"] == report["expected_s_tiered_retry"] == 37.0
    assert report["expected_s_rerun_whole_batch"] == 37.0


def test_when_every_attempt_failed_retries_never_finish():
    report = cost_report(
        [AttemptCost("a", 4.0, "transient"), AttemptCost("b", 6.0, "permanent")], shots=2
    )

    assert report["mean_shot_s"] == 5.0  # no success: mean of all attempts
    assert report["expected_s_tiered_retry"] is None
    assert report["expected_s_rerun_whole_batch"] is None
    assert report["gpu_seconds_wasted"] == 10.0


@pytest.mark.parametrize(
    ("attempts", "shots", "message"),
    [
        ([], 1, "at least one attempt"),
        ([AttemptCost("a", 1.0, "success")], 0, "shots must be >= 1"),
        ([AttemptCost("a", 1.0, "crashed")], 1, "job a: unknown outcome 'crashed'"),
        ([AttemptCost("a", -1.0, "success")], 1, "job a: negative seconds"),
    ],
)
def test_bad_input_is_refused_with_what_is_wrong(attempts, shots, message):
    with pytest.raises(ValueError, match=message):
        cost_report(attempts, shots)
