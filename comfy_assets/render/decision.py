"""What an attempt's result does to its job, decided without I/O: one pure function from
the facts (the result as blame left it, the job's counts, the farm's verdict, the policy)
to a move. ``render/settle.py`` gathers the facts and writes the move.

The moves, and the job state each one writes (``jobs/states.py``):

- ``Done``: the prompt rendered: ``succeeded`` with its files;
- ``Retry``: a failure not (yet) the job's, attempts left: ``failed_retryable``, then back
  in line at once (another server may run it: ``at_once``) or after its backoff delay;
- ``Pending``: ``failed_retryable`` and the claim let go, not run again in this batch:
  the batch stopped (a delivery stop, no server reachable), or every server that can run
  the job is quarantined, so nothing says its failures are the job's;
- ``DeadLetter``: ``failed_fatal`` with the reason (a permanent failure, or attempts
  used up); under the delivery policy it stops the batch;
- ``Degraded``: ``degraded`` with the reason, no files (the draft policy: a permanent
  failure, or an optional job out of attempts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from comfy_assets.render.backoff import RetryPolicy
from comfy_assets.render.outcome import Kind


@dataclass(frozen=True)
class Facts:
    """What is known of one attempt once blame has judged it.

    ``kind`` and ``reason``: the result as blame left it (a failure it judged the job's
    is ``permanent``); ``attempt``: the batch's attempt number (1 = the first);
    ``counted``: the job's own attempts, those sent elsewhere at once left out;
    ``at_once``: blame sends the job to another server now (no backoff); ``sick``: why
    every server that can run the job is quarantined, or None (looked at only when
    ``needs_farm_look`` says so); ``optional``: the job's ``optional`` flag; ``stopped``:
    why the batch stopped, or None.
    """

    kind: Kind
    reason: str
    attempt: int
    counted: int
    at_once: bool = False
    sick: str | None = None
    optional: bool = False
    stopped: str | None = None


@dataclass(frozen=True)
class Policy:
    """The batch's rules: ``retry`` (attempts and backoff), ``draft`` (failures degrade
    the job instead of dead-lettering it), ``stop_on_fatal`` (the delivery policy of a
    storyboard: its first dead letter stops the batch)."""

    retry: RetryPolicy
    draft: bool = False
    stop_on_fatal: bool = False


@dataclass(frozen=True)
class Done:
    """The job succeeded."""


@dataclass(frozen=True)
class Retry:
    """The job runs again: at once on another server (``at_once``) or after ``delay_s``
    seconds."""

    delay_s: float
    at_once: bool


@dataclass(frozen=True)
class Pending:
    """The job is not run again in this batch and stays pending: ``why`` says so
    (``stopped``: the batch stopped; else every server that can run it is quarantined)."""

    why: str
    stopped: bool


@dataclass(frozen=True)
class DeadLetter:
    """The job is a dead letter with ``reason``; ``stops``: why the batch stops now (the
    delivery policy), or None."""

    reason: str
    stops: str | None = None


@dataclass(frozen=True)
class Degraded:
    """The job is done without files (the draft policy), with ``reason``."""

    reason: str


Move = Done | Retry | Pending | DeadLetter | Degraded


def needs_farm_look(kind: Kind, counted: int, policy: Policy) -> bool:
    """Whether ``decide`` needs ``Facts.sick``: a failure not the job's with no attempt
    left (then a quarantined farm leaves it pending)."""
    return kind == "transient" and not policy.retry.can_retry(counted)


def decide(facts: Facts, policy: Policy, job_id: str, rng: random.Random | None = None) -> Move:
    """The move for one attempt's result (see the module docstring). ``job_id`` names the
    job in the reason the batch stops with; ``rng`` makes the backoff's jitter
    reproducible."""
    if facts.kind == "success":
        return Done()
    if facts.kind == "transient" and policy.retry.can_retry(facts.counted):
        if facts.stopped:
            return Pending(f"not retried in this run ({facts.stopped})", stopped=True)
        delay = 0.0 if facts.at_once else policy.retry.delay(facts.attempt, rng)
        return Retry(delay, facts.at_once)
    if facts.kind == "transient" and facts.sick is not None:
        return Pending(f"not run again, {facts.sick}", stopped=False)
    plural = "s" if facts.attempt > 1 else ""
    reason = (
        facts.reason
        if facts.kind == "permanent"
        else f"gave up after {facts.attempt} attempt{plural}, last: {facts.reason}"
    )
    if policy.draft and (facts.kind == "permanent" or facts.optional):
        return Degraded(reason)
    stops = None
    if policy.stop_on_fatal and not facts.stopped:
        stops = f"stopped after the fatal failure of job {job_id}: {reason}"
    return DeadLetter(reason, stops)
