"""Runs whose process is gone: failed so that run retries launch them again.

A render run's batch registers an owner in the result store (``comfy_owners``, its
``run_id`` the Dagster run id) and beats every ``OWNER_BEAT_S`` seconds; by the
database's clock it is gone after ``OWNER_DEAD_S`` seconds of silence. When the host of
a run dies with its code server, nothing of Dagster's notices: ``DefaultRunLauncher``
has no worker health check, and the run stays STARTED, blocking the next run of its job
file (one run per ``dagster/partition``). ``dead_runs_sensor`` asks the store instead:
every ``DEAD_RUNS_INTERVAL_S`` seconds it looks at the STARTED runs, and a run that
``dead_run_reason`` judges dead has its gone owners marked found gone (their process,
should it beat again, stops at once) and is then reported failed, which Dagster's run
retries react to as to any run failure that is not an asset's.

No runtime limit is involved: a run whose owner beats is never touched, however long it
runs. STARTING runs are run monitoring's (``start_timeout_seconds``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from dagster import (
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRecord,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from comfy_assets.farm.names import DEFAULT_FARM, Farm
from comfy_assets.farm.resources import ResultStoreResource
from comfy_assets.store import OWNER_DEAD_S, OwnerRecord, StoreDiskFull, StoreUnavailable

# Seconds between the sensor's ticks: a dead run is failed OWNER_DEAD_S plus at most
# this (and the daemon's own tick) after its last heartbeat.
DEAD_RUNS_INTERVAL_S = 15
# A render run with no live owner this long (never registered, or its batch ended and
# the run has not) is dead too. Far above the seconds a run takes to reach its batch,
# and above the wait between two tries of a step stopped by unreachable servers.
NO_LIVE_OWNER_S = 600.0
# How long a store call waits out a database outage here: a tick must stay well under
# the code server's sensor timeout (60 s); the next tick tries again.
STORE_RETRY_S = 5.0


def dead_run_reason(
    owners: Sequence[OwnerRecord],
    *,
    started_s_ago: float | None,
    renders: bool,
    no_live_owner_s: float = NO_LIVE_OWNER_S,
) -> str | None:
    """Why a STARTED run is dead, or None while it may be alive.

    ``owners``: the run's owner rows (``Store.owners(run_ids=[run_id])``);
    ``started_s_ago``: seconds since Dagster marked it STARTED (None: unknown), by the
    hosts' clocks (the run worker's against the code location's), which is why only the
    ``no_live_owner_s`` rule uses it: ten minutes leave room for clocks a minute apart;
    ``renders``: whether the run renders (so its batch registers an owner).

    - an owner not gone: alive, whatever the run's age;
    - the newest owner gone without being released (silent past ``OWNER_DEAD_S`` by the
      database's clock, or found gone by another process): dead;
    - a rendering run with no owner at all ``no_live_owner_s`` after it started, or
      whose newest owner was released that long ago: dead (its process died before its
      batch began, or after it ended);
    - otherwise None.
    """
    if any(not o.gone for o in owners):
        return None
    if owners:
        newest = max(owners, key=lambda o: (o.started_at, o.owner))
        where = f"owner {newest.owner} (host {newest.host}, pid {newest.pid})"
        if newest.released_at is None:
            how = (
                "was found gone by another process"
                if newest.gone_at is not None
                else f"has had no heartbeat in the result store for {newest.beat_age_s:.0f} s"
            )
            return (
                f"its batch's {where} {how} (by the database's clock; an owner is gone "
                f"after {OWNER_DEAD_S:.0f} s without one): the run is taken for dead, and "
                "its process, should it beat again, stops at once"
            )
        if renders and newest.beat_age_s >= no_live_owner_s:
            return (
                f"its batch ended {newest.beat_age_s:.0f} s ago ({where} released) and the "
                "run has not ended since: the run is taken for dead"
            )
        return None
    if renders and started_s_ago is not None and started_s_ago >= no_live_owner_s:
        return (
            f"it started {started_s_ago:.0f} s ago and no batch of it has registered in "
            "the result store: the run is taken for dead"
        )
    return None


def renders_run(record: RunRecord, farm: Farm = DEFAULT_FARM) -> bool:
    """Whether the run renders a job file of ``farm`` (its ``render_job``, or a selection
    with its renders)."""
    run = record.dagster_run
    return run.job_name == farm.name("render_job") or farm.key("renders") in (
        run.asset_selection or ()
    )


def failure_message(reason: str, farm: Farm = DEFAULT_FARM) -> str:
    """The message of the run failure the farm's dead_runs_sensor reports."""
    return f"{farm.name('dead_runs_sensor')}: marked failed: {reason}."


def build_dead_runs_sensor(farm: Farm) -> SensorDefinition:
    """The farm's ``dead_runs_sensor`` (prefixed), asking the farm's result store. A run
    of another farm has no owner in this store and is not this farm's render: it is
    never judged dead here."""

    @sensor(
        name=farm.name("dead_runs_sensor"),
        minimum_interval_seconds=DEAD_RUNS_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        required_resource_keys={farm.store_key},
        description="Fails a STARTED run whose batch's owner has stopped beating in the "
        "result store (its host died), so that run retries launch it again and the next "
        "run of its job file starts.",
    )
    def dead_runs_sensor(context: SensorEvaluationContext, **_passed: object) -> SkipReason:
        """Fail the STARTED runs ``dead_run_reason`` judges dead. (Called directly, Dagster
        passes the required resources as keywords too; the context has them either way.)"""
        return dead_runs_tick(context, getattr(context.resources, farm.store_key), farm)

    return dead_runs_sensor


def dead_runs_tick(
    context: SensorEvaluationContext,
    result_store: ResultStoreResource,
    farm: Farm = DEFAULT_FARM,
) -> SkipReason:
    """Fail the STARTED runs ``dead_run_reason`` judges dead; the skip reason says what
    was done (the sensor requests no runs)."""
    instance = context.instance
    records = list(instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.STARTED])))
    if not records:
        return SkipReason("no run in progress")
    try:
        with result_store.open(retry_s=STORE_RETRY_S) as store:
            owners: dict[str, list[OwnerRecord]] = defaultdict(list)
            for o in store.owners(run_ids=[r.dagster_run.run_id for r in records]):
                if o.run_id is not None:
                    owners[o.run_id].append(o)
            now = time.time()
            failed: list[str] = []
            for record in records:
                run = record.dagster_run
                started = record.start_time
                reason = dead_run_reason(
                    owners[run.run_id],
                    started_s_ago=None if started is None else now - started,
                    renders=renders_run(record, farm),
                )
                if reason is None:
                    continue
                # Found gone first: should the process beat again, it stops before the
                # retry takes its claims. An owner that beat meanwhile is alive.
                silent = [
                    o
                    for o in owners[run.run_id]
                    if o.gone and o.gone_at is None and o.released_at is None
                ]
                if any(store.mark_owner_gone(o.owner) is None for o in silent):
                    continue
                if fail_run(context, run.run_id, reason, farm):
                    failed.append(f"{run.run_id} ({reason})")
    except (StoreUnavailable, StoreDiskFull) as e:
        context.log.warning(f"the result store did not answer ({e}); trying again next tick")
        return SkipReason(f"the result store did not answer: {e}")
    if failed:
        return SkipReason(f"failed {len(failed)} dead run(s): " + "; ".join(failed))
    return SkipReason(f"{len(records)} run(s) in progress, none dead")


def fail_run(
    context: SensorEvaluationContext, run_id: str, reason: str, farm: Farm = DEFAULT_FARM
) -> bool:
    """Report ``run_id`` failed with ``reason`` if it is still STARTED; True if it was."""
    instance = context.instance
    run = instance.get_run_by_id(run_id)
    if run is None or run.status != DagsterRunStatus.STARTED:
        return False
    message = failure_message(reason, farm)
    context.log.warning(f"run {run_id}: {message}")
    # A failure with no reason, as run monitoring reports a dead worker's: run retries
    # re-launch it (only an asset's failure is kept from them by the profile).
    instance.report_run_failed(run, message)
    return True
