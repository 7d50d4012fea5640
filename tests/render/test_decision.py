"""The move after an attempt, decided without I/O (``render/decision.py``): a table of
facts and the move each one makes."""

from __future__ import annotations

import random

import pytest

from comfy_assets.render.backoff import RetryPolicy
from comfy_assets.render.decision import (
    DeadLetter,
    Degraded,
    Done,
    Facts,
    Move,
    Pending,
    Policy,
    Retry,
    decide,
    needs_farm_look,
)

RETRY = RetryPolicy(attempts=3, base_delay_s=0.1, max_delay_s=1.0, jitter=False)
RUN = Policy(RETRY)
DRAFT = Policy(RETRY, draft=True)
DELIVERY = Policy(RETRY, stop_on_fatal=True)
SICK = "every server that can run it is quarantined (gpu0 quarantined for 60 s)"

CASES: list[tuple[str, Facts, Policy, Move]] = [
    ("a success is done", Facts("success", "", 1, 1), RUN, Done()),
    (
        "a success on the last attempt is done",
        Facts("success", "", 3, 3),
        DRAFT,
        Done(),
    ),
    (
        "a 500 on the first attempt waits its backoff",
        Facts("transient", "POST /prompt 500", 1, 1),
        RUN,
        Retry(0.1, at_once=False),
    ),
    (
        "the second retry waits twice as long",
        Facts("transient", "POST /prompt 500", 2, 2),
        RUN,
        Retry(0.2, at_once=False),
    ),
    (
        "a failure blame sends elsewhere goes at once",
        Facts("transient", "out of memory", 1, 1, at_once=True),
        RUN,
        Retry(0.0, at_once=True),
    ),
    (
        "tries sent elsewhere are not counted against the job",
        Facts("transient", "out of memory", 5, 1, at_once=True),
        RUN,
        Retry(0.0, at_once=True),
    ),
    (
        "a stopped batch retries nothing: the job stays pending",
        Facts("transient", "POST /prompt 500", 1, 1, stopped="stopped: no server reachable"),
        RUN,
        Pending("not retried in this run (stopped: no server reachable)", stopped=True),
    ),
    (
        "out of attempts: a dead letter that says so",
        Facts("transient", "POST /prompt 500", 3, 3),
        RUN,
        DeadLetter("gave up after 3 attempts, last: POST /prompt 500"),
    ),
    (
        "one attempt allowed and used: the reason says attempt, not attempts",
        Facts("transient", "deadline", 1, 1),
        Policy(RetryPolicy(attempts=1)),
        DeadLetter("gave up after 1 attempt, last: deadline"),
    ),
    (
        "out of attempts on a quarantined farm: left pending",
        Facts("transient", "POST /prompt 500", 3, 3, sick=SICK),
        RUN,
        Pending(f"not run again, {SICK}", stopped=False),
    ),
    (
        "a permanent failure is a dead letter at once, its reason as it is",
        Facts("permanent", "prompt_outputs_failed_validation: node 3", 1, 1),
        RUN,
        DeadLetter("prompt_outputs_failed_validation: node 3"),
    ),
    (
        "a permanent failure is not left pending on a quarantined farm",
        Facts("permanent", "failed on gpu0 and gpu1: boom", 2, 2, sick=SICK),
        RUN,
        DeadLetter("failed on gpu0 and gpu1: boom"),
    ),
    (
        "draft: a permanent failure degrades the job",
        Facts("permanent", "node 3: boom", 1, 1),
        DRAFT,
        Degraded("node 3: boom"),
    ),
    (
        "draft: a required job out of attempts is still a dead letter",
        Facts("transient", "POST /prompt 500", 3, 3),
        DRAFT,
        DeadLetter("gave up after 3 attempts, last: POST /prompt 500"),
    ),
    (
        "draft: an optional job out of attempts degrades",
        Facts("transient", "POST /prompt 500", 3, 3, optional=True),
        DRAFT,
        Degraded("gave up after 3 attempts, last: POST /prompt 500"),
    ),
    (
        "delivery: a storyboard's dead letter stops the batch",
        Facts("permanent", "node 3: boom", 1, 1),
        DELIVERY,
        DeadLetter("node 3: boom", stops="stopped after the fatal failure of job 7: node 3: boom"),
    ),
    (
        "delivery: a batch stopped already is not stopped again",
        Facts("permanent", "node 3: boom", 1, 1, stopped="stopped after job 2"),
        DELIVERY,
        DeadLetter("node 3: boom"),
    ),
]


@pytest.mark.parametrize(
    ("facts", "policy", "move"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_move_for_each_result(facts: Facts, policy: Policy, move: Move) -> None:
    assert decide(facts, policy, "7") == move


def test_the_backoff_is_jittered_within_its_ceiling() -> None:
    policy = Policy(RetryPolicy(attempts=4, base_delay_s=1.0, max_delay_s=60.0))
    moves = [
        decide(Facts("transient", "500", 3, 3), policy, "7", random.Random(seed))
        for seed in range(20)
    ]
    delays = {m.delay_s for m in moves if isinstance(m, Retry)}
    assert len(delays) == 20 and all(0.0 <= d <= 4.0 for d in delays)


@pytest.mark.parametrize(
    ("kind", "counted", "look"),
    [
        ("transient", 3, True),
        ("transient", 2, False),
        ("permanent", 3, False),
        ("success", 3, False),
    ],
)
def test_the_farm_is_looked_at_only_for_a_job_out_of_attempts(kind, counted, look) -> None:
    assert needs_farm_look(kind, counted, RUN) is look
