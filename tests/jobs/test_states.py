"""The job state machine allows exactly the listed transitions."""

from __future__ import annotations

import itertools

import pytest

from comfy_assets.jobs.states import (
    DONE,
    InvalidTransition,
    State,
    check_transition,
    is_allowed,
)

EXPECTED = {
    ("pending", "submitted"),
    ("pending", "succeeded"),
    ("pending", "failed_fatal"),
    ("pending", "degraded"),
    ("pending", "failed_retryable"),
    ("submitted", "rendering"),
    ("submitted", "succeeded"),
    ("submitted", "failed_retryable"),
    ("submitted", "failed_fatal"),
    ("submitted", "degraded"),
    ("rendering", "succeeded"),
    ("rendering", "degraded"),
    ("rendering", "failed_retryable"),
    ("rendering", "failed_fatal"),
    ("failed_retryable", "pending"),
    ("failed_retryable", "failed_fatal"),
    ("failed_fatal", "pending"),
    ("succeeded", "pending"),
    ("degraded", "pending"),
}


def test_there_are_seven_states():
    assert {s.value for s in State} == {
        "pending",
        "submitted",
        "rendering",
        "succeeded",
        "degraded",
        "failed_retryable",
        "failed_fatal",
    }


@pytest.mark.parametrize("pair", sorted(EXPECTED))
def test_listed_transitions_are_allowed(pair):
    check_transition(*pair)  # raises if not
    assert is_allowed(*pair)


@pytest.mark.parametrize(
    "pair", sorted(set(itertools.product([s.value for s in State], repeat=2)) - EXPECTED)
)
def test_every_other_transition_is_rejected(pair):
    with pytest.raises(InvalidTransition) as err:
        check_transition(*pair)
    assert not is_allowed(*pair)
    assert f"cannot go from {pair[0]} to {pair[1]}" in str(err.value)


def test_a_finished_job_cannot_be_rendered_again_without_going_back_to_pending():
    with pytest.raises(InvalidTransition, match="allowed: pending"):
        check_transition("succeeded", "rendering", job_id="j1")


def test_the_error_names_the_job_and_both_states():
    with pytest.raises(InvalidTransition) as err:
        check_transition(State.DEGRADED, State.SUBMITTED, job_id="abc")
    assert (err.value.job_id, err.value.from_state, err.value.to_state) == (
        "abc",
        "degraded",
        "submitted",
    )
    assert str(err.value).startswith("job abc: cannot go from degraded to submitted")


def test_an_unknown_state_name_is_rejected_by_name():
    with pytest.raises(InvalidTransition, match="unknown state 'succeded'"):
        check_transition("rendering", "succeded")
    assert not is_allowed("nope", "pending")


def test_done_means_succeeded_or_degraded():
    assert DONE == {"succeeded", "degraded"}
    assert "failed_fatal" not in DONE
