"""Exponential backoff with full jitter, checked without sleeping."""

from __future__ import annotations

import random

import pytest

from comfy_assets.render.backoff import RetryPolicy, backoff_delay


def test_without_jitter_the_delay_doubles_from_the_base_up_to_the_cap():
    delays = [backoff_delay(n, base_s=2.0, cap_s=60.0, jitter=False) for n in range(1, 9)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_full_jitter_draws_between_zero_and_the_exponential_ceiling():
    rng = random.Random(7)
    for attempt, ceiling in [(1, 2.0), (3, 8.0), (10, 60.0)]:
        draws = [backoff_delay(attempt, rng=rng) for _ in range(500)]
        assert all(0.0 <= d <= ceiling for d in draws)
        # Spread over the whole range, not bunched at the top (that would be "equal jitter").
        assert min(draws) < ceiling * 0.1 and max(draws) > ceiling * 0.9


def test_the_same_seed_gives_the_same_delays():
    a = [backoff_delay(n, rng=random.Random(42)) for n in range(1, 6)]
    b = [backoff_delay(n, rng=random.Random(42)) for n in range(1, 6)]
    assert a == b


def test_a_huge_attempt_number_stays_at_the_cap():
    assert backoff_delay(10_000, jitter=False) == 60.0


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempt_numbers_start_at_one(attempt):
    with pytest.raises(ValueError, match="attempt must be >= 1"):
        backoff_delay(attempt)


def test_negative_base_or_cap_is_rejected():
    with pytest.raises(ValueError, match="base_s and cap_s"):
        backoff_delay(1, base_s=-1.0)


def test_retry_policy_defaults():
    p = RetryPolicy()
    assert (p.attempts, p.base_delay_s, p.max_delay_s, p.jitter, p.timeout_s) == (
        4,
        2.0,
        60.0,
        True,
        600.0,
    )


def test_retry_policy_delay_uses_its_own_base_and_cap():
    p = RetryPolicy(base_delay_s=0.5, max_delay_s=3.0, jitter=False)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    jittered = RetryPolicy(base_delay_s=0.5, max_delay_s=3.0)
    assert jittered.delay(2, random.Random(1)) == backoff_delay(
        2, base_s=0.5, cap_s=3.0, rng=random.Random(1)
    )


def test_attempts_count_the_first_try():
    p = RetryPolicy(attempts=3)
    assert [p.can_retry(n) for n in (1, 2, 3)] == [True, True, False]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attempts": 0}, "attempts must be >= 1"),
        ({"base_delay_s": -1.0}, "delays must be >= 0"),
        ({"timeout_s": 0.0}, "timeout_s must be > 0"),
    ],
)
def test_a_nonsense_policy_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)
